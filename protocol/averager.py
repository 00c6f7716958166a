"""One averaging round, from the caller's side: the only entry point the peer (and the benchmarks) use.

    averager = Averager(transport, RoundConfig(...), model)      # hooks: test harness only
    averager.start()
    found = averager.find_group(r, state_hash)                   # a future: keep training while it resolves
    outcome = found.result()                                     # a Group, or Behind (fetch that state instead)
    result = averager.run_round(group, Contribution(delta=Δ, tokens=n, staleness=s), apply=outer_step)

`run_round` hides who leads. The leader collects and checks every contribution, averages them with bounded token
weights, calls `apply(average)` (the caller's outer step, which returns the new state hash) and only then sends
every member the average with that hash. A member sends its contribution, receives the average, applies it and
compares its own new hash with the leader's. Atomicity: θ_{r+1} exists only if the leader committed it. If the
leader dies first, every member times out and discards the round (its local progress goes into the next one); a
member that misses a committed result is behind and re-syncs to the committed state by hash.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protocol import swarmloco_wire_pb2 as pb
from protocol.codecs import CodecError, get_codec
from protocol.data_plane import DataPlane
from protocol.exchange import broadcast, collect, send_contribution
from protocol.hooks import Hooks
from protocol.matchmaking import Group, Matchmaker, RoundAborted
from protocol.rounds import Behind, Deadlines, LocalModel, Outcome, RoundConfig, token_weights, weighted_average
from protocol.transport import Transport
from protocol.wire import WireError, frame_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Contribution:
    delta: torch.Tensor  # flat fp32 pseudo-gradient Δ = θ_r − θ_local
    tokens: int  # tokens trained since θ_r: the merge weight the peer claims
    staleness: int = 0  # rounds between the Δ's base state and θ_r


@dataclass
class RoundResult:
    """How one round ended for this peer, and what it saw of it."""

    outcome: Outcome
    round: int  # the round that was closed (θ_r → θ_{r+1})
    leader: str
    role: str  # "leader" or "member"
    members: list[str] = field(default_factory=list)  # contributors whose Δ is in the average
    weights: list[int] = field(default_factory=list)  # their bounded token weights, same order
    excluded: dict[str, str] = field(default_factory=dict)  # peer -> why its contribution was dropped
    state_hash: str = ""  # our θ_{r+1} hash (empty when nothing was applied)
    leader_hash: str = ""  # the leader's θ_{r+1} hash
    reason: str = ""  # why the round was discarded
    bytes_sent: int = 0
    bytes_received: int = 0
    direct: int = 0  # contributions that moved on the TCP data plane (member: 1 if its own did)
    seconds: float = 0.0


@dataclass
class _Average:
    delta: torch.Tensor
    encoded: bytes | memoryview
    members: list[str]
    weights: list[int]
    excluded: dict[str, str]
    received: int
    direct: int


class Averager:
    """Owns the round protocol of one peer: the join handler, the data plane, matchmaking and the exchange."""

    def __init__(
        self, transport: Transport, cfg: RoundConfig, model: LocalModel, *, hooks: Hooks | None = None
    ) -> None:
        self.transport, self.cfg, self.model = transport, cfg, model
        self.hooks = hooks or Hooks()
        self.codec = get_codec(cfg.codec)
        self.deadlines = Deadlines.of(cfg)
        self.data_plane: DataPlane | None = None
        self.matchmaker: Matchmaker | None = None

    def start(self, *, timeout: float = 30.0) -> None:
        self.transport.call(self._start(), timeout=timeout)

    async def _start(self) -> None:
        hosts = self.transport.data_plane_hosts()
        if hosts is not None:
            self.data_plane = DataPlane(bind_host=hosts[0], advertise_hosts=hosts[1])
            await self.data_plane.start()
        self.matchmaker = Matchmaker(
            self.transport, self.cfg, self.model, data_plane=self.data_plane, dial_data_plane=hosts is not None
        )
        await self.matchmaker.register()

    def close(self, *, timeout: float = 10.0) -> None:
        if self.data_plane is not None:
            self.transport.call(self.data_plane.close(), timeout=timeout)

    def set_state(self, round_number: int, state_hash: str) -> None:
        """The global state this peer now holds (thread-safe)."""
        assert self.matchmaker is not None, "call start() first"
        self.transport.loop.call_soon_threadsafe(self.matchmaker.set_state, round_number, state_hash)

    def find_group(self, round_number: int, state_hash: str) -> concurrent.futures.Future[Group | Behind]:
        """Start matchmaking for round r; the future resolves to a closed Group or a Behind, or raises RoundAborted
        after round_timeout_s. Cancelling it gives the round up."""
        assert self.matchmaker is not None, "call start() first"
        return self.transport.submit(self.matchmaker.form_group(round_number, state_hash))

    def run_round(
        self, group: Group, contribution: Contribution, *, apply: Callable[[torch.Tensor], str]
    ) -> RoundResult:
        """Exchange and apply one round; called from the training thread, which `apply` runs on."""
        started = time.monotonic()
        role = "leader" if group.is_leader else "member"
        d = self.deadlines
        try:
            if group.is_leader:
                average = self.transport.call(self._reduce(group, contribution), timeout=d.exchange)
                self.hooks.before_commit(group.round)
                new_hash = apply(average.delta)
                sent = self._deliver(group, average, new_hash)
                result = RoundResult(
                    Outcome.COMMITTED,
                    group.round,
                    group.leader,
                    role,
                    average.members,
                    average.weights,
                    average.excluded,
                    new_hash,
                    new_hash,
                    bytes_sent=sent,
                    bytes_received=average.received,
                    direct=average.direct,
                )
            else:
                result, average_delta = self.transport.call(
                    self._exchange_as_member(group, contribution), timeout=d.exchange
                )
                result.state_hash = apply(average_delta)
                if result.state_hash != result.leader_hash:
                    result.outcome = Outcome.MISMATCH
        except (RoundAborted, concurrent.futures.TimeoutError, TimeoutError) as exc:
            if group.is_leader:
                self.transport.submit(self._abort(group, str(exc) or "timed out"))
            else:
                self.transport.submit(self._release(group))
            return RoundResult(
                Outcome.DISCARDED,
                group.round,
                group.leader,
                role,
                list(group.members),
                reason=str(exc) or f"{type(exc).__name__} after {time.monotonic() - started:.1f}s",
            )
        result.seconds = time.monotonic() - started
        return result

    # --- leader ---------------------------------------------------------------------------------------------------
    def _deliver(self, group: Group, average: _Average, new_hash: str) -> int:
        """Send the committed result; returns the bytes delivered. Past this point the round is committed whatever
        happens to the sends: a member that misses the result finds itself behind and fetches θ_{r+1} by hash."""
        d = self.deadlines
        try:
            return self.transport.call(self._commit(group, average, new_hash), timeout=d.transfer + 2 * d.control)
        except (concurrent.futures.TimeoutError, TimeoutError):
            logger.warning("round %d: delivering the result timed out; members that missed it re-sync", group.round)
            self.transport.submit(self._release(group))
            return 0

    async def _reduce(self, group: Group, own: Contribution) -> _Average:
        loop = asyncio.get_running_loop()
        got = await collect(
            group.links,
            codec=self.codec,
            numel=self.model.numel,
            max_staleness=self.cfg.max_staleness,
            timeout=self.deadlines.collect,
        )
        got.tensors[group.me] = own.delta.reshape(-1).to(torch.float32)
        got.claims[group.me] = (own.tokens, own.staleness)
        exact = token_weights(got.claims, leader=group.me, cfg=self.cfg)
        for peer, (claimed, _) in got.claims.items():
            if claimed > self.cfg.weight_cap_factor * max(own.tokens, 1):
                logger.warning(
                    "capping %s's claimed %d tokens at %.0f× ours", peer[-8:], claimed, self.cfg.weight_cap_factor
                )
        average = weighted_average(got.tensors, exact)
        encoded = await loop.run_in_executor(None, self.codec.encode, average)
        # Everyone must apply exactly what members will decode; for a lossless codec that is the average itself.
        if not self.codec.lossless:
            average = await loop.run_in_executor(None, self.codec.decode, bytearray(encoded), self.model.numel)
        members = sorted(exact)
        return _Average(
            delta=average,
            encoded=encoded,
            members=members,
            weights=[round(exact[p]) for p in members],
            excluded=got.excluded,
            received=got.bytes,
            direct=sum(link.direct is not None for link in group.links.values()),
        )

    async def _commit(self, group: Group, average: _Average, new_hash: str) -> int:
        header = pb.RoundResult(
            outcome=pb.RoundResult.COMMITTED,
            round=group.round,
            new_state_hash=new_hash,
            members=average.members,
            weights=average.weights,
            excluded=list(average.excluded),
            excluded_reasons=list(average.excluded.values()),
            codec=self.codec.name,
            numel=self.model.numel,
        )
        try:
            return await broadcast(group.links, header, average.encoded, timeout=self.deadlines.transfer)
        finally:
            await self._release(group)

    async def _abort(self, group: Group, reason: str) -> None:
        header = pb.RoundResult(outcome=pb.RoundResult.ABORTED, reason=reason, round=group.round)
        try:
            await broadcast(group.links, header, timeout=self.deadlines.control)
        finally:
            await self._release(group)

    async def _release(self, group: Group) -> None:
        """The exchange is over: join handlers may end, data connections close (after delivering what was sent)."""
        if group.release is not None and not group.release.done():
            group.release.set_result(None)
        for link in group.links.values():
            if self.data_plane is not None and link.token:
                self.data_plane.forget(link.token)
            if link.direct is not None:
                link.direct.close()
            if not group.is_leader:
                link.close()

    # --- member ---------------------------------------------------------------------------------------------------
    async def _exchange_as_member(self, group: Group, own: Contribution) -> tuple[RoundResult, torch.Tensor]:
        link = group.links[group.leader]
        d = self.deadlines
        delta, tokens = self.hooks.contribution(group.round, own.delta, own.tokens)
        cap = self.codec.encoded_size(self.model.numel)
        try:
            payload = await asyncio.get_running_loop().run_in_executor(None, self.codec.encode, delta)
            header = pb.Contribution(tokens=tokens, codec=self.codec.name, numel=delta.numel(), staleness=own.staleness)
            sent = await send_contribution(link, header, payload, timeout=d.transfer)
            self.hooks.after_send(group.round)
            result, body = await link.recv(pb.RoundResult, max_payload=cap, timeout=d.result)
        except WireError as exc:
            raise RoundAborted(f"lost the leader during the exchange: {exc}") from exc
        finally:
            await self._release(group)
        if result.outcome != pb.RoundResult.COMMITTED:
            raise RoundAborted(f"leader aborted the round: {result.reason}")
        if result.round != group.round or result.numel != self.model.numel or result.codec != self.codec.name:
            raise RoundAborted("leader's result does not match the round")
        try:
            average = await asyncio.get_running_loop().run_in_executor(None, self.codec.decode, body, self.model.numel)
        except CodecError as exc:
            raise RoundAborted(f"leader sent a malformed average: {exc}") from exc
        out = RoundResult(
            Outcome.COMMITTED,
            group.round,
            group.leader,
            "member",
            list(result.members),
            list(result.weights),
            dict(zip(result.excluded, result.excluded_reasons, strict=False)),
            leader_hash=result.new_state_hash,
            bytes_sent=sent,
            bytes_received=frame_bytes(result, len(body)),
            direct=int(link.direct is not None),
        )
        return out, average

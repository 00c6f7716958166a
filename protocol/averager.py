"""One averaging round, from the caller's side: the only entry point the peer (and the benchmarks) use.

    averager = Averager(transport, RoundConfig(...), model, credentials=..., gate=..., genesis_hash=...)
    averager.start()
    found = averager.find_group(r, state_hash)                   # a future: keep training while it resolves
    outcome = found.result()                                     # a Group, or Behind (fetch that state instead)
    result = averager.run_round(group, Contribution(delta=Δ, tokens=n, staleness=s), apply=outer_step,
                                rollback=undo_outer_step)

`run_round` hides who leads. The leader collects and checks every contribution, averages them with bounded token
weights, applies the average tentatively (`apply`, the caller's outer step, returns the new state hash) and sends
every member the average and the round's statement (run, r+1, previous and new hash, contributors and weights,
swarm size, cumulative work). Each member applies it tentatively too, checks that it reaches the same hash from the
same previous state, and signs the statement. With signatures of a majority of the active swarm the leader has a
commit certificate (`protocol.certificates`) and sends it to every member; only then does θ_{r+1} exist. Without
one — too few votes, a dead leader, a member that never hears back — everyone who applied rolls back to θ_r
(`rollback`), keeping its local progress for the next round. A member that misses a certificate that did form
sees the certified state in others' records and re-syncs to it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from protocol import swarmloco_wire_pb2 as pb
from protocol.admission import Credentials, Gate
from protocol.certificates import Certificate, Head, Statement, refusal_to_sign, signed_by
from protocol.chain import Chain
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
    certify_s: float = 0.0  # of `seconds`: signing the statement, gathering votes, sending the certificate
    certificate: Certificate | None = None  # committed (or, on a mismatch, the state to re-sync to)


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
    """Owns the round protocol of one peer: the join handler, the data plane, matchmaking, the exchange and the
    certified chain it is on."""

    def __init__(self, transport: Transport, cfg: RoundConfig, model: LocalModel, *, credentials: Credentials,
                 gate: Gate, genesis_hash: str, hooks: Hooks | None = None) -> None:
        self.transport, self.cfg, self.model = transport, cfg, model
        self.credentials, self.gate = credentials, gate
        self.hooks = hooks or Hooks()
        self.codec = get_codec(cfg.codec)
        self.deadlines = Deadlines.of(cfg)
        self.chain = Chain(transport, gate=gate, credentials=credentials, fingerprint=model.fingerprint,
                           quorum=cfg.quorum, genesis_hash=genesis_hash, control_timeout=cfg.control_timeout_s)
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
            self.transport, self.cfg, self.model, chain=self.chain, gate=self.gate, credentials=self.credentials,
            data_plane=self.data_plane, dial_data_plane=hosts is not None,
        )
        await self.matchmaker.register()

    def close(self, *, timeout: float = 10.0) -> None:
        if self.data_plane is not None:
            self.transport.call(self.data_plane.close(), timeout=timeout)

    @property
    def head(self) -> Head:
        return self.chain.head

    def set_state(self, head: Head) -> None:
        """The certified state this peer now holds (thread-safe; in effect when it returns)."""
        assert self.matchmaker is not None, "call start() first"

        async def apply() -> None:
            assert self.matchmaker is not None
            self.chain.set_head(head)
            self.matchmaker.set_state(head.round, head.state_hash, head.seed)

        self.transport.call(apply(), timeout=self.cfg.control_timeout_s)

    def find_group(self, round_number: int, state_hash: str) -> concurrent.futures.Future[Group | Behind]:
        """Start matchmaking for round r; the future resolves to a closed Group or a Behind, or raises RoundAborted
        after round_timeout_s. Cancelling it gives the round up."""
        assert self.matchmaker is not None, "call start() first"
        return self.transport.submit(self.matchmaker.form_group(round_number, state_hash))

    def run_round(self, group: Group, contribution: Contribution, *, apply: Callable[[torch.Tensor], str],
                  rollback: Callable[[], None] = lambda: None) -> RoundResult:
        """Exchange, apply and certify one round; called from the training thread, which `apply` and `rollback`
        run on. `apply` makes the outer step and returns the new state hash; `rollback` undoes it, and is called
        whenever the round ends without a certificate after `apply` ran."""
        started = time.monotonic()
        prev = self.chain.head
        role = "leader" if group.is_leader else "member"
        applied = False
        result: RoundResult | None = None
        try:
            if group.is_leader:
                average = self.transport.call(self._reduce(group, contribution), timeout=self.deadlines.exchange)
                self.hooks.before_commit(group.round)
                statement = self._statement(group, prev, average)
                applied = True
                new_hash = apply(average.delta)
                statement = replace(statement, new_hash=new_hash)
                result = self._certify_as_leader(group, average, statement)
            else:
                result, average_delta, statement = self.transport.call(
                    self._exchange_as_member(group, contribution, prev), timeout=self.deadlines.exchange
                )
                applied = True
                result.state_hash = apply(average_delta)
                certify_started = time.monotonic()
                result = self._certify_as_member(group, result, statement)
                result.certify_s = time.monotonic() - certify_started
        except Exception as exc:  # noqa: BLE001 - whatever ends the round early, nothing uncertified is kept
            if not isinstance(exc, (RoundAborted, concurrent.futures.TimeoutError, TimeoutError)):
                logger.exception("round %d failed unexpectedly; discarding it", group.round)
            self.transport.submit(self._abort(group, str(exc) or "timed out") if group.is_leader
                                  else self._release(group))
            result = RoundResult(Outcome.DISCARDED, group.round, group.leader, role, list(group.members),
                                 reason=str(exc) or f"{type(exc).__name__} after {time.monotonic() - started:.1f}s")
        finally:
            if applied and (result is None or result.outcome != Outcome.COMMITTED):
                rollback()
            if not group.is_leader and (result is None or result.outcome == Outcome.DISCARDED):
                self._skip_leader(group.leader, result.reason if result is not None else "the round failed")
        if result.outcome == Outcome.COMMITTED and result.certificate is not None:
            self.set_state(Head.of(result.certificate))
        result.seconds = time.monotonic() - started
        return result

    def _skip_leader(self, leader: str, why: str) -> None:
        matchmaker = self.matchmaker
        if matchmaker is not None:
            self.transport.loop.call_soon_threadsafe(matchmaker.skip_leader, leader, why[:200])

    def _statement(self, group: Group, prev: Head, average: _Average) -> Statement:
        if group.round != prev.round:
            raise RoundAborted(f"round {group.round} formed, but we hold round {prev.round}")
        return Statement(run_id=self.transport.run_id, round=group.round + 1, prev_hash=prev.state_hash,
                         new_hash="0" * 64, members=tuple(average.members), weights=tuple(average.weights),
                         swarm=group.swarm, work=prev.work + sum(average.weights))

    # --- leader ---------------------------------------------------------------------------------------------------
    def _certify_as_leader(self, group: Group, average: _Average, statement: Statement) -> RoundResult:
        d = self.deadlines
        certificate, reason, sent, certify_s = self.transport.call(
            self._propose(group, average, statement), timeout=2 * d.transfer + 4 * d.control
        )
        outcome = Outcome.COMMITTED if certificate is not None else Outcome.DISCARDED
        return RoundResult(outcome, group.round, group.leader, "leader", average.members, average.weights,
                           average.excluded, statement.new_hash, statement.new_hash, reason=reason, bytes_sent=sent,
                           bytes_received=average.received, direct=average.direct, certify_s=certify_s,
                           certificate=certificate)

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

    async def _propose(self, group: Group, average: _Average,
                       statement: Statement) -> tuple[Certificate | None, str, int, float]:
        """Send the average and the statement, gather the members' signatures, and send the certificate (or why
        there is none). Returns (certificate or None, reason, bytes sent, seconds from the average sent to the
        certificate sent: what certification adds to the exchange)."""
        d = self.deadlines
        s = statement
        header = pb.RoundResult(
            outcome=pb.RoundResult.COMMITTED, round=group.round, new_state_hash=s.new_hash, members=s.members,
            weights=s.weights, excluded=list(average.excluded), excluded_reasons=list(average.excluded.values()),
            codec=self.codec.name, numel=self.model.numel, prev_hash=s.prev_hash, swarm=s.swarm, work=s.work,
        )
        try:
            sent = await broadcast(group.links, header, average.encoded, timeout=d.transfer)
            certify_started = time.monotonic()
            votes = await asyncio.gather(*(self._vote_of(link, d.transfer + d.control)
                                           for link in group.links.values()))
            body = s.body()
            signatures = {group.me: Certificate.sign(self.credentials.identity, s)}
            refusals = []
            for peer, vote in zip(group.links, votes, strict=True):
                if vote is not None and vote.accept and peer in s.members and signed_by(peer, body, vote.signature):
                    signatures[peer] = vote.signature
                elif vote is not None and not vote.accept:
                    refusals.append(f"{peer[-8:]}: {vote.reason[:200]}")
            tickets = {p: group.tickets.get(p, b"").decode(errors="replace") for p in signatures if p != group.me}
            tickets[group.me] = self.credentials.ticket.decode(errors="replace")
            certificate = Certificate(s, signatures, {p: t for p, t in tickets.items() if t})
            problem = self.chain.verify(certificate)
            if problem:
                reason = f"no certificate: {problem}" + (f" (refused by {'; '.join(refusals)})" if refusals else "")
                await broadcast(group.links, pb.Commit(ok=False, reason=reason), timeout=d.control)
                return None, reason, sent, time.monotonic() - certify_started
            await broadcast(group.links, pb.Commit(ok=True, certificate=certificate.to_bytes()), timeout=d.control)
            return certificate, "", sent, time.monotonic() - certify_started
        finally:
            await self._release(group)

    @staticmethod
    async def _vote_of(link: Any, timeout: float) -> pb.Vote | None:
        try:
            vote, _ = await link.recv(pb.Vote, max_payload=0, timeout=timeout)
            return vote
        except WireError:
            return None

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
    async def _exchange_as_member(self, group: Group, own: Contribution,
                                  prev: Head) -> tuple[RoundResult, torch.Tensor, Statement]:
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
            if result.outcome != pb.RoundResult.COMMITTED:
                raise RoundAborted(f"leader aborted the round: {result.reason}")
            if result.round != group.round or result.numel != self.model.numel or result.codec != self.codec.name:
                raise RoundAborted("leader's result does not match the round")
            statement = Statement(run_id=self.transport.run_id, round=group.round + 1, prev_hash=result.prev_hash,
                                  new_hash=result.new_state_hash, members=tuple(result.members),
                                  weights=tuple(int(w) for w in result.weights), swarm=int(result.swarm),
                                  work=int(result.work))
            problem = statement.problem() or refusal_to_sign(
                statement, prev, round_number=group.round, swarm=group.swarm, group_members=group.members,
                me=self.transport.peer_id, my_tokens=tokens, cap=self.cfg.weight_cap_factor)
            if problem:
                raise RoundAborted(f"leader's statement is not one we can sign: {problem}")
            average = await asyncio.get_running_loop().run_in_executor(None, self.codec.decode, body, self.model.numel)
        except WireError as exc:
            await self._release(group)
            raise RoundAborted(f"lost the leader during the exchange: {exc}") from exc
        except CodecError as exc:
            await self._release(group)
            raise RoundAborted(f"leader sent a malformed average: {exc}") from exc
        except BaseException:
            await self._release(group)
            raise
        out = RoundResult(
            Outcome.COMMITTED, group.round, group.leader, "member", list(result.members), list(result.weights),
            dict(zip(result.excluded, result.excluded_reasons, strict=False)), leader_hash=result.new_state_hash,
            bytes_sent=sent, bytes_received=frame_bytes(result, len(body)), direct=int(link.direct is not None),
        )
        return out, average, statement

    def _certify_as_member(self, group: Group, result: RoundResult, statement: Statement) -> RoundResult:
        d = self.deadlines
        agreed = result.state_hash == statement.new_hash
        certificate, reason = self.transport.call(
            self._vote(group, statement, agreed), timeout=2 * d.transfer + 4 * d.control
        )
        result.certificate = certificate
        if certificate is None:
            result.outcome, result.reason = Outcome.DISCARDED, reason
        elif not agreed:
            result.outcome = Outcome.MISMATCH  # certified without us: re-sync to the certified state
        return result

    async def _vote(self, group: Group, statement: Statement, agreed: bool) -> tuple[Certificate | None, str]:
        link = group.links[group.leader]
        d = self.deadlines
        me = self.transport.peer_id
        if agreed and me in statement.members:
            vote = pb.Vote(accept=True, signature=Certificate.sign(self.credentials.identity, statement))
        else:
            why = "our hash differs" if not agreed else "our contribution is not in the average"
            vote = pb.Vote(accept=False, reason=why)
        try:
            await link.send(vote, timeout=d.control)
            # the leader may still be sending the average to a slower member, then waits for every vote
            commit, _ = await link.recv(pb.Commit, max_payload=0, timeout=2 * d.transfer + 2 * d.control)
        except WireError as exc:
            return None, f"no certificate from the leader: {exc}"
        finally:
            await self._release(group)
        if not commit.ok:
            return None, f"leader has no certificate: {commit.reason[:300]}"
        try:
            certificate = Certificate.from_bytes(commit.certificate)
        except ValueError as exc:
            return None, f"leader sent a malformed certificate: {exc}"
        problem = self.chain.verify(certificate)
        if not problem and certificate.statement != statement:
            problem = "it certifies another statement than the one we were sent"
        if problem:
            return None, f"leader's certificate is invalid: {problem}"
        return certificate, ""

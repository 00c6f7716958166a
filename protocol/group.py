"""Asynchronous quorum rounds: group formation (matchmaking) and the leader-reduced, token-weighted average.

One round, seen from a peer that holds θ_r and has spent its budget:
1. It marks itself ready in its DHT record and looks at the records of compatible peers at the same (r, hash).
   The leader is the candidate already leading the most members, ties broken by the smallest peer id.
2. Members open a stream to the leader and send a JoinRequest; the leader accepts while it is collecting.
3. The leader closes the group once it has at least `quorum` peers *and* the grace window has passed. The window
   is sized from the peers' own estimates of when they will be ready (their measured step times), clamped to
   [grace_min_s, grace_max_s]; it closes at once when every expected peer has joined.
4. Members send their pseudo-gradient (encoded, with their token count); the leader validates each one (codec
   length, finiteness, token bound, staleness) and drops offenders, averages the rest with bounded token weights,
   encodes the average, and, once the training thread has applied the outer step, sends every member the average
   and the hash of θ_{r+1}. Members apply the same decoded average, so all end with the same hash.
Atomicity: θ_{r+1} exists only if the leader commits it. If the leader dies first, every member times out and
discards the round (keeping its local progress for the next one); a member that misses a committed result is
behind and re-syncs to the committed state by hash. No round ever has two different θ_{r+1} from one leader.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from protocol import swarmloco_wire_pb2 as pb
from protocol.codecs import CodecError, get_codec
from protocol.data_plane import DataConn, DataPlane, connect, hosts_from_maddrs
from protocol.faults import FaultInjector
from protocol.node import SwarmNode
from protocol.records import PROTOCOL_VERSION, PeerRecord, describe_difference
from protocol.wire import WireError, close_writer, frame_bytes, read_frame, write_frame

logger = logging.getLogger(__name__)

MAX_TOKENS = 2**40


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    quorum: int = 2
    grace_min_s: float = 0.5
    grace_max_s: float = 10.0
    round_timeout_s: float = 60.0  # a ready peer waits this long for a group before giving the round up
    exchange_timeout_s: float = 60.0  # deadline for moving one contribution / one result
    codec: str = "int8"
    max_group: int = 64
    weight_cap_factor: float = 8.0  # a member's token weight is capped at this × the leader's own
    stale_discount: float = 0.5  # weight × discount**staleness for a Δ computed from an older θ
    max_staleness: int = 2
    round_tokens: int = 0  # budget per round in tokens (0 = use inner_steps)
    round_seconds: float = 0.0  # budget per round in seconds (0 = use inner_steps)

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.quorum <= 10_000, "quorum", self.quorum, "1 .. 10000"),
            (0 <= self.grace_min_s <= self.grace_max_s <= 3600, "grace", (self.grace_min_s, self.grace_max_s), "0 <= grace_min_s <= grace_max_s <= 3600"),
            (1 <= self.round_timeout_s <= 86400, "round_timeout_s", self.round_timeout_s, "1 .. 86400"),
            (1 <= self.exchange_timeout_s <= 3600, "exchange_timeout_s", self.exchange_timeout_s, "1 .. 3600"),
            (2 <= self.max_group <= 10_000, "max_group", self.max_group, "2 .. 10000"),
            (1 <= self.weight_cap_factor <= 1e6, "weight_cap_factor", self.weight_cap_factor, "1 .. 1e6"),
            (0 < self.stale_discount <= 1, "stale_discount", self.stale_discount, "0 < discount <= 1"),
            (0 <= self.max_staleness <= 100, "max_staleness", self.max_staleness, "0 .. 100"),
            (0 <= self.round_tokens <= MAX_TOKENS, "round_tokens", self.round_tokens, f"0 .. {MAX_TOKENS}"),
            (0 <= self.round_seconds <= 86400, "round_seconds", self.round_seconds, "0 .. 86400"),
        ]
        for ok, name, value, allowed in checks:
            if not ok:
                raise ValueError(f"{name}: got {value!r}, allowed {allowed}")
        get_codec(self.codec)


@dataclass(frozen=True, kw_only=True)
class LocalModel:
    """What the protocol knows about the model: its fingerprint, config (for refusals) and flat size."""

    fingerprint: str
    config: dict[str, Any]
    numel: int

    @property
    def config_json(self) -> str:
        return json.dumps(self.config, sort_keys=True, default=str)


@dataclass
class Behind:
    """The swarm holds a newer (or different, agreed) global state: re-sync to it."""

    round: int
    state_hash: str
    donors: list[str]


@dataclass
class Group:
    round: int
    leader: str
    members: list[str]  # everyone in the group, leader first
    codec: str
    # leader: peer -> (reader, writer) of each member; member: the stream to the leader
    streams: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = field(default_factory=dict)
    is_leader: bool = False
    done: asyncio.Future[None] | None = None  # leader: resolves when handlers may close their streams
    # direct TCP data connections: leader: token and future per member, then the member's connection once used;
    # member: its connection to the leader, if it could open one
    data_tokens: dict[str, tuple[str, asyncio.Future[DataConn]]] = field(default_factory=dict)
    data: dict[str, DataConn] = field(default_factory=dict)


@dataclass
class Averaged:
    """The decoded average a peer applies, plus what the leader reported about the round."""

    delta: torch.Tensor
    members: list[str]
    weights: list[int]
    excluded: dict[str, str]
    new_state_hash: str | None  # members: the leader's θ_{r+1} hash to compare against; leader: None
    bytes_sent: int
    bytes_received: int
    direct: int = 0  # contributions that travelled on the TCP data plane (member: 1 if its own did)


class RoundAborted(RuntimeError):
    """The round was discarded; nothing was applied. The message says why."""


@dataclass
class _Collect:
    round: int
    members: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = field(default_factory=dict)
    closed: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class GroupAverager:
    """Runs on the node's loop. The training thread drives it via `node.submit(...)`."""

    def __init__(self, node: SwarmNode, cfg: RoundConfig, model: LocalModel) -> None:
        self.node, self.cfg, self.model = node, cfg, model
        self.codec = get_codec(cfg.codec)
        self.handler_name = f"swarmloco/{node.net.run_id}/avg/v{PROTOCOL_VERSION}"
        self.round = 0
        self.state_hash = ""
        self._collect: _Collect | None = None
        self.refusals: list[str] = []  # incompatibility messages seen, for the user
        self.faults = FaultInjector()
        self.data_plane: DataPlane | None = None

    async def register(self) -> None:
        await self.node.add_handler(self.handler_name, self._handle_join)
        net = self.node.net
        if net.data_plane:
            listen = hosts_from_maddrs(list(net.host_maddrs))
            advertise = hosts_from_maddrs(list(net.announce_maddrs) or self.node.visible_maddrs())
            if advertise:
                self.data_plane = DataPlane(bind_host=listen[0] if len(listen) == 1 else "0.0.0.0", advertise_hosts=advertise)
                await self.data_plane.start()

    def set_state(self, round_number: int, state_hash: str) -> None:
        """Called (on the loop) whenever the global state this peer holds changes."""
        self.round, self.state_hash = round_number, state_hash

    # --- leader side: accepting members ---------------------------------------------------------------------------
    async def _handle_join(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        try:
            req, _ = await read_frame(reader, pb.JoinRequest, max_payload=0, timeout=10)
            status, message = self._admit(req)
            await write_frame(writer, pb.JoinReply(status=status, message=message), timeout=10)
            if status != pb.JoinReply.ACCEPTED:
                return
            collect = self._collect
            assert collect is not None
            collect.members[peer] = (reader, writer)
            collect.changed.set()
            await collect.done  # keep the stream open until the exchange is over
            if collect.closed:
                # Closing our end resets the libp2p stream and can cut off a result still in flight: wait for the
                # member to close first (it does once it has read the result), or for the deadline. (A group we
                # abandoned before closing has nothing in flight: close at once so the member moves on.)
                await asyncio.wait_for(reader.read(1), timeout=self.cfg.exchange_timeout_s)
        except (WireError, asyncio.CancelledError, asyncio.TimeoutError, ConnectionError) as exc:
            logger.debug("join stream from %s ended: %r", peer, exc)
        finally:
            close_writer(writer)

    def _admit(self, req: pb.JoinRequest) -> tuple[int, str]:
        if req.protocol_version != PROTOCOL_VERSION:
            return pb.JoinReply.INCOMPATIBLE, f"protocol version differs: ours {PROTOCOL_VERSION}, yours {req.protocol_version}"
        if req.run_id != self.node.net.run_id:
            return pb.JoinReply.INCOMPATIBLE, f"run id differs: ours {self.node.net.run_id!r}, yours {req.run_id!r}"
        if req.fingerprint != self.model.fingerprint:
            try:
                theirs = json.loads(req.task_config_json) if len(req.task_config_json) < 8192 else {}
            except json.JSONDecodeError:
                theirs = {}
            theirs = theirs if isinstance(theirs, dict) else {}
            return pb.JoinReply.INCOMPATIBLE, "model differs: " + describe_difference(self.model.config, theirs)
        collect = self._collect
        if collect is None or collect.round != req.round:
            return pb.JoinReply.NOT_LEADER, f"not collecting round {req.round}"
        if collect.closed:
            return pb.JoinReply.ROUND_CLOSED, f"group for round {req.round} already closed"
        if req.state_hash != self.state_hash:
            return pb.JoinReply.WRONG_STATE, f"state hash differs at round {req.round}: re-sync"
        if len(collect.members) + 1 >= self.cfg.max_group:
            return pb.JoinReply.FULL, f"group is full ({self.cfg.max_group})"
        return pb.JoinReply.ACCEPTED, ""

    # --- matchmaking ----------------------------------------------------------------------------------------------
    async def form_group(self, *, round_number: int, state_hash: str, my_eta: float) -> Group | Behind:
        """Find or lead a group for round r. Raises RoundAborted on timeout."""
        me = self.node.peer_id
        self.set_state(round_number, state_hash)
        deadline = time.monotonic() + self.cfg.round_timeout_s
        blacklist: dict[str, float] = {}
        quorum_at: float | None = None
        merge_into: str | None = None
        merge_seen = 0
        try:
            while time.monotonic() < deadline:
                try:
                    records = await self.node.fetch_records()
                except TimeoutError:
                    logger.info("DHT lookup timed out; retrying")
                    continue
                records.pop(me, None)
                compatible = {p: r for p, r in records.items() if r.version == PROTOCOL_VERSION and r.fingerprint == self.model.fingerprint}
                target = choose_target(compatible, me, round_number, state_hash)
                if target is not None:
                    self._stop_collecting_if_empty()
                    if self._collect is None:
                        return target
                now = time.monotonic()
                blacklist = {p: t for p, t in blacklist.items() if t > now}
                peers_here = {p: r for p, r in compatible.items() if r.round == round_number and r.state_hash == state_hash}
                candidates = {p: r for p, r in peers_here.items() if r.ready and p not in blacklist}
                members_now = len(self._collect.members) if self._collect is not None else 0
                leader = pick_leader(me, members_now, candidates, self.cfg.quorum)
                if leader != me and members_now:
                    # Two leaders each gathered members and neither group reaches quorum (records seen at different
                    # moments split the swarm). The weaker leader merges into the stronger one once it has seen it
                    # twice in a row: its members' streams close and they re-join there. Nothing was closed, so
                    # nothing can split.
                    merge_seen = merge_seen + 1 if leader == merge_into else 1
                    merge_into = leader
                    if merge_seen < 2:
                        leader = me
                    else:
                        logger.info("round %d: merging my %d member(s) into %s's group", round_number, members_now, leader[-8:])
                        self._abandon_collect()
                else:
                    merge_into, merge_seen = None, 0
                if leader == me:
                    collect = self._ensure_collecting(round_number)
                    self.node.update_record(leading=len(collect.members))
                    size = 1 + len(collect.members)
                    if size >= self.cfg.quorum:
                        quorum_at = quorum_at or now
                        if self._grace_over(quorum_at, now, collect, peers_here):
                            return await self._close(collect)
                    collect.changed.clear()
                    try:
                        await asyncio.wait_for(collect.changed.wait(), timeout=0.25)
                    except asyncio.TimeoutError:
                        pass
                    continue
                quorum_at = None
                joined = await self._try_join(leader, round_number, state_hash, deadline)
                if isinstance(joined, (Group, Behind)):
                    return joined
                blacklist[leader] = time.monotonic() + joined
            raise RoundAborted(f"no group of {self.cfg.quorum} formed for round {round_number} within {self.cfg.round_timeout_s:.0f}s")
        except BaseException:
            self._abandon_collect()
            raise

    def _ensure_collecting(self, round_number: int) -> _Collect:
        if self._collect is None or self._collect.round != round_number:
            self._abandon_collect()
            self._collect = _Collect(round=round_number)
        return self._collect

    def _stop_collecting_if_empty(self) -> None:
        if self._collect is not None and not self._collect.members and not self._collect.closed:
            self._abandon_collect()

    def _abandon_collect(self) -> None:
        collect, self._collect = self._collect, None
        if collect is not None and not collect.done.done():
            collect.done.set_result(None)
        try:
            self.node.update_record(leading=0)
        except AssertionError:
            pass

    def _grace_over(self, quorum_at: float, now: float, collect: _Collect, peers_here: dict[str, PeerRecord]) -> bool:
        """Adaptive grace: wait for peers expected to be ready soon (their own ETA), within [min, max]."""
        waited = now - quorum_at
        if waited >= self.cfg.grace_max_s:
            return True
        wall = time.time()
        expected = [
            r for p, r in peers_here.items() if p not in collect.members and (r.ready or r.eta - wall <= self.cfg.grace_max_s - waited)
        ]
        if not expected:
            return waited >= self.cfg.grace_min_s
        return False

    async def _close(self, collect: _Collect) -> Group:
        collect.closed = True
        members = [self.node.peer_id, *collect.members]
        alive: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        tokens: dict[str, tuple[str, Any]] = {}

        async def notify(peer: str, stream: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
            message = pb.GroupClosed(round=collect.round, members=members, codec=self.cfg.codec, deadline_s=self.cfg.exchange_timeout_s)
            if self.data_plane is not None:
                token, future = self.data_plane.expect()
                tokens[peer] = (token, future)
                message.data_addrs.extend(self.data_plane.addrs)
                message.data_token = token
            try:
                await write_frame(stream[1], message, timeout=10)
                alive[peer] = stream
            except WireError as exc:
                logger.info("member %s unreachable at close: %r", peer[-8:], exc)

        await asyncio.gather(*(notify(p, s) for p, s in collect.members.items()))
        self._collect = None
        self.node.update_record(leading=0, ready=False)
        return Group(round=collect.round, leader=members[0], members=[members[0], *alive], codec=self.cfg.codec,
                     streams=alive, is_leader=True, done=collect.done, data_tokens=tokens)

    async def _try_join(self, leader: str, round_number: int, state_hash: str, deadline: float) -> Group | Behind | float:
        """Join `leader`; returns a Group, a Behind, or how long to blacklist the leader."""
        try:
            reader, writer = await self.node.open_stream(leader, self.handler_name, timeout=10)
        except Exception as exc:  # noqa: BLE001 - any failure to reach a leader means: try another
            logger.debug("cannot reach leader %s: %r", leader[-8:], exc)
            return 10.0
        try:
            req = pb.JoinRequest(protocol_version=PROTOCOL_VERSION, run_id=self.node.net.run_id, fingerprint=self.model.fingerprint,
                                 task_config_json=self.model.config_json, round=round_number, state_hash=state_hash)
            await write_frame(writer, req, timeout=10)
            reply, _ = await read_frame(reader, pb.JoinReply, max_payload=0, timeout=10)
            if reply.status == pb.JoinReply.INCOMPATIBLE:
                if reply.message not in self.refusals:
                    self.refusals.append(reply.message)
                    logger.error("peer %s refused us: %s", leader[-8:], reply.message)
                close_writer(writer)
                return 3600.0
            if reply.status == pb.JoinReply.WRONG_STATE:
                close_writer(writer)
                return 5.0
            if reply.status != pb.JoinReply.ACCEPTED:
                close_writer(writer)
                return 1.0
            self.node.update_record(leading=0)
            closed, _ = await read_frame(reader, pb.GroupClosed, max_payload=0, timeout=max(1.0, deadline - time.monotonic()))
            if closed.round != round_number or closed.codec != self.cfg.codec or self.node.peer_id not in closed.members:
                close_writer(writer)
                return 5.0
            self.node.update_record(ready=False)
            group = Group(round=round_number, leader=leader, members=list(closed.members), codec=closed.codec, streams={leader: (reader, writer)})
            if self.node.net.data_plane and closed.data_addrs and closed.data_token:
                direct = await connect(list(closed.data_addrs)[:8], closed.data_token)
                if direct is not None:
                    group.data[leader] = direct
            return group
        except WireError as exc:
            logger.info("leader %s dropped us before the group closed: %r", leader[-8:], exc)
            close_writer(writer)
            return 5.0

    # --- the exchange ---------------------------------------------------------------------------------------------
    async def exchange_as_member(self, group: Group, delta: torch.Tensor, tokens: int, staleness: int) -> Averaged:
        reader, writer = group.streams[group.leader]
        direct = group.data.get(group.leader)
        delta, tokens = self.faults.mutate_contribution(group.round, delta, tokens)
        timeout, cap = self.cfg.exchange_timeout_s, self.codec.encoded_size(self.model.numel)
        try:
            payload = await asyncio.get_running_loop().run_in_executor(None, self.codec.encode, delta)
            header = pb.Contribution(tokens=tokens, codec=self.codec.name, numel=delta.numel(), staleness=staleness)
            if direct is not None:  # announce on the control stream, move the bytes on the data connection
                await write_frame(writer, pb.Contribution(via_data_plane=True), timeout=timeout)
                await direct.send_frame(header, payload, timeout=timeout)
            else:
                await write_frame(writer, header, payload, timeout=timeout)
            self.faults.hit("member_after_send", group.round)
            if direct is not None:
                result, body = await direct.recv_frame(pb.RoundResult, max_payload=cap, timeout=timeout * 2)
            else:
                result, body = await read_frame(reader, pb.RoundResult, max_payload=cap, timeout=timeout * 2)
        except WireError as exc:
            raise RoundAborted(f"lost the leader during the exchange: {exc}") from exc
        finally:
            close_writer(writer)
            if direct is not None:
                direct.close()
        if result.outcome != pb.RoundResult.COMMITTED:
            raise RoundAborted(f"leader aborted the round: {result.reason}")
        if result.round != group.round or result.numel != self.model.numel or result.codec != self.codec.name:
            raise RoundAborted("leader's result does not match the round")
        try:
            averaged = await asyncio.get_running_loop().run_in_executor(None, self.codec.decode, body, self.model.numel)
        except CodecError as exc:
            raise RoundAborted(f"leader sent a malformed average: {exc}") from exc
        return Averaged(delta=averaged, members=list(result.members), weights=list(result.weights),
                        excluded=dict(zip(result.excluded, result.excluded_reasons)), new_state_hash=result.new_state_hash,
                        bytes_sent=frame_bytes(header, len(payload)), bytes_received=frame_bytes(result, len(body)),
                        direct=int(direct is not None))

    async def reduce_as_leader(self, group: Group, delta: torch.Tensor, tokens: int, staleness: int) -> tuple[Averaged, bytes | memoryview]:
        """Collect, validate and average contributions. Returns the average and its encoding (sent at commit)."""
        loop = asyncio.get_running_loop()
        contributions: dict[str, tuple[int, int, torch.Tensor]] = {}
        excluded: dict[str, str] = {}
        received = 0

        async def collect(peer: str) -> None:
            nonlocal received
            reader, _ = group.streams[peer]
            cap = self.codec.encoded_size(self.model.numel)
            try:
                header, body = await read_frame(reader, pb.Contribution, max_payload=cap, timeout=self.cfg.exchange_timeout_s)
                if header.via_data_plane:
                    if peer not in group.data_tokens:
                        excluded[peer] = "announced a data connection it was never offered"
                        return
                    try:
                        direct = await asyncio.wait_for(asyncio.shield(group.data_tokens[peer][1]), self.cfg.exchange_timeout_s)
                    except asyncio.TimeoutError:
                        excluded[peer] = "announced a data connection that never arrived"
                        return
                    group.data[peer] = direct
                    header, body = await direct.recv_frame(pb.Contribution, max_payload=cap, timeout=self.cfg.exchange_timeout_s)
                received += frame_bytes(header, len(body))
                problem = self._check_contribution(header)
                if problem:
                    excluded[peer] = problem
                    return
                tensor = await loop.run_in_executor(None, self.codec.decode, body, self.model.numel)
                contributions[peer] = (int(header.tokens), int(header.staleness), tensor)
            except WireError as exc:
                excluded[peer] = f"no contribution: {exc}"
            except CodecError as exc:
                excluded[peer] = f"malformed tensor: {exc}"

        await asyncio.gather(*(collect(p) for p in group.streams))
        contributions[self.node.peer_id] = (tokens, staleness, delta.reshape(-1).to(torch.float32))
        cap = self.cfg.weight_cap_factor * max(tokens, 1)
        members = sorted(contributions)
        exact: list[float] = []
        for peer in members:
            claimed, stale, _ = contributions[peer]
            exact.append(min(claimed, cap) * self.cfg.stale_discount**stale)
            if claimed > cap:
                logger.warning("capping %s's claimed %d tokens at %d", peer[-8:], claimed, int(cap))
        total = sum(exact)  # > 0: the leader's own weight is at least 1
        weights = [round(w) for w in exact]
        # One pass per contribution, normalised as we go (no zero-fill, no final division).
        acc = torch.mul(contributions[members[0]][2], exact[0] / total)
        for peer, weight in zip(members[1:], exact[1:]):
            acc.add_(contributions[peer][2], alpha=weight / total)
        encoded = await loop.run_in_executor(None, self.codec.encode, acc)
        # Everyone must apply exactly what members will decode; for a lossless codec that is `acc` itself.
        averaged = acc if self.codec.lossless else await loop.run_in_executor(None, self.codec.decode, bytearray(encoded), self.model.numel)
        return Averaged(delta=averaged, members=members, weights=weights, excluded=excluded, new_state_hash=None,
                        bytes_sent=0, bytes_received=received, direct=len(group.data)), encoded

    def _check_contribution(self, header: pb.Contribution) -> str:
        if header.codec != self.codec.name:
            return f"codec {header.codec!r}, round uses {self.codec.name!r}"
        if header.numel != self.model.numel:
            return f"{header.numel} elements, model has {self.model.numel}"
        if not 0 < header.tokens <= MAX_TOKENS:
            return f"token weight {header.tokens} outside 1 .. {MAX_TOKENS}"
        if header.staleness > self.cfg.max_staleness:
            return f"staleness {header.staleness} > {self.cfg.max_staleness}"
        return ""

    async def commit_as_leader(self, group: Group, averaged: Averaged, encoded: bytes | memoryview, new_state_hash: str) -> int:
        """Send every reachable member the average and the hash of θ_{r+1}; returns bytes sent."""
        result = pb.RoundResult(outcome=pb.RoundResult.COMMITTED, round=group.round, new_state_hash=new_state_hash,
                                members=averaged.members, weights=averaged.weights, excluded=list(averaged.excluded),
                                excluded_reasons=list(averaged.excluded.values()), codec=self.codec.name, numel=self.model.numel)
        sent = 0

        async def send(peer: str) -> None:
            nonlocal sent
            try:
                await self._send_to(group, peer, result, encoded, timeout=self.cfg.exchange_timeout_s)
                sent += frame_bytes(result, len(encoded))
            except WireError as exc:
                logger.info("could not deliver the result to %s: %r (it will re-sync)", peer[-8:], exc)

        await asyncio.gather(*(send(p) for p in group.streams))
        self.finish(group)
        return sent

    async def abort_as_leader(self, group: Group, reason: str) -> None:
        result = pb.RoundResult(outcome=pb.RoundResult.ABORTED, reason=reason, round=group.round)
        await asyncio.gather(*(self._send_to(group, p, result, timeout=5) for p in group.streams), return_exceptions=True)
        self.finish(group)

    @staticmethod
    async def _send_to(group: Group, peer: str, header: pb.RoundResult, payload: bytes | memoryview = b"", *, timeout: float) -> None:
        """A frame to a member: on its data connection if it used one, else on its libp2p stream."""
        if peer in group.data:
            await group.data[peer].send_frame(header, payload, timeout=timeout)
        else:
            await write_frame(group.streams[peer][1], header, payload, timeout=timeout)

    def finish(self, group: Group) -> None:
        if group.done is not None and not group.done.done():
            group.done.set_result(None)
        if self.data_plane is not None:
            for token, _ in group.data_tokens.values():
                self.data_plane.forget(token)
        for conn in group.data.values():
            conn.close()  # TCP delivers what was sent before the FIN


def pick_leader(me: str, my_members: int, candidates: dict[str, PeerRecord], quorum: int) -> str:
    """Whom to gather around for this round: the ready peer leading the most members (ties: smallest peer id).

    `my_members` is how many joined us (0 when we are not leading). Every peer orders leaders the same way, so
    splits heal: a leader whose group is smaller than another's, and below quorum, gets the other's id back and
    merges into it. A leader whose group has reached quorum keeps it (it is about to close).
    """
    if my_members and 1 + my_members >= quorum:
        return me
    best = (-my_members, me)
    for peer, rec in candidates.items():
        best = min(best, (-rec.leading, peer))
    return best[1]


def choose_target(records: dict[str, PeerRecord], me: str, round_number: int, state_hash: str) -> Behind | None:
    """The agreed state to re-sync to, if ours is not it: the highest round; at that round, the hash held by most
    peers (ties: smallest hash, so every peer picks the same). None when our state is (one of) the newest."""
    if not records:
        return None
    top = max(r.round for r in records.values())
    if top < round_number:
        return None
    counts: dict[str, int] = {}
    for rec in records.values():
        if rec.round == top:
            counts[rec.state_hash] = counts.get(rec.state_hash, 0) + 1
    if top == round_number:
        counts[state_hash] = counts.get(state_hash, 0) + 1
    best_hash = min(counts, key=lambda h: (-counts[h], h))
    if top == round_number and best_hash == state_hash:
        return None
    donors = [p for p, r in records.items() if r.round == top and r.state_hash == best_hash and p != me]
    return Behind(round=top, state_hash=best_hash, donors=donors) if donors else None

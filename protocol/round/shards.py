"""The sharded reduce of one round: every contributor reduces one shard of the group's vector.

Contributor i cuts its encoded Δ along the plan's shard bounds and sends shard j to member j; member j averages
shard j of every contribution with the plan's weights and sends the reduced shard to everyone. Each member's link
then carries about 2 (N − 1) / N times the encoded vector, as in a ring all-reduce (a star's leader carries
2 (N − 1) times), and each member decodes about one vector's worth of parts. Every reduced shard has exactly one
source, its reducer, so all members that receive every shard apply bit-identical averages.

Each pair of contributors shares one connection (`swarmloco.protocol.round.pipes`): TCP where it can, a libp2p stream
where not.

Which contributions count is settled before anything is reduced: each reducer tells the leader whose parts of
its shard arrived well-formed, and the leader keeps the contributors every reducer holds a part of. A member that
sent one reducer garbage (or nothing) is dropped from every shard alike, and the round goes on without it.

Every part and every reduced shard is signed by its sender over its digest, bound to the run, the round and the
plan, so nothing on the path can alter one unseen. Each reducer aggregates robustly (`swarmloco.protocol.round.robust`)
and signs the coefficients it used; every member checks them, and audits every shard before it signs the round
(`swarmloco.protocol.round.audit`).

Nothing is half-applied: a shard whose reducer dies, or whose reduced bytes do not arrive, is lost, and a member
that misses any reduced shard applies nothing; the round ends uncertified for it. One shard lost is the whole round
lost for that member, never a partial average.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.codecs import Codec, CodecError
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.base.wire import WireError, frame_bytes
from swarmloco.protocol.round.audit import AuditCase, audit
from swarmloco.protocol.round.config import Rule
from swarmloco.protocol.round.groups import RoundAborted
from swarmloco.protocol.round.pipes import Inbox, Pipe, ShardRouter
from swarmloco.protocol.round.plans import Plan
from swarmloco.protocol.round.shard_results import exchange_results, gather_with_grace
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.payloads import digest, part_body, plan_body, sign, signed

logger = logging.getLogger(__name__)


@dataclass
class Reduced:
    """One member's view of a finished sharded reduce."""

    average: torch.Tensor
    sent: int = 0
    received: int = 0
    direct: int = 0  # pipes that ran on TCP
    send_s: float = 0.0  # from the first part sent to the last: what the member's uplink took
    parts_sent: int = 0  # the bytes of those parts
    audit_s: float = 0.0  # the audit's three steps, sketches included
    members: tuple[str, ...] = ()  # the settled contributors: those whose Δ is in the average
    pipes: dict[str, Pipe] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardTimeouts:
    connect: float  # every pipe of the round open
    transfer: float  # one part or one reduced shard on the wire


@dataclass(frozen=True)
class Signing:
    """Who we are in this round and what binds our signatures to it."""

    run_id: str
    identity: Identity
    leader: str
    plan_id: bytes  # digest of the plan we hold
    plan_signature: bytes  # its leader's signature of that digest
    rule: Rule
    probes: int  # audit probes per shard (0: no audit)
    nonce: bytes  # behind our audit commitment
    commits: tuple[str, ...]  # every member's audit commitment, plan order
    hooks: Hooks = field(default_factory=Hooks)
    grace_floor: float = 10.0  # the least a straggler is waited for once a majority's frames are in


Settle = Callable[[list[str], dict[str, str]], Awaitable[tuple[str, ...]]]


async def reduce_shards(plan: Plan, delta: torch.Tensor, *, me: str, codec: Codec, router: ShardRouter,
                        inbox: Inbox, timeouts: ShardTimeouts, use_tcp: bool, settle: Settle, signing: Signing,
                        after_parts: Callable[[], None] = lambda: None) -> Reduced:
    """Run this member's side of the plan: send its parts, gather the parts of its shard, settle with the leader
    which contributors count (`settle(have, problems)` returns the members every reducer holds a part of), reduce
    its shard over those, gather everyone's reduced shards and audit them. Raises RoundAborted when any shard is
    lost or fails its checks (nothing was applied: the caller just discards the round)."""
    if delta.numel() != plan.numel:
        raise RoundAborted(f"our Δ has {delta.numel()} elements, the plan {plan.numel}")
    k = plan.members.index(me)
    others = [p for p in plan.members if p != me]
    inbox.expect(set(plan.members[:k]))
    out = Reduced(average=torch.empty(plan.numel, dtype=torch.float32))
    loop = asyncio.get_running_loop()
    try:
        out.pipes = await _open_pipes(plan, k, router=router, inbox=inbox, timeouts=timeouts, use_tcp=use_tcp)
        out.direct = sum(p.direct for p in out.pipes.values())
        own = delta.reshape(-1).to(torch.float32)
        gathered = await _gather_parts(plan, k, own, out, codec=codec, timeout=timeouts.transfer,
                                       after_parts=after_parts, signing=signing)
        out.members = await settle(sorted(gathered.parts), gathered.problems)
        own_decoded = await loop.run_in_executor(None, _own_as_decoded, plan, k, own, codec, gathered.sent)
        results, rounding = await exchange_results(plan, k, out, gathered.parts, own_decoded, codec=codec,
                                                   timeout=timeouts.transfer, signing=signing)
        if signing.probes:
            started = time.monotonic()
            case = AuditCase(plan, signing.plan_id, k, signing.run_id, signing.identity, codec, signing.probes,
                             signing.nonce, signing.commits, out.members, results, rounding, out.average,
                             own_decoded, gathered.parts, gathered.frames)
            found = await audit(case, out.pipes, timeout=timeouts.transfer)
            out.sent += case.sent
            out.received += case.received
            out.audit_s = time.monotonic() - started
            if found.cheaters:
                raise RoundAborted("audit failed: " + "; ".join(f"{p[-8:]} {why}" for p, why in found.cheaters.items()),
                                   blame=next(iter(found.cheaters)), cheaters=found.cheaters)
    except BaseException:
        for pipe in out.pipes.values():
            pipe.close()
        raise
    finishing = [asyncio.ensure_future(out.pipes[p].finish(plan.round)) for p in others]
    _background.update(finishing)
    for task in finishing:
        task.add_done_callback(_background.discard)
    return out


def _own_as_decoded(plan: Plan, k: int, own: torch.Tensor, codec: Codec,
                    sent: dict[int, bytes | bytearray | memoryview]) -> list[torch.Tensor]:
    """Our part of every shard as its reducer decoded it: our own shard as it is (we reduce it unencoded), the
    others decoded from the bytes we sent."""
    out = []
    for j in range(len(plan.members)):
        s = plan.shard(j)
        try:
            lossy = j != k and not codec.lossless and j in sent
            out.append(codec.decode(bytearray(sent[j]), s.stop - s.start) if lossy else own[s])
        except CodecError:  # our part of shard j could not be encoded (a non-finite Δ): it was refused anyway
            out.append(own[s])
    return out


_background: set[asyncio.Future[None]] = set()  # pipes closing after their last frame was confirmed


async def _open_pipes(plan: Plan, k: int, *, router: ShardRouter, inbox: Inbox, timeouts: ShardTimeouts,
                      use_tcp: bool) -> dict[str, Pipe]:
    async def one(i: int) -> tuple[str, Pipe]:
        peer = plan.members[i]
        if i > k:
            return peer, await router.dial(peer, plan.endpoints[i], plan.round, timeout=timeouts.connect,
                                           use_tcp=use_tcp)
        return peer, await inbox.pipe(peer, timeout=timeouts.connect)

    pipes: dict[str, Pipe] = {}
    results = await asyncio.gather(*(one(i) for i in range(len(plan.members)) if i != k), return_exceptions=True)
    failed: dict[str, str] = {}
    for i, r in zip((i for i in range(len(plan.members)) if i != k), results, strict=True):
        if isinstance(r, BaseException):
            failed[plan.members[i]] = f"{plan.members[i][-8:]} ({type(r).__name__})"
        else:
            pipes[r[0]] = r[1]
    if failed:
        for pipe in pipes.values():
            pipe.close()
        raise RoundAborted(f"no shard connection to {', '.join(failed.values())}", blame=next(iter(failed)))
    return pipes


@dataclass
class _Gathered:
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # well-formed parts of our shard, ours included
    problems: dict[str, str] = field(default_factory=dict)  # why the others are missing
    frames: dict[str, tuple[pb.ShardPart, bytes]] = field(default_factory=dict)  # signed parts, for evidence
    sent: dict[int, bytes | bytearray | memoryview] = field(default_factory=dict)  # our encoded parts


async def _gather_parts(plan: Plan, k: int, own: torch.Tensor, out: Reduced, *, codec: Codec, timeout: float,
                        after_parts: Callable[[], None], signing: Signing) -> _Gathered:
    """Send every other reducer its signed part of our Δ while receiving and checking the parts of our own
    shard."""
    loop = asyncio.get_running_loop()
    mine = plan.shard(k)
    size = mine.stop - mine.start
    cap = codec.encoded_size(size)
    n = len(plan.members)
    me = plan.members[k]
    order = [(k + s) % n for s in range(1, n)]  # everyone starts with a different reducer
    got = _Gathered()
    # Our own part is checked like anyone's: a non-finite Δ of ours (a bug, a diverged replica) must drop us from
    # the round, not poison our shard.
    if bool(torch.isfinite(own[mine]).all()):
        got.parts[me] = own[mine]
    else:
        got.problems[me] = f"malformed part of shard {k} (our own): NaN or Inf"
    started = time.monotonic()

    def encode(j: int) -> tuple[pb.ShardPart, bytes | bytearray | memoryview]:
        try:
            payload = codec.encode(own[plan.shard(j)])
        except CodecError as exc:  # e.g. a non-finite Δ: send what reducer j will refuse, not nothing
            logger.warning("our part of shard %d cannot be encoded (%s); reducer %d will refuse it", j, exc, j)
            payload = b""
        got.sent[j] = payload
        d = digest(payload)
        header = pb.ShardPart(round=plan.round, shard=j, digest=d, plan_digest=signing.plan_id,
                              plan_signature=signing.plan_signature)
        header.signature = sign(signing.identity, part_body(signing.run_id, plan.round, signing.plan_id, j, me, d))
        return header, payload

    async def send_parts() -> None:
        # Part j + 1 is encoded (on an executor thread) while part j is on the wire.
        encoding = loop.run_in_executor(None, encode, order[0]) if order else None
        for at, j in enumerate(order):
            assert encoding is not None
            header, payload = await encoding
            encoding = loop.run_in_executor(None, encode, order[at + 1]) if at + 1 < len(order) else None
            if delay := signing.hooks.send_delay(plan.round):
                await asyncio.sleep(delay)
            sent = await out.pipes[plan.members[j]].send(header, payload, timeout=timeout)
            out.sent += sent  # (never `+= await`: that reads the total before the await, losing concurrent adds)
            out.parts_sent += sent
        out.send_s = time.monotonic() - started
        after_parts()

    def check(peer: str, header: pb.ShardPart, body: bytearray) -> torch.Tensor:
        if digest(body) != bytes(header.digest) or not signed(
                peer, part_body(signing.run_id, plan.round, signing.plan_id, k, peer, bytes(header.digest)),
                bytes(header.signature)):
            raise CodecError("its signature does not cover these bytes (altered on the way, or forged)")
        return codec.decode(body, size)

    async def receive_part(i: int) -> None:
        peer = plan.members[i]
        try:
            header, body = await out.pipes[peer].recv(pb.ShardPart, max_payload=cap, timeout=timeout)
            out.received += frame_bytes(header, len(body))
            if header.round != plan.round or header.shard != k:
                got.problems[peer] = f"sent a part of round {header.round}, shard {header.shard}"
                return
            if bytes(header.plan_digest) != signing.plan_id:
                got.problems[peer] = "sent a part for another plan than ours"
                if signed(signing.leader, plan_body(signing.run_id, plan.round, bytes(header.plan_digest)),
                          bytes(header.plan_signature)):
                    raise RoundAborted("our leader signed two different plans for this round",
                                       blame=signing.leader,
                                       cheaters={signing.leader: f"signed two plans for round {plan.round}"})
                return
            got.parts[peer] = await loop.run_in_executor(None, check, peer, header, body)
            if signing.probes:
                got.frames[peer] = (header, body)
        except WireError as exc:
            got.problems[peer] = f"no part of shard {k}: {exc}"
        except CodecError as exc:
            got.problems[peer] = f"malformed part of shard {k}: {exc}"

    sending = asyncio.ensure_future(send_parts())
    try:
        async def heard(i: int) -> bool:  # whatever arrived (or failed): not a straggler
            await receive_part(i)
            return True

        got_all = await gather_with_grace([heard(i) for i in order], have=1, need=n // 2 + 1,
                                          floor=signing.grace_floor)
    except RoundAborted:
        sending.cancel()
        raise
    slow = [plan.members[i] for i, r in zip(order, got_all, strict=True) if r is None]
    if slow:  # it reduces a shard too: the round cannot wait for it, nor go on without it
        sending.cancel()
        raise RoundAborted(f"{slow[0][-8:]} is too slow: its part of shard {k} did not come within the grace after "
                           "a majority had", blame=slow[0])
    try:
        await sending
    except WireError as exc:
        raise RoundAborted(f"could not send our parts: {exc}") from exc
    return got

"""The sharded reduce of one round: every contributor reduces one shard of the group's vector.

Contributor i cuts its encoded Δ along the plan's shard bounds and sends shard j to member j; member j averages
shard j of every contribution with the plan's weights and sends the reduced shard to everyone. Each member's link
then carries about 2 (N − 1) / N times the encoded vector, as in a ring all-reduce (a star's leader carries
2 (N − 1) times), and each member decodes about one vector's worth of parts. Every reduced shard has exactly one
source, its reducer, so all members that receive every shard apply bit-identical averages. Each pair of contributors
shares one connection (`swarmloco.protocol.round.pipes`): TCP where it can, a libp2p stream where not.

Which contributions count is settled before anything is reduced: each reducer tells the leader whose parts of
its shard arrived well-formed, and the leader keeps the contributors every reducer holds a part of. A member that
sent one reducer garbage (or nothing) is dropped from every shard alike, and the round goes on without it.

Every part and every reduced shard is signed by its sender over its digest, bound to the run, the round and the
plan, so nothing on the path can alter one unseen. Each reducer aggregates robustly (`swarmloco.protocol.round.robust`)
and signs the coefficients it used; every member checks them (`swarmloco.protocol.round.shard_checks`), and audits
every shard before it signs the round (`swarmloco.protocol.round.audit`).

This module holds the network steps of a pass, in order: open the pipes, exchange the parts, settle, exchange the
reduced shards (`swarmloco.protocol.round.shard_results`), confirm, and after the last pass the audit. Each step
returns a frozen record of what it gathered, which the next one reads.

Nothing is half-applied. A shard whose reducer dies, withholds it or sends one that fails its checks is lost, and
no member applies an average with a hole in it: after the reduced shards every member tells the leader which it
lacks, and the leader either lets the round go on, or re-plans it once without the reducers that failed it, over
the same pipes (backup reducers: `swarmloco.protocol.round.recovery`), or ends it. A lost shard costs one more
pass of the reduce, not the round.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.codecs import Codec, CodecError, finite_norm
from swarmloco.protocol.base.text import bounded, short_id
from swarmloco.protocol.base.wire import WireError, frame_bytes
from swarmloco.protocol.round.audit import AuditCase, audit
from swarmloco.protocol.round.grace import gather_with_grace
from swarmloco.protocol.round.groups import RoundAborted
from swarmloco.protocol.round.pipes import Inbox, Pipe, ShardRouter
from swarmloco.protocol.round.plans import Plan
from swarmloco.protocol.round.recovery import MAX_PASSES, Recovery
from swarmloco.protocol.round.shard_checks import Payload, checked_part, own_as_decoded
from swarmloco.protocol.round.shard_results import Signing, exchange_results
from swarmloco.protocol.trust.payloads import digest, part_body, plan_body, plan_digest, sign, signed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reduced:
    """One member's view of a finished sharded reduce."""

    average: torch.Tensor
    members: tuple[str, ...]  # the settled contributors: those whose Δ is in the average
    pipes: int  # shard connections (one per other contributor)
    direct: int  # of those, the ones on TCP
    sent: int
    received: int
    send_s: float  # from the first part sent to the last: what the member's uplink took
    parts_sent: int  # the bytes of those parts
    audit_s: float  # the audit's three steps, sketches included
    scores: Mapping[str, float] | None = None  # contributor -> loss decrease of its merged Δ (None: not scored)
    passes: int = 1  # 2: a reduced shard was lost, and the round was reduced again without its reducer
    failed: Mapping[str, str] = field(default_factory=dict)  # reducers whose shard we lacked in a pass, and why
    cheaters: Mapping[str, str] = field(default_factory=dict)  # reducers whose signed shard convicts them


@dataclass(frozen=True)
class ShardTimeouts:
    connect: float  # every pipe of the round open
    transfer: float  # one part or one reduced shard on the wire


@dataclass(frozen=True)
class _Parts:
    """What the exchange of parts left us: the parts of our shard, and what we sent."""

    parts: Mapping[str, torch.Tensor]  # well-formed parts of our shard, ours included
    norms: Mapping[str, float]  # the norm of each, found by the same pass that proved it finite
    problems: Mapping[str, str]  # why the others are missing
    frames: Mapping[str, tuple[pb.ShardPart, bytearray]]  # signed parts, for evidence (kept only for the audit)
    encoded: Mapping[int, Payload]  # our encoded part of each other shard
    sent: int
    received: int
    send_s: float
    parts_sent: int


Settle = Callable[[Plan, list[str], dict[str, str]], Awaitable[tuple[str, ...]]]
Confirm = Callable[..., Awaitable[Recovery]]  # (plan, settled members, lost reducers, *, last) -> Recovery


async def reduce_shards(plan: Plan, delta: torch.Tensor, *, me: str, codec: Codec, router: ShardRouter,
                        inbox: Inbox, timeouts: ShardTimeouts, use_tcp: bool, settle: Settle, confirm: Confirm,
                        signing: Signing, after_parts: Callable[[], None] = lambda: None) -> Reduced:
    """Run this member's side of the plan: send its parts, gather the parts of its shard, settle with the leader
    which contributors count (`settle(plan, have, problems)` returns the members every reducer holds a part of),
    reduce its shard over those, gather everyone's reduced shards, confirm with the leader that nothing is lost
    (or reduce again under its re-plan, once), and audit them. Raises RoundAborted when the round ends without an
    average (nothing was applied: the caller just discards the round)."""
    if delta.numel() != plan.numel:
        raise RoundAborted(f"our Δ has {delta.numel()} elements, the plan {plan.numel}")
    k = plan.members.index(me)
    inbox.expect({p for i, p in enumerate(plan.members) if i != k and plan.dials(i, k)})
    loop = asyncio.get_running_loop()
    pipes: dict[str, Pipe] = {}
    failed: dict[str, str] = {}  # reducers whose shard we lacked: first-hand, whatever the leader decided
    cheaters: dict[str, str] = {}
    sent = received = 0
    try:
        pipes = await router.open_pipes(plan, k, inbox, timeout=timeouts.connect, use_tcp=use_tcp)
        own = delta.reshape(-1).to(torch.float32)
        current = plan
        for attempt in range(MAX_PASSES):
            k = current.members.index(me)
            passing = {p: pipes[p] for p in current.members if p != me}
            got = await _exchange_parts(current, k, own, passing, codec=codec, timeout=timeouts.transfer,
                                        after_parts=after_parts if attempt == 0 else lambda: None, signing=signing)
            members = await settle(current, sorted(got.parts), dict(got.problems))
            own_decoded = await loop.run_in_executor(None, own_as_decoded, current, k, own, codec, got.encoded)
            results = await exchange_results(current, k, passing, members, got.parts, got.norms, own_decoded,
                                             codec=codec, timeout=timeouts.transfer, signing=signing)
            sent, received = sent + got.sent + results.sent, received + got.received + results.received
            failed.update(results.lost)
            cheaters.update(results.cheaters)
            try:
                recovery = await confirm(current, members, dict(results.lost), last=attempt == MAX_PASSES - 1)
            except RoundAborted as exc:  # said in the words of the old rule when we lacked a shard ourselves
                lost = "; ".join(results.lost.values())
                raise RoundAborted(f"shard lost: {bounded(lost, 500)} ({exc})" if lost else str(exc),
                                   blame=next(iter(results.lost), exc.blame), cheaters=exc.cheaters) from exc
            if recovery.plan is None:
                break
            current = recovery.plan
            signing = replace(signing, plan_id=plan_digest(current.to_pb()), plan_signature=current.signature,
                              commits=tuple(c.audit_commit for c in current.claims))
        audit_s, scores = 0.0, None
        if signing.probes:
            started = time.monotonic()
            case = AuditCase(plan=current, plan_id=signing.plan_id, k=k, run_id=signing.run_id,
                             identity=signing.identity, codec=codec, probes=signing.probes, nonce=signing.nonce,
                             commits=signing.commits, settled=members, results=results.headers,
                             rounding=results.rounding, average=results.average, own=own_decoded, parts=got.parts,
                             part_frames=got.frames, probe=signing.probe)
            found = await audit(case, passing, timeout=timeouts.transfer)
            sent += found.sent
            received += found.received
            audit_s, scores = time.monotonic() - started, found.scores
            if found.cheaters:
                convicted = "; ".join(f"{short_id(p)} {why}" for p, why in found.cheaters.items())
                raise RoundAborted("audit failed: " + convicted, blame=next(iter(found.cheaters)),
                                   cheaters=found.cheaters)
    except BaseException as exc:
        for pipe in pipes.values():
            pipe.close()
        if isinstance(exc, RoundAborted) and not set(cheaters) <= set(exc.cheaters):  # a first pass's convicts too
            raise RoundAborted(str(exc), blame=exc.blame, cheaters={**cheaters, **exc.cheaters}) from exc
        raise
    finishing = [asyncio.ensure_future(pipes[p].finish(plan.round)) for p in passing]
    for p in set(pipes) - set(passing):  # reducers the re-plan left out: nothing more is read from them
        pipes[p].close()
    _background.update(finishing)
    for task in finishing:
        task.add_done_callback(_background.discard)
    return Reduced(average=results.average, members=members, pipes=len(pipes),
                   direct=sum(p.direct for p in pipes.values()), sent=sent, received=received, send_s=got.send_s,
                   parts_sent=got.parts_sent, audit_s=audit_s, scores=scores, passes=attempt + 1,
                   failed=failed, cheaters=cheaters)


_background: set[asyncio.Future[None]] = set()  # pipes closing after their last frame was confirmed


async def _exchange_parts(plan: Plan, k: int, own: torch.Tensor, pipes: Mapping[str, Pipe], *, codec: Codec,
                          timeout: float, after_parts: Callable[[], None], signing: Signing) -> _Parts:
    """Send every other reducer its signed part of our Δ while receiving and checking the parts of our own
    shard."""
    loop = asyncio.get_running_loop()
    mine = plan.shard(k)
    cap = codec.encoded_size(mine.stop - mine.start)
    n = len(plan.members)
    me = plan.members[k]
    order = [(k + s) % n for s in range(1, n)]  # everyone starts with a different reducer
    parts: dict[str, torch.Tensor] = {}
    norms: dict[str, float] = {}
    problems: dict[str, str] = {}
    frames: dict[str, tuple[pb.ShardPart, bytearray]] = {}
    encoded: dict[int, Payload] = {}
    sent = received = parts_sent = 0
    send_s = 0.0
    started = time.monotonic()

    def encode(j: int) -> tuple[pb.ShardPart, Payload]:
        try:
            payload = codec.encode(own[plan.shard(j)])
        except CodecError as exc:  # e.g. a non-finite Δ: send what reducer j will refuse, not nothing
            logger.warning("our part of shard %d cannot be encoded (%s); reducer %d will refuse it", j, exc, j)
            payload = b""
        encoded[j] = payload
        d = digest(payload)
        header = pb.ShardPart(round=plan.round, shard=j, digest=d, plan_digest=signing.plan_id,
                              plan_signature=signing.plan_signature)
        header.signature = sign(signing.identity, part_body(signing.run_id, plan.round, signing.plan_id, j, me, d))
        return header, payload

    async def send_parts() -> None:
        nonlocal sent, parts_sent, send_s
        # Part j + 1 is encoded (on an executor thread) while part j is on the wire.
        encoding = loop.run_in_executor(None, encode, order[0]) if order else None
        for at, j in enumerate(order):
            assert encoding is not None
            header, payload = await encoding
            encoding = loop.run_in_executor(None, encode, order[at + 1]) if at + 1 < len(order) else None
            if delay := signing.hooks.send_delay(plan.round):
                await asyncio.sleep(delay)
            took = await pipes[plan.members[j]].send(header, payload, timeout=timeout)
            sent += took  # (never `+= await`: that reads the total before the await, losing concurrent adds)
            parts_sent += took
        send_s = time.monotonic() - started
        after_parts()

    async def receive_part(i: int) -> None:
        nonlocal received
        peer = plan.members[i]
        try:
            header, body = await pipes[peer].recv(pb.ShardPart, max_payload=cap, timeout=timeout)
            received += frame_bytes(header, len(body))
            if header.round != plan.round or header.shard != k:
                problems[peer] = f"sent a part of round {header.round}, shard {header.shard}"
                return
            if bytes(header.plan_digest) != signing.plan_id:
                problems[peer] = "sent a part for another plan than ours"
                if signed(signing.leader, plan_body(signing.run_id, plan.round, bytes(header.plan_digest)),
                          bytes(header.plan_signature)):
                    raise RoundAborted("our leader signed two different plans for this round",
                                       blame=signing.leader,
                                       cheaters={signing.leader: f"signed two plans for round {plan.round}"})
                return
            parts[peer], norms[peer] = await loop.run_in_executor(None, functools.partial(
                checked_part, plan, k, peer, header, body, codec=codec, keys=signing.keys))
            if signing.probes:
                frames[peer] = (header, body)
        except WireError as exc:
            problems[peer] = f"no part of shard {k}: {exc}"
        except CodecError as exc:
            problems[peer] = f"malformed part of shard {k}: {exc}"

    sending = asyncio.ensure_future(send_parts())
    try:
        # Our own part is checked like anyone's (off the loop, beside the sends): a non-finite Δ of ours (a bug, a
        # diverged replica) must drop us from the round, not poison our shard.
        try:
            norms[me] = await loop.run_in_executor(None, finite_norm, own[mine])
            parts[me] = own[mine]
        except CodecError as exc:
            problems[me] = f"malformed part of shard {k} (our own): {exc}"

        async def heard(i: int) -> bool:  # whatever arrived (or failed): not a straggler
            await receive_part(i)
            return True

        got_all = await gather_with_grace([heard(i) for i in order], have=1, need=n // 2 + 1,
                                          floor=signing.grace_floor)
    except BaseException:  # aborted or cancelled: our sends stop too
        sending.cancel()
        raise
    slow = [plan.members[i] for i, r in zip(order, got_all, strict=True) if r is None]
    if slow:  # it reduces a shard too: the round cannot wait for it, nor go on without it
        sending.cancel()
        raise RoundAborted(f"{short_id(slow[0])} is too slow: its part of shard {k} did not come within the grace "
                           "after a majority had", blame=slow[0])
    try:
        await sending
    except WireError as exc:
        raise RoundAborted(f"could not send our parts: {exc}") from exc
    return _Parts(parts=parts, norms=norms, problems=problems, frames=frames, encoded=encoded, sent=sent,
                  received=received, send_s=send_s, parts_sent=parts_sent)



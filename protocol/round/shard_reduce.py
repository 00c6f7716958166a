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

This module holds the network steps, in order: open the pipes, exchange the parts, settle, exchange the reduced
shards, audit. Each step returns a frozen record of what it gathered, which the next one reads.

Nothing is half-applied: a shard whose reducer dies, or whose reduced bytes do not arrive, is lost, and a member
that misses any reduced shard applies nothing; the round ends uncertified for it. One shard lost is the whole round
lost for that member, never a partial average.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import torch

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.codecs import Codec, CodecError
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.base.text import bounded, short_id
from swarmloco.protocol.base.wire import WireError, frame_bytes
from swarmloco.protocol.round.audit import AuditCase, audit
from swarmloco.protocol.round.config import Rule
from swarmloco.protocol.round.grace import gather_with_grace
from swarmloco.protocol.round.groups import RoundAborted
from swarmloco.protocol.round.pipes import Inbox, Pipe, ShardRouter
from swarmloco.protocol.round.plans import Plan
from swarmloco.protocol.round.robust import rounding_bound
from swarmloco.protocol.round.shard_checks import (
    Payload,
    RoundKeys,
    check_result,
    checked_part,
    own_as_decoded,
    reduce_shard,
)
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.payloads import digest, part_body, plan_body, result_body, sign, signed

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
    probe: Callable[[bytes], torch.Tensor] | None = None  # the credit probe's gradient (`AuditCase.probe`)
    grace_floor: float = 10.0  # the least a straggler is waited for once a majority's frames are in

    @property
    def keys(self) -> RoundKeys:
        return RoundKeys(self.run_id, self.plan_id)


@dataclass(frozen=True)
class _Parts:
    """What the exchange of parts left us: the parts of our shard, and what we sent."""

    parts: Mapping[str, torch.Tensor]  # well-formed parts of our shard, ours included
    problems: Mapping[str, str]  # why the others are missing
    frames: Mapping[str, tuple[pb.ShardPart, bytearray]]  # signed parts, for evidence (kept only for the audit)
    encoded: Mapping[int, Payload]  # our encoded part of each other shard
    sent: int
    received: int
    send_s: float
    parts_sent: int


@dataclass(frozen=True)
class _Results:
    """What the exchange of reduced shards left us: the average, and every shard's signed header."""

    average: torch.Tensor
    headers: Mapping[int, pb.ShardResult]  # every shard's signed header as we received it (ours included)
    rounding: Mapping[int, float]  # the codec's rounding bound of each
    sent: int
    received: int


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
    loop = asyncio.get_running_loop()
    pipes: dict[str, Pipe] = {}
    try:
        pipes = await router.open_pipes(plan, k, inbox, timeout=timeouts.connect, use_tcp=use_tcp)
        own = delta.reshape(-1).to(torch.float32)
        got = await _exchange_parts(plan, k, own, pipes, codec=codec, timeout=timeouts.transfer,
                                    after_parts=after_parts, signing=signing)
        members = await settle(sorted(got.parts), dict(got.problems))
        own_decoded = await loop.run_in_executor(None, own_as_decoded, plan, k, own, codec, got.encoded)
        results = await _exchange_results(plan, k, pipes, members, got.parts, own_decoded, codec=codec,
                                          timeout=timeouts.transfer, signing=signing)
        sent, received, audit_s, scores = got.sent + results.sent, got.received + results.received, 0.0, None
        if signing.probes:
            started = time.monotonic()
            case = AuditCase(plan=plan, plan_id=signing.plan_id, k=k, run_id=signing.run_id,
                             identity=signing.identity, codec=codec, probes=signing.probes, nonce=signing.nonce,
                             commits=signing.commits, settled=members, results=results.headers,
                             rounding=results.rounding, average=results.average, own=own_decoded, parts=got.parts,
                             part_frames=got.frames, probe=signing.probe)
            found = await audit(case, pipes, timeout=timeouts.transfer)
            sent += found.sent
            received += found.received
            audit_s, scores = time.monotonic() - started, found.scores
            if found.cheaters:
                convicted = "; ".join(f"{short_id(p)} {why}" for p, why in found.cheaters.items())
                raise RoundAborted("audit failed: " + convicted, blame=next(iter(found.cheaters)),
                                   cheaters=found.cheaters)
    except BaseException:
        for pipe in pipes.values():
            pipe.close()
        raise
    finishing = [asyncio.ensure_future(pipes[p].finish(plan.round)) for p in others]
    _background.update(finishing)
    for task in finishing:
        task.add_done_callback(_background.discard)
    return Reduced(average=results.average, members=members, pipes=len(pipes),
                   direct=sum(p.direct for p in pipes.values()), sent=sent, received=received, send_s=got.send_s,
                   parts_sent=got.parts_sent, audit_s=audit_s, scores=scores)


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
    problems: dict[str, str] = {}
    frames: dict[str, tuple[pb.ShardPart, bytearray]] = {}
    encoded: dict[int, Payload] = {}
    sent = received = parts_sent = 0
    send_s = 0.0
    # Our own part is checked like anyone's: a non-finite Δ of ours (a bug, a diverged replica) must drop us from
    # the round, not poison our shard.
    if bool(torch.isfinite(own[mine]).all()):
        parts[me] = own[mine]
    else:
        problems[me] = f"malformed part of shard {k} (our own): NaN or Inf"
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
            parts[peer] = await loop.run_in_executor(None, functools.partial(
                checked_part, plan, k, peer, header, body, codec=codec, keys=signing.keys))
            if signing.probes:
                frames[peer] = (header, body)
        except WireError as exc:
            problems[peer] = f"no part of shard {k}: {exc}"
        except CodecError as exc:
            problems[peer] = f"malformed part of shard {k}: {exc}"

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
        raise RoundAborted(f"{short_id(slow[0])} is too slow: its part of shard {k} did not come within the grace "
                           "after a majority had", blame=slow[0])
    try:
        await sending
    except WireError as exc:
        raise RoundAborted(f"could not send our parts: {exc}") from exc
    return _Parts(parts=parts, problems=problems, frames=frames, encoded=encoded, sent=sent, received=received,
                  send_s=send_s, parts_sent=parts_sent)


async def _exchange_results(plan: Plan, k: int, pipes: Mapping[str, Pipe], members: tuple[str, ...],
                            parts: Mapping[str, torch.Tensor], own: tuple[torch.Tensor, ...], *, codec: Codec,
                            timeout: float, signing: Signing) -> _Results:
    """Reduce our shard over the settled `members`, send it to everyone and place everyone's (checked) in the
    average."""
    loop = asyncio.get_running_loop()
    mine = plan.shard(k)
    me = plan.members[k]
    average = torch.empty(plan.numel, dtype=torch.float32)
    shard = await loop.run_in_executor(None, reduce_shard, plan, members, parts, signing.rule)
    reduced = signing.hooks.reduced_shard(plan.round, k, shard.tensor)  # a test harness playing a cheating reducer
    sent = received = 0

    def signed_result(tensor: torch.Tensor) -> tuple[pb.ShardResult, Payload]:
        payload = codec.encode(tensor)
        header = pb.ShardResult(round=plan.round, shard=k, ok=True, digest=digest(payload), members=members,
                                norms=shard.norms, coeffs=shard.coeffs, tau=shard.tau)
        header.signature = sign(signing.identity, result_body(signing.run_id, signing.plan_id, me, header))
        return header, payload

    try:
        header, payload = await loop.run_in_executor(None, signed_result, reduced)
        # Everyone applies what they decode: the reducer too, so that every member holds the same bytes.
        average[mine] = reduced if codec.lossless else await loop.run_in_executor(
            None, codec.decode, bytearray(payload), mine.stop - mine.start)
    except CodecError as exc:  # finite parts averaged to something the codec cannot carry: the shard is lost
        raise RoundAborted(f"our reduced shard {k} cannot be encoded: {exc}") from exc
    headers = {k: header}
    rounding = {k: rounding_bound(codec, payload, average[mine])}

    async def send_one(peer: str) -> None:
        nonlocal sent
        h, body = header, payload
        variant = signing.hooks.shard_result(plan.round, k, peer, reduced)
        if variant is None:  # a test harness playing a reducer that withholds its shard
            return
        if variant is not reduced:  # a test harness playing an equivocating reducer: its own, signed, variant
            h, body = await loop.run_in_executor(None, signed_result, variant)
        try:
            if delay := signing.hooks.send_delay(plan.round):
                await asyncio.sleep(delay)
            took = await pipes[peer].send(h, body, timeout=timeout)
            sent += took
        except WireError as exc:
            logger.info("could not send shard %d to %s: %s", k, short_id(peer), exc)

    def check_and_place(i: int, h: pb.ShardResult, body: bytearray) -> tuple[str, bool]:
        """Why reducer i's result is refused ("" when it checks out: it is now in the average), and whether that is
        proof against it."""
        checked = check_result(plan, i, h, body, me=me, members=members, own_part=own[i], codec=codec,
                               rule=signing.rule, keys=signing.keys)
        if checked.decoded is not None:
            average[plan.shard(i)] = checked.decoded
            rounding[i] = checked.bound
        return checked.problem, checked.proven

    async def receive_one(i: int) -> tuple[str, str]:
        """(problem, proof) for shard i: a lost shard has a problem; a cheating reducer also a proof."""
        nonlocal received
        peer, theirs = plan.members[i], plan.shard(i)
        try:
            h, body = await pipes[peer].recv(pb.ShardResult, max_payload=codec.encoded_size(
                theirs.stop - theirs.start), timeout=timeout)
        except WireError as exc:
            return f"no result from {short_id(peer)}: {exc}", ""
        if h.round != plan.round or h.shard != i:
            return f"{short_id(peer)} sent the result of round {h.round}, shard {h.shard}", ""
        if not h.ok:
            return f"{short_id(peer)} has no result for shard {i}: {bounded(h.reason, 200)}", ""
        received += frame_bytes(h, len(body))
        problem, proven = await loop.run_in_executor(None, check_and_place, i, h, body)
        if problem:
            return f"{short_id(peer)}'s shard {i} refused: {problem}", problem if proven else ""
        headers[i] = h
        return "", ""

    others = [i for i in range(len(plan.members)) if i != k]
    n = len(plan.members)
    _, outcomes = await asyncio.gather(
        asyncio.gather(*(send_one(plan.members[i]) for i in others)),
        gather_with_grace([receive_one(i) for i in others], have=1, need=n // 2 + 1, floor=signing.grace_floor))
    outcomes = [o or (f"{short_id(plan.members[i])} is too slow: its shard {i} did not come within the grace after a "
                      "majority had", "") for i, o in zip(others, outcomes, strict=True)]
    lost = [(plan.members[i], problem, proof) for i, (problem, proof) in zip(others, outcomes, strict=True) if problem]
    if lost:
        cheaters = {peer: proof for peer, _, proof in lost if proof}
        raise RoundAborted(f"shard lost: {bounded('; '.join(p for _, p, _ in lost), 500)}", blame=lost[0][0],
                           cheaters=cheaters)
    return _Results(average=average, headers=headers, rounding=rounding, sent=sent, received=received)

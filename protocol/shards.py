"""The sharded reduce of one round: every contributor reduces one shard of the group's vector.

Contributor i cuts its encoded Δ along the plan's shard bounds and sends shard j to member j; member j averages
shard j of every contribution with the plan's weights and sends the reduced shard to everyone. Each member's link
then carries about 2 (N − 1) / N times the encoded vector, as in a ring all-reduce (a star's leader carries
2 (N − 1) times), and each member decodes about one vector's worth of parts. Every reduced shard has exactly one
source, its reducer, so all members that receive every shard apply bit-identical averages.

Each pair of contributors shares one connection (`protocol.pipes`): TCP where it can, a libp2p stream where not.

Which contributions count is settled before anything is reduced: each reducer tells the leader whose parts of
its shard arrived well-formed, and the leader keeps the contributors every reducer holds a part of. A member that
sent one reducer garbage (or nothing) is dropped from every shard alike, and the round goes on without it.

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

from protocol import swarmloco_wire_pb2 as pb
from protocol.codecs import Codec, CodecError
from protocol.groups import RoundAborted
from protocol.pipes import Inbox, Pipe, ShardRouter
from protocol.plans import Plan
from protocol.wire import WireError, frame_bytes

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
    members: tuple[str, ...] = ()  # the settled contributors: those whose Δ is in the average
    pipes: dict[str, Pipe] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardTimeouts:
    connect: float  # every pipe of the round open
    transfer: float  # one part or one reduced shard on the wire


Settle = Callable[[list[str], dict[str, str]], Awaitable[tuple[str, ...]]]


async def reduce_shards(plan: Plan, delta: torch.Tensor, *, me: str, codec: Codec, router: ShardRouter,
                        inbox: Inbox, timeouts: ShardTimeouts, use_tcp: bool, settle: Settle,
                        after_parts: Callable[[], None] = lambda: None) -> Reduced:
    """Run this member's side of the plan: send its parts, gather the parts of its shard, settle with the leader
    which contributors count (`settle(have, problems)` returns the members every reducer holds a part of), reduce
    its shard over those, and gather everyone's reduced shards. Raises RoundAborted when any shard is lost (nothing
    was applied: the caller just discards the round)."""
    k = plan.members.index(me)
    others = [p for p in plan.members if p != me]
    inbox.expect(set(plan.members[:k]))
    out = Reduced(average=torch.empty(plan.numel, dtype=torch.float32))
    try:
        out.pipes = await _open_pipes(plan, k, router=router, inbox=inbox, timeouts=timeouts, use_tcp=use_tcp)
        out.direct = sum(p.direct for p in out.pipes.values())
        own = delta.reshape(-1).to(torch.float32)
        parts, problems = await _gather_parts(plan, k, own, out, codec=codec, timeout=timeouts.transfer,
                                              after_parts=after_parts)
        out.members = await settle(sorted(parts), problems)
        reduced = await asyncio.get_running_loop().run_in_executor(None, _weighted_sum, plan, out.members, parts)
        await _exchange_results(plan, k, reduced, out, codec=codec, timeout=timeouts.transfer)
    except BaseException:
        for pipe in out.pipes.values():
            pipe.close()
        raise
    finishing = [asyncio.ensure_future(out.pipes[p].finish(plan.round)) for p in others]
    _background.update(finishing)
    for task in finishing:
        task.add_done_callback(_background.discard)
    return out


def _weighted_sum(plan: Plan, members: tuple[str, ...], parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Σ w_i part_i / Σ w_i over the settled contributors, in their sorted order, with the plan's weights."""
    weight = dict(zip(plan.members, plan.weights, strict=True))
    total = sum(weight[p] for p in members)
    acc = torch.mul(parts[members[0]], weight[members[0]] / total)
    for peer in members[1:]:
        acc.add_(parts[peer], alpha=weight[peer] / total)
    return acc


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


async def _gather_parts(plan: Plan, k: int, own: torch.Tensor, out: Reduced, *, codec: Codec, timeout: float,
                        after_parts: Callable[[], None]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Send every other reducer its part of our Δ while receiving and checking the parts of our own shard. Returns
    the well-formed parts by contributor (ours included) and why the others are missing."""
    loop = asyncio.get_running_loop()
    mine = plan.shard(k)
    size = mine.stop - mine.start
    cap = codec.encoded_size(size)
    n = len(plan.members)
    order = [(k + s) % n for s in range(1, n)]  # everyone starts with a different reducer
    parts: dict[str, torch.Tensor] = {}
    problems: dict[str, str] = {}
    # Our own part is checked like anyone's: a non-finite Δ of ours (a bug, a diverged replica) must drop us from
    # the round, not poison our shard.
    if bool(torch.isfinite(own[mine]).all()):
        parts[plan.members[k]] = own[mine]
    else:
        problems[plan.members[k]] = f"malformed part of shard {k} (our own): NaN or Inf"
    started = time.monotonic()

    def encode(j: int) -> bytes | bytearray | memoryview:
        try:
            return codec.encode(own[plan.shard(j)])
        except CodecError as exc:  # e.g. a non-finite Δ: send what reducer j will refuse, not nothing
            logger.warning("our part of shard %d cannot be encoded (%s); reducer %d will refuse it", j, exc, j)
            return b""

    async def send_parts() -> None:
        # Part j + 1 is encoded (on an executor thread) while part j is on the wire.
        encoding = loop.run_in_executor(None, encode, order[0]) if order else None
        for at, j in enumerate(order):
            assert encoding is not None
            payload = await encoding
            encoding = loop.run_in_executor(None, encode, order[at + 1]) if at + 1 < len(order) else None
            sent = await out.pipes[plan.members[j]].send(pb.ShardPart(round=plan.round, shard=j), payload,
                                                         timeout=timeout)
            out.sent += sent  # (never `+= await`: that reads the total before the await, losing concurrent adds)
            out.parts_sent += sent
        out.send_s = time.monotonic() - started
        after_parts()

    async def receive_part(i: int) -> None:
        peer = plan.members[i]
        try:
            header, body = await out.pipes[peer].recv(pb.ShardPart, max_payload=cap, timeout=timeout)
            out.received += frame_bytes(header, len(body))
            if header.round != plan.round or header.shard != k:
                problems[peer] = f"sent a part of round {header.round}, shard {header.shard}"
                return
            parts[peer] = await loop.run_in_executor(None, codec.decode, body, size)
        except WireError as exc:
            problems[peer] = f"no part of shard {k}: {exc}"
        except CodecError as exc:
            problems[peer] = f"malformed part of shard {k}: {exc}"

    sending = asyncio.ensure_future(send_parts())
    await asyncio.gather(*(receive_part(i) for i in order))
    try:
        await sending
    except WireError as exc:
        raise RoundAborted(f"could not send our parts: {exc}") from exc
    return parts, problems


async def _send_result(plan: Plan, k: int, out: Reduced, payload: bytes | bytearray | memoryview,
                       timeout: float) -> None:
    """Our reduced shard to every other member. A member we cannot reach misses one shard and applies nothing;
    that is its loss to report, not ours."""
    header = pb.ShardResult(round=plan.round, shard=k, ok=True)

    async def one(peer: str) -> None:
        try:
            n = await out.pipes[peer].send(header, payload, timeout=timeout)
            out.sent += n
        except WireError as exc:
            logger.info("could not send shard %d to %s: %s", k, peer[-8:], exc)

    await asyncio.gather(*(one(p) for p in plan.members if p != plan.members[k]))


async def _exchange_results(plan: Plan, k: int, reduced: torch.Tensor, out: Reduced, *, codec: Codec,
                            timeout: float) -> None:
    """Send our reduced shard to everyone and place everyone's in the average."""
    loop = asyncio.get_running_loop()
    mine = plan.shard(k)
    try:
        payload = await loop.run_in_executor(None, codec.encode, reduced)
        # Everyone applies what they decode: the reducer too, so that every member holds the same bytes.
        out.average[mine] = reduced if codec.lossless else await loop.run_in_executor(
            None, codec.decode, bytearray(payload), mine.stop - mine.start)
    except CodecError as exc:  # finite parts averaged to something the codec cannot carry: the shard is lost
        raise RoundAborted(f"our reduced shard {k} cannot be encoded: {exc}") from exc

    async def receive_result(i: int) -> str:
        peer, theirs = plan.members[i], plan.shard(i)
        size = theirs.stop - theirs.start
        try:
            header, body = await out.pipes[peer].recv(pb.ShardResult, max_payload=codec.encoded_size(size),
                                                      timeout=timeout)
            if header.round != plan.round or header.shard != i:
                return f"{peer[-8:]} sent the result of round {header.round}, shard {header.shard}"
            if not header.ok:
                return f"{peer[-8:]} has no result for shard {i}: {header.reason[:200]}"
            out.received += frame_bytes(header, len(body))
            await loop.run_in_executor(None, codec.decode_into, body, size, out.average[theirs])
            return ""
        except WireError as exc:
            return f"no result from {peer[-8:]}: {exc}"
        except CodecError as exc:
            return f"malformed result from {peer[-8:]}: {exc}"

    others = [i for i in range(len(plan.members)) if i != k]
    _, problems = await asyncio.gather(
        _send_result(plan, k, out, payload, timeout), asyncio.gather(*(receive_result(i) for i in others)))
    lost = [plan.members[i] for i, p in zip(others, problems, strict=True) if p]
    if lost:
        raise RoundAborted(f"shard lost: {'; '.join(p for p in problems if p)[:500]}", blame=lost[0])

"""The second half of a sharded round: reduce our shard robustly, sign it, send it, and check everyone else's.

A reduced shard arrives with its reducer's signed header: the settled contributors, the norm of each one's part,
the coefficients and clip radius of the robust rule (`swarmloco.protocol.round.robust`). Before a member places a shard
in its average it checks that the signature covers these bytes and this plan, that the contributors are the settled
ones, that the coefficients follow from the norms and the plan's weights, that the norm reported for its own part
is the one it sent, and that the shard is no longer than the combination can be. Any failure is proof against the
reducer (its signature is on the header) and loses the round: nothing is half-applied.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

import torch

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.codecs import Codec, CodecError
from swarmloco.protocol.base.wire import WireError, frame_bytes
from swarmloco.protocol.round.groups import RoundAborted
from swarmloco.protocol.round.plans import Plan
from swarmloco.protocol.round.robust import (
    aggregate,
    coefficients,
    coefficients_ok,
    norm,
    norm_matches,
    rounding_bound,
    within_bound,
)
from swarmloco.protocol.trust.payloads import digest, result_body, sign, signed

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def gather_with_grace(coros: list[Awaitable[T]], *, have: int, need: int, floor: float) -> list[T | None]:
    """Await every coroutine, but once `need` results are in (counting `have` already held), give the rest at most
    max(floor, 2 × the time taken so far): a member that stalls its sends costs the round seconds, not its
    deadline. Results cut off are None (their coroutines are cancelled)."""
    started = time.monotonic()
    tasks = [asyncio.ensure_future(c) for c in coros]
    pending = set(tasks)
    try:
        while pending:
            if have + len(tasks) - len(pending) >= need:
                grace = max(floor, 2 * (time.monotonic() - started))
                _, pending = await asyncio.wait(pending, timeout=grace)
                break
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in pending:
            t.cancel()
    return [None if t in pending or t.cancelled() else t.result() for t in tasks]


def reduce_shard(plan: Plan, k: int, members: tuple[str, ...], parts: dict[str, torch.Tensor],
                 rule) -> tuple[torch.Tensor, list[float], list[float], float]:
    """Our shard aggregated over the settled contributors: (result, norms, coefficients, tau)."""
    weight = dict(zip(plan.members, plan.weights, strict=True))
    ordered = [parts[p] for p in members]
    norms = [norm(x) for x in ordered]
    coeffs, tau = coefficients(norms, [weight[p] for p in members], rule)
    return aggregate(ordered, coeffs), norms, coeffs, tau


async def exchange_results(plan: Plan, k: int, out, parts: dict[str, torch.Tensor], own: list[torch.Tensor], *,
                           codec: Codec, timeout: float, signing) -> tuple[dict[int, pb.ShardResult],
                                                                           dict[int, float]]:
    """Reduce our shard, send it to everyone and place everyone's (checked) in `out.average`. Returns every
    shard's signed header and its codec rounding bound, for the audit."""
    loop = asyncio.get_running_loop()
    mine = plan.shard(k)
    me = plan.members[k]
    members = out.members
    weight = dict(zip(plan.members, plan.weights, strict=True))
    reduced, norms, coeffs, tau = await loop.run_in_executor(None, reduce_shard, plan, k, members, parts,
                                                             signing.rule)
    reduced = signing.hooks.reduced_shard(plan.round, k, reduced)  # a test harness playing a cheating reducer

    def signed_result(tensor: torch.Tensor) -> tuple[pb.ShardResult, bytes | bytearray | memoryview]:
        payload = codec.encode(tensor)
        header = pb.ShardResult(round=plan.round, shard=k, ok=True, digest=digest(payload), members=members,
                                norms=norms, coeffs=coeffs, tau=tau)
        header.signature = sign(signing.identity, result_body(signing.run_id, signing.plan_id, me, header))
        return header, payload

    try:
        header, payload = await loop.run_in_executor(None, signed_result, reduced)
        # Everyone applies what they decode: the reducer too, so that every member holds the same bytes.
        out.average[mine] = reduced if codec.lossless else await loop.run_in_executor(
            None, codec.decode, bytearray(payload), mine.stop - mine.start)
    except CodecError as exc:  # finite parts averaged to something the codec cannot carry: the shard is lost
        raise RoundAborted(f"our reduced shard {k} cannot be encoded: {exc}") from exc
    headers = {k: header}
    rounding = {k: rounding_bound(codec, payload, out.average[mine])}

    async def send_one(peer: str) -> None:
        h, body = header, payload
        variant = signing.hooks.shard_result(plan.round, k, peer, reduced)
        if variant is not reduced:  # a test harness playing an equivocating reducer: its own, signed, variant
            h, body = await loop.run_in_executor(None, signed_result, variant)
        try:
            if delay := signing.hooks.send_delay(plan.round):
                await asyncio.sleep(delay)
            sent = await out.pipes[peer].send(h, body, timeout=timeout)
            out.sent += sent
        except WireError as exc:
            logger.info("could not send shard %d to %s: %s", k, peer[-8:], exc)

    def check(i: int, h: pb.ShardResult, body: bytearray) -> tuple[str, bool]:
        """Why reducer i's result is refused ("" when it checks out), and whether that is proof against it (it
        signed these bytes); decodes it on success."""
        peer, theirs = plan.members[i], plan.shard(i)
        size = theirs.stop - theirs.start
        if digest(body) != bytes(h.digest) or not signed(
                peer, result_body(signing.run_id, signing.plan_id, peer, h), bytes(h.signature)):
            return "unsigned or altered on the way", False  # anyone on the path could have done this
        try:
            return _judge_signed(i, h, body, size), True
        except CodecError as exc:
            return f"malformed result: {exc}", True

    def _judge_signed(i: int, h: pb.ShardResult, body: bytearray, size: int) -> str:
        theirs = plan.shard(i)
        if tuple(h.members) != members:
            return "its result is over other contributors than the settled ones"
        n_, c_ = list(h.norms), list(h.coeffs)
        if not coefficients_ok(n_, [weight[p] for p in members], c_, h.tau, signing.rule):
            return "its coefficients do not follow from the norms and weights it signed"
        if me in members and not norm_matches(n_[members.index(me)], norm(own[i])):
            return f"it reports our part's norm as {n_[members.index(me)]:.6g}, we sent {norm(own[i]):.6g}"
        decoded = codec.decode(body, size)
        bound = rounding_bound(codec, body, decoded)
        if not within_bound(norm(decoded), c_, n_, bound):
            return f"its result's norm {norm(decoded):.6g} exceeds what its coefficients allow"
        out.average[theirs] = decoded
        rounding[i] = bound
        return ""

    async def receive_one(i: int) -> tuple[str, str]:
        """(problem, proof) for shard i: a lost shard has a problem; a cheating reducer also a proof."""
        peer, theirs = plan.members[i], plan.shard(i)
        try:
            h, body = await out.pipes[peer].recv(pb.ShardResult, max_payload=codec.encoded_size(
                theirs.stop - theirs.start), timeout=timeout)
        except WireError as exc:
            return f"no result from {peer[-8:]}: {exc}", ""
        if h.round != plan.round or h.shard != i:
            return f"{peer[-8:]} sent the result of round {h.round}, shard {h.shard}", ""
        if not h.ok:
            return f"{peer[-8:]} has no result for shard {i}: {h.reason[:200]}", ""
        out.received += frame_bytes(h, len(body))
        problem, proven = await loop.run_in_executor(None, check, i, h, body)
        if problem:
            return f"{peer[-8:]}'s shard {i} refused: {problem}", problem if proven else ""
        headers[i] = h
        return "", ""

    others = [i for i in range(len(plan.members)) if i != k]
    n = len(plan.members)
    _, outcomes = await asyncio.gather(
        asyncio.gather(*(send_one(plan.members[i]) for i in others)),
        gather_with_grace([receive_one(i) for i in others], have=1, need=n // 2 + 1, floor=signing.grace_floor))
    outcomes = [o or (f"{plan.members[i][-8:]} is too slow: its shard {i} did not come within the grace after a "
                      "majority had", "") for i, o in zip(others, outcomes, strict=True)]
    lost = [(plan.members[i], problem, proof) for i, (problem, proof) in zip(others, outcomes, strict=True) if problem]
    if lost:
        cheaters = {peer: proof for peer, _, proof in lost if proof}
        raise RoundAborted(f"shard lost: {'; '.join(p for _, p, _ in lost)[:500]}", blame=lost[0][0],
                           cheaters=cheaters)
    return headers, rounding

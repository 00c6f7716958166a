"""The second half of a pass of the sharded reduce: every reducer's result to every member.

Each member reduces its shard over the settled contributors, signs it with the numbers of the robust rule, sends it
to everyone, and checks and places everyone else's (`swarmloco.protocol.round.shard_checks`). A shard that does not
come or is refused is not an error here: it is reported, and the leader decides whether the round is reduced again
without its reducer (`swarmloco.protocol.round.settle`).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.buffers import large_empty
from swarmloco.protocol.base.codecs import Codec, CodecError
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.base.text import bounded, short_id
from swarmloco.protocol.base.wire import WireError, frame_bytes
from swarmloco.protocol.round.config import Rule
from swarmloco.protocol.round.grace import gather_with_grace
from swarmloco.protocol.round.groups import RoundAborted
from swarmloco.protocol.round.pipes import Pipe
from swarmloco.protocol.round.plans import Plan
from swarmloco.protocol.round.robust import rounding_bound
from swarmloco.protocol.round.shard_checks import Payload, RoundKeys, check_result, reduce_shard
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.payloads import digest, result_body, sign

logger = logging.getLogger(__name__)


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
    grace_floor: float = 10.0  # the least a straggler's part is waited for once a majority's parts are in
    result_grace_floor: float = 2.5  # the same for a reduced shard (cutting one costs a second pass, not the round)

    @property
    def keys(self) -> RoundKeys:
        return RoundKeys(self.run_id, self.plan_id)


@dataclass(frozen=True)
class Results:
    """What the exchange of reduced shards left us: the average, every shard's signed header, and what was lost."""

    average: torch.Tensor  # complete only when nothing is lost
    headers: Mapping[int, pb.ShardResult]  # every shard's signed header as we received it (ours included)
    rounding: Mapping[int, float]  # the codec's rounding bound of each
    sent: int
    received: int
    lost: Mapping[str, str] = field(default_factory=dict)  # reducer -> why we lack its shard
    cheaters: Mapping[str, str] = field(default_factory=dict)  # of those, reducers its signed header convicts


async def exchange_results(plan: Plan, k: int, pipes: Mapping[str, Pipe], members: tuple[str, ...],
                            parts: Mapping[str, torch.Tensor], norms: Mapping[str, float],
                            own: tuple[torch.Tensor, ...], *, codec: Codec, timeout: float,
                            signing: Signing) -> Results:
    """Reduce our shard over the settled `members` (their `parts`, and the `norms` found when each was checked),
    send it to everyone and place everyone's (checked) in the average. A shard that does not come, or is refused,
    is returned in `Results.lost` (with the proof, when its signed header convicts its reducer): the caller settles
    with the leader what becomes of the round."""
    loop = asyncio.get_running_loop()
    mine = plan.shard(k)
    me = plan.members[k]
    average = large_empty(plan.numel)
    # A lossless shard is sent as it is: reduce it straight into its place in the average
    shard = await loop.run_in_executor(None, functools.partial(
        reduce_shard, plan, members, parts, norms, signing.rule, out=average[mine] if codec.lossless else None))
    reduced = signing.hooks.reduced_shard(plan.round, k, shard.tensor)  # a test harness playing a cheating reducer
    sent = received = 0

    def signed_result(tensor: torch.Tensor) -> tuple[pb.ShardResult, Payload]:
        payload = codec.encode(tensor)
        header = pb.ShardResult(round=plan.round, shard=k, ok=True, digest=digest(payload), members=members,
                                norms=shard.norms, coeffs=shard.coeffs, tau=shard.tau)
        header.signature = sign(signing.identity, result_body(signing.run_id, signing.plan_id, me, header))
        return header, payload

    def place() -> float:
        """Everyone applies what they decode, the reducer too, so that every member holds the same bytes; returns
        the codec's rounding bound of our shard."""
        if not codec.lossless:
            average[mine] = codec.decode(bytearray(payload), mine.stop - mine.start)
        elif reduced.data_ptr() != average[mine].data_ptr():  # (a test harness's variant of our shard)
            average[mine] = reduced
        return rounding_bound(codec, payload, average[mine])

    try:
        header, payload = await loop.run_in_executor(None, signed_result, reduced)
    except CodecError as exc:  # finite parts averaged to something the codec cannot carry: the shard is lost
        raise RoundAborted(f"our reduced shard {k} cannot be encoded: {exc}") from exc
    placing = loop.run_in_executor(None, place)  # beside the sends: off the loop, out of their way
    headers = {k: header}
    rounding: dict[int, float] = {}

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

    def check_and_place(i: int, h: pb.ShardResult, body: bytearray | memoryview) -> tuple[str, bool]:
        """Why reducer i's result is refused ("" when it checks out: it is now in the average), and whether that is
        proof against it."""
        checked = check_result(plan, i, h, body, me=me, members=members, own_part=own[i], codec=codec,
                               rule=signing.rule, keys=signing.keys)
        if checked.decoded is not None:
            place = average[plan.shard(i)]
            if checked.decoded.data_ptr() != place.data_ptr():  # (not received in place)
                place.copy_(checked.decoded)
            rounding[i] = checked.bound
        return checked.problem, checked.proven

    async def receive_one(i: int) -> tuple[str, str]:
        """(problem, proof) for shard i: a lost shard has a problem; a cheating reducer also a proof."""
        nonlocal received
        peer, theirs = plan.members[i], plan.shard(i)
        # A lossless shard's bytes are its values: read them straight into the average (a refused shard's bytes
        # there are never applied: a lost shard ends this pass's average).
        into = memoryview(average[theirs].numpy()).cast("B") if codec.lossless else None
        try:
            h, body = await pipes[peer].recv(pb.ShardResult, max_payload=codec.encoded_size(
                theirs.stop - theirs.start), timeout=timeout, into=into)
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
        gather_with_grace([receive_one(i) for i in others], have=1, need=n // 2 + 1, floor=signing.result_grace_floor))
    outcomes = [o or (f"{short_id(plan.members[i])} is too slow: its shard {i} did not come within the grace after a "
                      "majority had", "") for i, o in zip(others, outcomes, strict=True)]
    rounding[k] = await placing
    lost = {plan.members[i]: problem for i, (problem, _) in zip(others, outcomes, strict=True) if problem}
    cheaters = {plan.members[i]: proof for i, (_, proof) in zip(others, outcomes, strict=True) if proof}
    return Results(average=average, headers=headers, rounding=rounding, sent=sent, received=received, lost=lost,
                   cheaters=cheaters)

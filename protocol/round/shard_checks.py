"""The pure half of the sharded reduce: what a member computes and checks with no network in the way.

`swarmloco.protocol.round.shard_reduce` moves the bytes; everything it decides about them is here, as functions of
their arguments that return frozen values:

- a signed part of our shard: does its sender's signature cover these bytes, this plan and this shard (`checked_part`);
- our shard, reduced robustly over the settled contributors (`reduce_shard`, the rule of
  `swarmloco.protocol.round.robust`);
- our part of every shard as its reducer decoded it (`own_as_decoded`), which the checks and the audit compare
  against;
- a reducer's signed result (`check_result`). A reduced shard arrives with its reducer's signed header: the
  settled contributors, the norm of each one's part, the coefficients and clip radius of the robust rule. Before a
  member places a shard in its average it checks that the signature covers these bytes and this plan, that the
  contributors are the settled ones, that the coefficients follow from the norms and the plan's weights, that the
  norm reported for its own part is the one it sent, and that the shard is no longer than the combination can be.
  Any failure of a signed result is proof against its reducer (its signature is on the header).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.codecs import Codec, CodecError
from swarmloco.protocol.round.config import Rule
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
from swarmloco.protocol.trust.payloads import digest, part_body, result_body, signed

Payload = bytes | bytearray | memoryview


@dataclass(frozen=True)
class RoundKeys:
    """What binds every signature of one round's reduce: the run, and the digest of the plan we hold."""

    run_id: str
    plan_id: bytes


@dataclass(frozen=True)
class ReducedShard:
    """Our shard aggregated over the settled contributors, with the numbers its reducer signs."""

    tensor: torch.Tensor
    norms: tuple[float, ...]  # each settled contributor's part, settled order
    coeffs: tuple[float, ...]  # the robust rule's coefficient of each part, same order
    tau: float  # the rule's clip radius


@dataclass(frozen=True)
class ResultCheck:
    """A reducer's signed result, judged. Refused: `problem` says why, and `proven` whether that is evidence
    against the reducer (it signed these bytes). Accepted: the decoded shard and the codec's rounding bound."""

    problem: str = ""
    proven: bool = False
    decoded: torch.Tensor | None = None
    bound: float = 0.0


def checked_part(plan: Plan, k: int, peer: str, header: pb.ShardPart, body: bytearray, *, codec: Codec,
                 keys: RoundKeys) -> tuple[torch.Tensor, float]:
    """`peer`'s part of our shard k, decoded, and its norm; raises CodecError when its signature does not cover these
    bytes or they do not decode."""
    size = plan.shard(k).stop - plan.shard(k).start
    if digest(body) != bytes(header.digest) or not signed(
            peer, part_body(keys.run_id, plan.round, keys.plan_id, k, peer, bytes(header.digest)),
            bytes(header.signature)):
        raise CodecError("its signature does not cover these bytes (altered on the way, or forged)")
    return codec.decode_with_norm(body, size)


def reduce_shard(plan: Plan, members: tuple[str, ...], parts: Mapping[str, torch.Tensor], norms: Mapping[str, float],
                 rule: Rule, *, out: torch.Tensor | None = None) -> ReducedShard:
    """Our shard aggregated over the settled contributors `members` (each one's part in `parts`, its norm, found
    when the part was checked, in `norms`), into `out` when given."""
    weight = dict(zip(plan.members, plan.weights, strict=True))
    part_norms = [norms[p] for p in members]
    coeffs, tau = coefficients(part_norms, [weight[p] for p in members], rule)
    return ReducedShard(aggregate([parts[p] for p in members], coeffs, out=out), tuple(part_norms), tuple(coeffs),
                        tau)


def own_as_decoded(plan: Plan, k: int, own: torch.Tensor, codec: Codec,
                   sent: Mapping[int, Payload]) -> tuple[torch.Tensor, ...]:
    """Our part of every shard as its reducer decoded it: our own shard k as it is (we reduce it unencoded), the
    others decoded from the bytes we sent."""
    out = []
    for j in range(len(plan.members)):
        s = plan.shard(j)
        try:
            lossy = j != k and not codec.lossless and j in sent
            out.append(codec.decode(bytearray(sent[j]), s.stop - s.start) if lossy else own[s])
        except CodecError:  # our part of shard j could not be encoded (a non-finite Δ): it was refused anyway
            out.append(own[s])
    return tuple(out)


def check_result(plan: Plan, i: int, header: pb.ShardResult, body: bytearray | memoryview, *, me: str,
                 members: tuple[str, ...], own_part: torch.Tensor, codec: Codec, rule: Rule,
                 keys: RoundKeys) -> ResultCheck:
    """Reducer i's result judged by member `me`, who settled on `members` and sent `own_part` of shard i: refused
    unless it is signed, over the settled contributors, with coefficients that follow from its norms and the plan's
    weights, our part's norm as we sent it, and a norm its coefficients allow. Decodes it on success."""
    peer = plan.members[i]
    if digest(body) != bytes(header.digest) or not signed(
            peer, result_body(keys.run_id, keys.plan_id, peer, header), bytes(header.signature)):
        return ResultCheck("unsigned or altered on the way")  # anyone on the path could have done this
    try:
        return _check_signed(plan, i, header, body, me=me, members=members, own_part=own_part, codec=codec, rule=rule)
    except CodecError as exc:
        return ResultCheck(f"malformed result: {exc}", proven=True)


def _check_signed(plan: Plan, i: int, header: pb.ShardResult, body: bytearray | memoryview, *, me: str,
                  members: tuple[str, ...], own_part: torch.Tensor, codec: Codec, rule: Rule) -> ResultCheck:
    if tuple(header.members) != members:
        return ResultCheck("its result is over other contributors than the settled ones", proven=True)
    weight = dict(zip(plan.members, plan.weights, strict=True))
    norms, coeffs = list(header.norms), list(header.coeffs)
    if not coefficients_ok(norms, [weight[p] for p in members], coeffs, header.tau, rule):
        return ResultCheck("its coefficients do not follow from the norms and weights it signed", proven=True)
    if me in members and not norm_matches(norms[members.index(me)], norm(own_part)):
        return ResultCheck(f"it reports our part's norm as {norms[members.index(me)]:.6g}, we sent "
                           f"{norm(own_part):.6g}", proven=True)
    theirs = plan.shard(i)
    decoded, size = codec.decode_with_norm(body, theirs.stop - theirs.start)
    bound = rounding_bound(codec, body, decoded)
    if not within_bound(size, coeffs, norms, bound):
        return ResultCheck(f"its result's norm {size:.6g} exceeds what its coefficients allow", proven=True)
    return ResultCheck(decoded=decoded, bound=bound)

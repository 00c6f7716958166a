"""The audit of a sharded round: every member checks every reduced shard before it signs anything.

A reducer's signed result says "shard j = Σ coeff_i × part_i" over the settled contributors' parts. Checking it
directly would mean moving every part to every member. Instead, once every result is fixed, the members draw
random probes R and compare scalars: each contributor i publishes <R, its own part of shard j> for every j,
signed, and every member checks <R, result_j> against Σ coeff_i <R, part_i> (R cut to shard j's length). A wrong
result fails that test unless its error happens to be orthogonal to a probe it could not know when it sent it.

The steps, each one frame on every shard connection:
1. Reveal. The nonce behind each member's audit commitment (its claim carried sha256 of it), with the signed header
   of every result it received. The probes' seed is drawn from all nonces, so no reducer knew it in advance. Two
   different signed headers for one shard prove that its reducer equivocated.
2. Sketch. Each member's signed sketches of its own parts, every shard.
3. Verdict. Each reducer checks the sketches of its shard against the parts it holds (`_our_verdict`: at once
   when they combine to its own result, part by part when not). A contributor whose sketch does not match is
   accused, with its signed part as evidence anyone can recompute. Otherwise the reducer signs "every sketch
   matches", so a combination that then fails is proof that the reducer lied.

When the round scores contributions (`AuditCase.probe`), each member also computes g, the loss gradient at θ_r on
held-out batches the seed picks, and every sketch carries one more value per shard, <g_j, part>: checked by the
reducer like the others (within a tolerance for two devices' gradients), and summed into each contributor's score,
its first-order loss decrease (`swarmloco.protocol.round.credit`).

Whoever is proven to have cheated is returned to the caller, which refuses the round and bans them for the run; a
member that stops answering is blamed for the round and skipped for a while, like a vanished one.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from google.protobuf.message import Message

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.codecs import Codec, CodecError
from swarmloco.protocol.base.text import bounded, short_id
from swarmloco.protocol.base.wire import WireError, frame_bytes
from swarmloco.protocol.round.credit import clip_scales, gradient_combination_ok, gradient_dot_matches
from swarmloco.protocol.round.groups import RoundAborted
from swarmloco.protocol.round.pipes import Pipe
from swarmloco.protocol.round.plans import Plan
from swarmloco.protocol.round.probes import sketches
from swarmloco.protocol.round.robust import combination_ok, norm, sketch_matches
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.payloads import (
    commitment,
    digest,
    part_body,
    result_body,
    result_body_of,
    sign,
    signed,
    signed_digest,
    sketch_body,
    verdict_body,
)

M = TypeVar("M", bound=Message)


@dataclass(frozen=True, kw_only=True)
class AuditCase:
    """What one member brings to the audit of a round it holds every result of."""

    plan: Plan
    plan_id: bytes
    k: int  # our index in the plan
    run_id: str
    identity: Identity
    codec: Codec
    probes: int
    nonce: bytes
    commits: tuple[str, ...]  # each member's audit commitment, plan order
    settled: tuple[str, ...]
    results: Mapping[int, pb.ShardResult]  # every shard's signed header as we received it (ours included)
    rounding: Mapping[int, float]  # the codec's rounding bound of each received result
    average: torch.Tensor  # the decoded results
    own: Sequence[torch.Tensor]  # our part of every shard, as its reducer decoded it
    parts: Mapping[str, torch.Tensor]  # the parts of our shard we hold, by contributor
    part_frames: Mapping[str, tuple[pb.ShardPart, bytearray]] = field(default_factory=dict)  # signed headers + bytes
    # The loss gradient at θ_r on a probe batch drawn from the audit's seed, flat like Δ (None: no credit scores)
    probe: Callable[[bytes], torch.Tensor] | None = None


@dataclass
class Findings:
    cheaters: dict[str, str] = field(default_factory=dict)  # peer -> the evidence, in words
    failed: set[int] = field(default_factory=set)  # shards that failed their check
    sent: int = 0  # bytes the audit's frames took, each way
    received: int = 0
    scores: dict[str, float] | None = None  # settled contributor -> first-order loss decrease of its merged Δ

    def convict(self, peer: str, why: str) -> None:
        self.cheaters.setdefault(peer, bounded(why))


async def audit(case: AuditCase, pipes: dict[str, Pipe], *, timeout: float) -> Findings:
    """Run the three audit steps with every other member; returns who was proven to cheat (empty: every shard
    checks out). Raises RoundAborted, blaming the peer, when a member does not take part."""
    plan, me = case.plan, case.plan.members[case.k]
    others = [p for p in plan.members if p != me]
    found = Findings()
    loop = asyncio.get_running_loop()
    n, q = len(plan.members), case.probes

    bodies = [result_body(case.run_id, case.plan_id, plan.members[j], case.results[j]) for j in range(n)]
    reveal = pb.AuditReveal(round=plan.round, nonce=case.nonce, digests=[signed_digest(b) for b in bodies],
                            signatures=[case.results[j].signature for j in range(n)])
    reveals = await _everyone(case, found, pipes, others, reveal, pb.AuditReveal, 0, timeout)
    nonces = {me: case.nonce}
    for peer, (msg, _) in reveals.items():
        i = plan.members.index(peer)
        if msg.round != plan.round or commitment(bytes(msg.nonce)) != case.commits[i]:
            raise RoundAborted(f"{short_id(peer)} revealed a nonce that is not the one it committed to", blame=peer)
        nonces[peer] = bytes(msg.nonce)
        for j, (d, sig) in enumerate(zip(msg.digests[:n], msg.signatures[:n], strict=False)):
            reducer = plan.members[j]
            if bytes(d) != signed_digest(bodies[j]) and signed(reducer, result_body_of(bytes(d)), bytes(sig)):
                found.convict(reducer, f"signed two different results for shard {j} (equivocation)")
    if found.cheaters:
        return found
    seed = hashlib.sha256(case.plan_id + b"".join(nonces[p] for p in plan.members)).digest()

    def sketch_all() -> tuple[list[list[float]], list[list[float]], _Gradient | None]:
        grad = _Gradient.of(case, seed)
        tensors = [[case.own[j], case.average[plan.shard(j)]] for j in range(n)]
        outs = sketches(seed, q, tensors, None if grad is None else grad.shards, parallel=True)
        return [out[0] for out in outs], [out[1] for out in outs], grad

    own, result_sketches, grad = await loop.run_in_executor(None, sketch_all)
    width = q + (grad is not None)  # values per shard: the random probes, then <g_j, part> when scoring
    mine = pb.AuditSketch(round=plan.round, sketches=[s for shard in own for s in shard])
    mine.signature = sign(case.identity, sketch_body(case.run_id, case.plan_id, me, mine))
    received = await _everyone(case, found, pipes, others, mine, pb.AuditSketch, 0, timeout)
    theirs: dict[str, list[list[float]]] = {me: own}
    for peer, (msg, _) in received.items():
        values = list(msg.sketches)
        # (an excluded member's Δ, e.g. a NaN one, is in no shard: its sketches are never used)
        finite = peer not in case.settled or all(math.isfinite(v) for v in values)
        if msg.round != plan.round or len(values) != n * width or not finite or \
                not signed(peer, sketch_body(case.run_id, case.plan_id, peer, msg), msg.signature):
            raise RoundAborted(f"{short_id(peer)} sent a malformed or unsigned audit sketch", blame=peer)
        theirs[peer] = [values[j * width:(j + 1) * width] for j in range(n)]

    verdict, evidence = await loop.run_in_executor(None, _our_verdict, case, seed, theirs, result_sketches[case.k],
                                                   grad)
    verdict.signature = sign(case.identity, verdict_body(case.run_id, case.plan_id, me, verdict))
    if verdict.accused:
        found.convict(verdict.accused, f"its audit sketch of shard {case.k} does not match the part it signed")
    verdicts = await _everyone(case, found, pipes, others, verdict, pb.AuditVerdict, None, timeout, payload=evidence)
    for reducer, (v, body) in verdicts.items():
        j = plan.members.index(reducer)
        if v.round != plan.round or v.shard != j or \
                not signed(reducer, verdict_body(case.run_id, case.plan_id, reducer, v), v.signature):
            raise RoundAborted(f"{short_id(reducer)} sent a malformed or unsigned audit verdict", blame=reducer)
        if v.accused:
            liar = await loop.run_in_executor(None, _judge, case, seed, grad, j, reducer, v, bytes(body), theirs)
            found.convict(liar, f"audit of shard {j}: " + (
                "its sketch does not match the part it signed" if liar == v.accused else
                f"it accused {short_id(v.accused)} without evidence"))
            found.failed.add(j)
    for j, reducer in enumerate(plan.members):
        if j in found.failed or (j == case.k and verdict.accused):
            continue
        header = case.results[j]
        members = list(header.members)
        if not combination_ok(result_sketches[j][:q], list(header.coeffs), [theirs[p][j][:q] for p in members],
                              list(header.norms), case.rounding[j]):
            found.failed.add(j)
            found.convict(reducer, f"shard {j} is not the combination of the parts it signed")
        elif grad is not None and not gradient_combination_ok(
                result_sketches[j][q], list(header.coeffs), [theirs[p][j][q] for p in members], list(header.norms),
                g_norm=grad.norms[j], rounding=case.rounding[j], size=plan.shard(j).stop - plan.shard(j).start):
            # it vouched for every other contributor's <g_j, part>: its own is the one that does not add up
            found.failed.add(j)
            found.convict(reducer, f"shard {j}: its own part's <g, part> (its credit) does not fit its result")
    if grad is not None and not found.cheaters:
        found.scores = _scores(case, theirs, q)
    return found


@dataclass(frozen=True)
class _Gradient:
    """Our copy of the round's probe gradient g, cut into the plan's shards, and the norm of each shard of it."""

    shards: tuple[torch.Tensor, ...]
    norms: tuple[float, ...]

    @classmethod
    def of(cls, case: AuditCase, seed: bytes) -> _Gradient | None:
        if case.probe is None:
            return None
        g = case.probe(seed).reshape(-1).to(torch.float32)
        if g.numel() != case.plan.numel or not bool(torch.isfinite(g).all()):
            # every member must send <g_j, part> for every shard; without a usable g we cannot take part
            raise RoundAborted(f"our credit probe gave {g.numel()} values (finite: {bool(torch.isfinite(g).all())})"
                               f" for a model of {case.plan.numel}")
        shards = tuple(g[case.plan.shard(j)] for j in range(len(case.plan.members)))
        return cls(shards, tuple(norm(shard) for shard in shards))


def _sketch(seed: bytes, j: int, probes: int, grad: _Gradient | None,
            tensors: list[torch.Tensor]) -> list[list[float]]:
    """Each tensor's values for shard j: the random probes, then <g_j, x> when the round scores contributions."""
    return sketches(seed, probes, [tensors], None if grad is None else [grad.shards[j]])[0]


def _part_matches(claimed: list[float], ours: list[float], part: torch.Tensor, j: int, probes: int,
                  grad: _Gradient | None) -> bool:
    """A contributor's signed sketch of its part of shard j against ours of the part it signed."""
    scale = norm(part) * math.sqrt(max(part.numel(), 1))
    if not sketch_matches(claimed[:probes], ours[:probes], scale):
        return False
    return grad is None or gradient_dot_matches(claimed[probes], ours[probes], g_norm=grad.norms[j],
                                                part_norm=norm(part), size=part.numel())


def _scores(case: AuditCase, theirs: dict[str, list[list[float]]], q: int) -> dict[str, float]:
    """Each settled contributor's Σ_j clip_ij · <g_j, part_ij>, from the signed headers and sketches every member
    holds alike (shard order, then header order: the same float additions everywhere)."""
    scores: dict[str, float] = {}
    for j in range(len(case.plan.members)):
        header = case.results[j]
        scales = clip_scales(list(header.norms), list(header.coeffs), header.tau)
        for peer, scale in zip(header.members, scales, strict=True):
            scores[peer] = scores.get(peer, 0.0) + scale * theirs[peer][j][q]
    return scores


def _our_verdict(case: AuditCase, seed: bytes, theirs: dict[str, list[list[float]]], our_result: list[float],
                 grad: _Gradient | None) -> tuple[pb.AuditVerdict, bytes | bytearray]:
    """Our verdict on the sketches of our shard's parts: "every sketch matches", or an accusation with the signed
    part as evidence. The parts are only sketched where needed. The contributors' sketches must combine to our own
    result within half of what a member allows: then every member's check of our shard passes (its sums of the
    same values differ from ours by far less), whatever any one sketch says. Their <g, part> values feed the
    credit scores, so those are checked part by part. Only when either fails do we sketch every part we hold, to
    find whose sketch is not of the part it signed."""
    verdict = pb.AuditVerdict(round=case.plan.round, shard=case.k)
    me, k, q = case.plan.members[case.k], case.k, case.probes
    held = [p for p in case.settled if p != me]
    header = case.results[k]
    combines = combination_ok(our_result[:q], list(header.coeffs), [theirs[p][k][:q] for p in header.members],
                              list(header.norms), case.rounding[k], share=0.5)
    if combines and grad is None:
        return verdict, b""
    if combines:
        dots = _sketch(seed, k, 0, grad, [case.parts[p] for p in held])
        if all(gradient_dot_matches(theirs[p][k][q], d[0], g_norm=grad.norms[k], part_norm=norm(case.parts[p]),
                                    size=case.parts[p].numel()) for p, d in zip(held, dots, strict=True)):
            return verdict, b""
    ours = _sketch(seed, k, q, grad, [case.parts[p] for p in held])
    for peer, values in zip(held, ours, strict=True):
        if not _part_matches(theirs[peer][k], values, case.parts[peer], k, q, grad):
            header_of, payload = case.part_frames[peer]
            verdict.accused, verdict.part_digest, verdict.part_signature = peer, header_of.digest, header_of.signature
            return verdict, payload
    return verdict, b""


def _judge(case: AuditCase, seed: bytes, grad: _Gradient | None, j: int, reducer: str, v: pb.AuditVerdict,
           body: bytes, theirs: dict[str, list[list[float]]]) -> str:
    """Who lied, given reducer j's accusation: the accused when its signed part contradicts its sketch, else the
    reducer (an accusation without valid evidence is itself signed)."""
    accused = v.accused
    plan = case.plan
    if accused not in case.settled or accused not in theirs:
        return reducer
    body_ok = digest(body) == bytes(v.part_digest) and signed(
        accused, part_body(case.run_id, plan.round, case.plan_id, j, accused, bytes(v.part_digest)),
        bytes(v.part_signature))
    if not body_ok:
        return reducer
    size = plan.shard(j).stop - plan.shard(j).start
    try:
        part = case.codec.decode(bytearray(body), size)
    except CodecError:
        return accused  # it signed bytes that do not decode: its part was never valid
    ours = _sketch(seed, j, case.probes, grad, [part])[0]
    return reducer if _part_matches(theirs[accused][j], ours, part, j, case.probes, grad) else accused


async def _everyone(case: AuditCase, found: Findings, pipes: dict[str, Pipe], others: list[str], message: Message,
                    kind: type[M], max_payload: int | None, timeout: float, *,
                    payload: bytes | bytearray = b"") -> dict[str, tuple[M, bytearray]]:
    """Send `message` to every other member and receive one `kind` frame from each (at most `max_payload` bytes;
    None: up to the encoded size of the sender's shard); counts the bytes in `found`."""

    async def send(peer: str) -> None:
        sent = await pipes[peer].send(message, payload, timeout=timeout)
        found.sent += sent  # (not `+= await`: that would read the total before the await)

    async def recv(peer: str) -> tuple[M, bytearray]:
        cap = max_payload
        if cap is None:
            s = case.plan.shard(case.plan.members.index(peer))
            cap = case.codec.encoded_size(s.stop - s.start)
        try:
            header, body = await pipes[peer].recv(kind, max_payload=cap, timeout=timeout)
            found.received += frame_bytes(header, len(body))
            return header, body
        except WireError as exc:
            raise RoundAborted(f"{short_id(peer)} did not take part in the audit: {exc}", blame=peer) from exc

    sends = asyncio.gather(*(send(p) for p in others))
    try:
        got = await asyncio.gather(*(recv(p) for p in others))
    finally:
        try:
            await sends
        except WireError:
            pass  # a member we could not reach fails its own audit; ours only needs what it sent us
    return dict(zip(others, got, strict=True))

"""Credit for verified work: which contributions of a round lowered the loss, and what each is credited.

Claimed token counts are a peer's word. What a round can verify is the effect of each Δ on the loss: once every
contribution is signed and every result fixed, the audit's seed (drawn from all members' revealed nonces) picks a
probe batch nobody could know in advance, and each member computes g, the loss gradient at θ_r on that batch. The
audit then carries one more sketch per shard, s_ij = <g_j, part_ij>, checked by shard j's reducer against the part
it holds like the random probes (`swarmloco.protocol.round.audit`). So every member holds the same signed, checked
numbers, and

    u_i = Σ_j clip_ij · s_ij

is the first-order loss decrease of member i's Δ as the round merged it (clip_ij: the robust rule's scale of its
part of shard j, 0 when rejected). A zero Δ scores exactly 0; a Δ drawn without regard to the loss scores about
±|g||Δ|/√n, far below an honest one (`python -m scripts.bench scores`).

`credits` turns scores into the statement's credit: a member is credited its merge weight when it lowered the loss
at a rate per claimed unit of weight no less than 1/`CREDIT_BAND` of the group's median rate, else 0. The median is
over the members that lowered the loss, so honest peers of uneven speed all pass while a claim far beyond the work
behind it fails. The certificate carries that credit; the chain's work and the coordinator's ledger count only it,
and the next round's plan cuts the merge weight of a member its last certified round did not credit
(`uncredited`) to 1 until it earns credit again.

Every member computes this from the same signed numbers with the same float operations, and signs the result: a
member that computed otherwise signs another statement, and its signature does not count.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from swarmloco.protocol.round.config import RoundConfig
from swarmloco.protocol.round.exchange import MemberClaim
from swarmloco.protocol.round.plans import Plan
from swarmloco.protocol.round.rules import token_weights
from swarmloco.protocol.trust.certificates import Head

CREDIT_BAND = 8.0  # credited while the loss decrease per unit of claimed weight is ≥ 1/8 of the group's median
GRAD_RTOL = 1e-4  # tolerance of a gradient sketch, relative to |g_j|·|part|: two devices' fp32 gradients differ


def credits(scores: Sequence[float], claimed: Sequence[int], weights: Sequence[int]) -> tuple[int, ...]:
    """Credit per member, in the order given: its merge weight `weights[i]` when its score (first-order loss
    decrease) is positive and its rate `scores[i] / claimed[i]` is at least the group's (lower) median rate among
    positive scores ÷ CREDIT_BAND; else 0. `claimed` is the weight its claim gives before any cut: a member whose
    weight was cut is judged on the tokens it claims, so a cut alone never earns credit back."""
    if not len(scores) == len(claimed) == len(weights):
        raise ValueError("credits: need one score, claimed weight and weight per member")
    rates = [s / c for s, c in zip(scores, claimed, strict=True) if s > 0 and c > 0]
    if not rates:
        return tuple(0 for _ in weights)
    median = sorted(rates)[(len(rates) - 1) // 2]
    return tuple(w if s > 0 and c > 0 and s / c * CREDIT_BAND >= median else 0
                 for s, c, w in zip(scores, claimed, weights, strict=True))


def round_credit(plan: Plan, members: Sequence[str], weights: Sequence[int], scores: Mapping[str, float] | None,
                 cfg: RoundConfig) -> tuple[int, ...] | None:
    """The statement's credit for the settled `members` (their merge `weights`, same order) from the audit's
    `scores`; None when the round did not score contributions. Judged against the weights the plan's signed claims
    give before any cut (`token_weights` over the whole plan, as its leader derived them)."""
    if scores is None:
        return None
    claims = [MemberClaim.of(c) for c in plan.claims]
    claimed = token_weights({p: (c.tokens, c.staleness) for p, c in zip(plan.members, claims, strict=True)},
                            cfg=cfg)
    return credits([scores.get(p, 0.0) for p in members], [claimed[p] for p in members], weights)


def uncredited(head: Head) -> frozenset[str]:
    """The members the certificate of `head` names with a positive weight and no credit: a plan from this state
    gives each of them a merge weight of 1 (every member of the round re-derives the same from the same head)."""
    cert = head.certificate
    if cert is None or cert.statement.credit is None:
        return frozenset()
    s = cert.statement
    return frozenset(p for p, w, c in zip(s.members, s.weights, s.credit, strict=True) if w > 0 and c == 0)


def clip_scales(norms: Sequence[float], coeffs: Sequence[float], tau: float) -> list[float]:
    """The robust rule's scale of each part of one shard, read back from its signed header: 1 when kept whole,
    tau / norm when clipped, 0 when rejected (a zero coefficient)."""
    return [0.0 if c == 0 else tau / n if 0 < tau < n else 1.0 for n, c in zip(norms, coeffs, strict=True)]


def gradient_combination_ok(result_dot: float, coeffs: Sequence[float], part_dots: Sequence[float],
                            norms: Sequence[float], *, g_norm: float, rounding: float, size: int) -> bool:
    """<g_j, shard_j> = Σ c_i <g_j, part_i> (the parts' values as their contributors signed them), within what honest
    numbers can differ by. This is the check of the one value no member can check alone: the reducer's own
    <g_j, part>, since it holds the only copy of its part. Each contributor's value comes from its own device's g,
    within GRAD_RTOL·|g_j|·|part| of the reducer's (which checked it) and as much again of ours; the result's error
    (the codec's rounding, the reducer's float32 sum, bounded as in `robust.combination_ok`) moves <g_j, ·> by at
    most |g_j| times its norm. Twice the room of that sum is allowed, so an honest reducer never fails it."""
    terms = sum(abs(c) * n for c, n in zip(coeffs, norms, strict=True))
    error_norm = rounding + 1e-6 * (len(coeffs) + 8) * terms
    tolerance = 2 * g_norm * (2 * GRAD_RTOL * terms + 1e-9 * math.sqrt(max(size, 1)) * terms + error_norm) + 1e-30
    want = sum(c * d for c, d in zip(coeffs, part_dots, strict=True))
    return math.isfinite(result_dot) and abs(result_dot - want) <= tolerance


def gradient_dot_matches(claimed: float, ours: float, *, g_norm: float, part_norm: float, size: int) -> bool:
    """A member's <g_j, own part> against the reducer's, each with its own g: within GRAD_RTOL of |g_j|·|part|
    (two devices compute slightly different gradients), plus float64 summation order."""
    tolerance = GRAD_RTOL * g_norm * part_norm + 1e-9 * g_norm * part_norm * math.sqrt(max(size, 1)) + 1e-30
    return math.isfinite(claimed) and abs(claimed - ours) <= tolerance

"""Robust aggregation of one shard, and the arithmetic every member uses to check a reducer's result.

The rule (`coefficients`) depends only on numbers each honest contributor can check for itself: the L2 norm of
each contributor's part of the shard and the plan's weights. With `clip` (the default):

    mu    = the (lower) median of the parts' norms
    tau   = clip_factor × mu
    part i is rejected when its norm exceeds reject_factor × mu (weight 0), else scaled by min(1, tau / norm_i)
    result = Σ coeff_i × part_i,  coeff_i = w_i × scale_i / Σ_{not rejected} w_j

so any one contribution moves a shard by at most its weight share × tau, whatever it sent, and a contribution
orders of magnitude off (Δ × −1000, a random 1000× vector) is dropped from the shard outright. The median is over
contributors, not weights: inflating a token count does not move it. `mean` (plain weighted mean) stays for the
control experiment.

A reducer signs the norms, tau and coefficients with its result. Each member then checks, without any other data:
the coefficients follow from the norms and weights (`coefficients_ok`); its own part's norm is what the reducer
says (`norm_matches`); and the result is no longer than Σ coeff_i × norm_i (`within_bound`, the triangle inequality,
plus the codec's rounding). That last check bounds a reducer that lies about its own part's norm, the one number
nobody else can check. Whether the result is that combination of those exact parts is the audit's job
(`swarmloco.protocol.round.audit`): random probes R drawn after the result is fixed, with
<R, result> = Σ coeff_i <R, part_i>.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from swarmloco.protocol.base.buffers import large_empty
from swarmloco.protocol.base.codecs import BLOCK, Codec, l2_norm
from swarmloco.protocol.round.config import Rule

NORM_RTOL = 1e-5  # a reducer's reported norm of our part vs ours (float64 sums of the same decoded values)


norm = l2_norm  # every norm the robust rule and its checks compare is this one computation


def coefficients(norms: Sequence[float], weights: Sequence[int], rule: Rule) -> tuple[list[float], float]:
    """(coeff_i per contributor, tau) for parts of these norms and weights; pure float arithmetic, so every member
    recomputes exactly what an honest reducer computed."""
    if not norms or len(norms) != len(weights):
        raise ValueError("coefficients: need one norm per weight, at least one")
    if rule.aggregator == "mean":
        total = float(sum(weights))
        return [w / total for w in weights], 0.0
    mu = sorted(norms)[(len(norms) - 1) // 2]
    tau = rule.clip_factor * mu
    kept = [not (rule.reject_factor and n > rule.reject_factor * mu) for n in norms]
    total = float(sum(w for w, k in zip(weights, kept, strict=True) if k))
    scales = [(1.0 if n <= tau else tau / n) if k else 0.0 for n, k in zip(norms, kept, strict=True)]
    return [w * s / total for w, s in zip(weights, scales, strict=True)], tau


def coefficients_ok(norms: Sequence[float], weights: Sequence[int], coeffs: Sequence[float], tau: float,
                    rule: Rule) -> bool:
    if len(coeffs) != len(weights) or len(norms) != len(weights):
        return False
    if not all(math.isfinite(n) and n >= 0 for n in norms):
        return False
    want, want_tau = coefficients(norms, weights, rule)
    return math.isclose(tau, want_tau, rel_tol=1e-12, abs_tol=0.0) and all(
        math.isclose(c, w, rel_tol=1e-12, abs_tol=1e-300) for c, w in zip(coeffs, want, strict=True))


def aggregate(parts: Sequence[torch.Tensor], coeffs: Sequence[float], *, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Σ coeff_i part_i, in order (the same float operations everywhere), into `out` when given (contiguous fp32 of
    the parts' length); zero coefficients cost nothing. The first term is a product, not an add to zeros: the same
    rounding (0 + c·x rounds c·x once), without a pass to clear the output."""
    acc = large_empty(parts[0].numel()) if out is None else out
    if acc.dtype != torch.float32 or not acc.is_contiguous() or acc.numel() != parts[0].numel():
        raise ValueError(f"aggregate: out must be contiguous fp32 of {parts[0].numel()} elements")
    acc = acc.view(parts[0].shape)
    terms = [(part, c) for part, c in zip(parts, coeffs, strict=True) if c]
    if not terms:
        return acc.zero_()
    torch.mul(terms[0][0], terms[0][1], out=acc)
    for part, c in terms[1:]:
        acc.add_(part, alpha=c)
    return acc


def norm_matches(reported: float, ours: float) -> bool:
    return abs(reported - ours) <= NORM_RTOL * max(ours, reported) + 1e-30


def rounding_bound(codec: Codec, payload: bytes | bytearray | memoryview, decoded: torch.Tensor) -> float:
    """An upper bound on ||decoded − x|| for any x this codec encodes to `payload`: zero for fp32; half a step per
    element for int8/int4 (from each block's scale); half an ulp of each value for fp16/bf16."""
    if codec.lossless or decoded.numel() == 0:
        return 0.0
    if codec.name in ("int8", "int4"):
        blocks = -(-decoded.numel() // BLOCK)
        scales = torch.frombuffer(bytearray(memoryview(payload)[: 4 * blocks]), dtype=torch.float32)
        half_steps = scales.double() / 2
        return float(torch.sqrt((half_steps * half_steps).sum() * BLOCK)) * (1 + 1e-5)
    mantissa = {"fp16": 10, "bf16": 7}[codec.name]
    tiny = {"fp16": 2.0**-25, "bf16": 2.0**-134}[codec.name]  # half the smallest subnormal step
    return norm(decoded) * 2.0 ** -(mantissa + 1) * (1 + 1e-3) + tiny * math.sqrt(decoded.numel())


def within_bound(result_norm: float, coeffs: Sequence[float], norms: Sequence[float], rounding: float) -> bool:
    """||Σ c_i x_i|| ≤ Σ |c_i| ||x_i||, after the codec's rounding, with float slack."""
    bound = sum(abs(c) * n for c, n in zip(coeffs, norms, strict=True))
    return result_norm <= bound * (1 + 1e-5) + rounding + 1e-30


def combination_ok(result_sketch: Sequence[float], coeffs: Sequence[float], part_sketches: Sequence[Sequence[float]],
                   norms: Sequence[float], rounding: float, *, share: float = 1.0) -> bool:
    """<R, result> = Σ c_i <R, x_i> for every probe, within the codec's rounding and the float32 rounding of the
    reducer's sum (about (N + 1) ulps of each term, with room to spare). A probe of an error e is strictly
    sub-Gaussian with variance ||e||² (`swarmloco.protocol.round.probes`), so 7 standard deviations of the codec's
    rounding bound are exceeded by an honest reducer with probability below 1e-10. `share` < 1 allows only that
    part of it (a reducer vouching for its own shard's sketches, so that every member's full check passes)."""
    float_slack = 1e-6 * (len(coeffs) + 8) * sum(abs(c) * n for c, n in zip(coeffs, norms, strict=True))
    slack = share * (7 * rounding + float_slack) + 1e-30
    for p, got in enumerate(result_sketch):
        want = sum(c * s[p] for c, s in zip(coeffs, part_sketches, strict=True))
        if not abs(got - want) <= slack:
            return False
    return True


def sketch_matches(claimed: Sequence[float], ours: Sequence[float], scale: float) -> bool:
    """A contributor's sketch of its own part against the reducer's sketch of the same decoded values: equal up
    to float64 summation order (`scale`: ||part|| × sqrt(len), the size of the dot's terms)."""
    if len(claimed) != len(ours):
        return False
    return all(abs(a - b) <= 1e-9 * scale + 1e-30 for a, b in zip(claimed, ours, strict=True))

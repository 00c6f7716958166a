"""The audit's random probes, and the float64 dot products every member takes with them.

A probe R is a vector of the shard's length whose values are independent and uniform on the 65,536 half-integers
±0.5, ±1.5, …, ±32,767.5, read from BLAKE3's extendable output keyed by (the audit's seed, the shard, the probe
index). Nobody knows the seed before every reduced shard is fixed, so a reducer cannot aim its error at a probe.

Why these values rather than Gaussian draws:
- **Cost.** Drawing a standard normal took torch about 3 ns an element, more than everything else in the audit
  together; BLAKE3 gives two bytes an element in about 0.25 ns and releases the GIL.
- **The same checks hold.** The values are symmetric and bounded, so <R, e> is strictly sub-Gaussian with variance
  Var(R)·||e||² (a uniform distribution on a symmetric set is): the tail a member allows an honest reducer's
  rounding (`robust.combination_ok`, 7 standard deviations) stays what it was for Gaussian probes. There is no value
  0, so a change to a single element always moves the dot, and two elements' changes cancel only when their probe
  values tie, one chance in 65,536 per probe.
- **Exact products.** A value needs 17 bits and a float32 24, so every product is exact in float64 and two members'
  sums of the same values differ only by summation order (`robust.sketch_matches` allows 1e-9 relative).

Sketches are divided by the values' standard deviation, so a probe behaves like a unit-variance one to every caller.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from blake3 import blake3

# Elements per chunk of a probe or of a tensor dotted with one: 1 MiB of float64 per buffer, so a chunk's probes and
# widened slice stay in cache between their dots (1.5x faster than 8 MiB chunks here). The probe values do not depend
# on it; the sums only change their order of addition, well within `robust.sketch_matches`.
PROBE_CHUNK = 1 << 17
PROBE_STD = math.sqrt((65536.0**2 - 1) / 12)  # the standard deviation of a probe value


def probe_key(seed: bytes, shard: int, probe: int) -> bytes:
    return hashlib.sha256(seed + f"/{shard}/{probe}".encode()).digest()


def probe_values(key: bytes, start: int, count: int, out: torch.Tensor) -> torch.Tensor:
    """Elements [start, start + count) of the probe `key`, widened into `out[:count]` (float64)."""
    raw = blake3(key).digest(length=2 * count, seek=2 * start)
    values = torch.from_numpy(np.frombuffer(raw, dtype="<i2").astype(np.int16))  # native order, writable
    return out[:count].copy_(values).add_(0.5)


def float64_dots(chunks: Iterable[tuple[int, Sequence[torch.Tensor]]], tensors: Sequence[torch.Tensor]
                 ) -> list[list[float]]:
    """For each tensor x and each vector c: Σ over `chunks` (start, [c's slice, …]) of <c's slice, x's slice>,
    products and sums in float64. Each slice of x is widened once and dotted with every vector's slice (float64
    already, or widened by the caller): two peers' dots of the same values differ only by summation order.
    (Summing float32 products with `sum(dtype=float64)` gives the same numbers at about 5× the cost.)"""
    out: list[list[float]] = [[] for _ in tensors]
    wide = torch.empty(0, dtype=torch.float64)
    for start, vectors in chunks:
        n = vectors[0].numel()
        if wide.numel() < n:
            wide = torch.empty(n, dtype=torch.float64)
        for values, x in zip(out, tensors, strict=True):
            w = wide[:n].copy_(x[start : start + n])
            if not values:
                values.extend(0.0 for _ in vectors)
            for i, vector in enumerate(vectors):
                values[i] += float(torch.dot(vector, w))
    return out


def sketches(seed: bytes, shard: int, probes: int, tensors: Sequence[torch.Tensor],
             extra: torch.Tensor | None = None) -> list[list[float]]:
    """For each tensor x (all of one shard's length): [<R_p, x> / PROBE_STD for p in range(probes)], followed by
    <extra, x> when an extra vector (the credit probe's gradient) is given. One pass over each tensor."""
    size = tensors[0].numel()
    keys = [probe_key(seed, shard, p) for p in range(probes)]
    buffers = [torch.empty(min(PROBE_CHUNK, size), dtype=torch.float64) for _ in range(probes + (extra is not None))]

    def chunks() -> Iterable[tuple[int, list[torch.Tensor]]]:
        for start in range(0, size, PROBE_CHUNK):
            n = min(PROBE_CHUNK, size - start)
            vectors = [probe_values(key, start, n, buffer) for key, buffer in zip(keys, buffers, strict=False)]
            if extra is not None:
                vectors.append(buffers[-1][:n].copy_(extra[start : start + n]))
            yield start, vectors

    if size == 0 or not buffers:
        return [[0.0] * len(buffers) for _ in tensors]
    dots = float64_dots(chunks(), tensors)
    return [[d / PROBE_STD for d in values[:probes]] + values[probes:] for values in dots]

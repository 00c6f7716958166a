"""The audit's random probes, and the float64 dot products every member takes with them.

A probe R is a vector whose values are independent and uniform on the 65,536 half-integers ±0.5, ±1.5, …,
±32,767.5, read from BLAKE3's extendable output keyed by (the audit's seed, the probe index); each shard is dotted
with the prefix of its length. Nobody knows the seed before every reduced shard is fixed, so a reducer cannot aim
its error at a probe.

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
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from blake3 import blake3

# Elements per chunk of a probe or of a tensor dotted with one: 1 MiB of float64 per buffer, so a chunk's probes and
# widened slice stay in cache between their dots (1.5x faster than 8 MiB chunks here). The probe values do not depend
# on it; the sums only change their order of addition, well within `robust.sketch_matches`.
PROBE_CHUNK = 1 << 17
PROBE_STD = math.sqrt((65536.0**2 - 1) / 12)  # the standard deviation of a probe value
# BLAKE3 and torch's float64 dots release the GIL: a member sketches on up to this many cores at once.
_WORKERS = min(8, os.cpu_count() or 1)
_POOL = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="swarmloco-sketch")


def probe_key(seed: bytes, probe: int) -> bytes:
    return hashlib.sha256(seed + f"/{probe}".encode()).digest()


def probe_values(key: bytes, start: int, count: int, out: torch.Tensor) -> torch.Tensor:
    """Elements [start, start + count) of the probe `key`, widened into `out[:count]` (float64)."""
    raw = blake3(key).digest(length=2 * count, seek=2 * start)
    wide = out[:count].numpy()
    np.copyto(wide, np.frombuffer(raw, dtype="<i2"))  # read as little-endian on any machine, widened in one pass
    np.add(wide, 0.5, out=wide)
    return out[:count]


Sums = list[list[list[float]]]  # [shard][tensor][value]


def sketches(seed: bytes, probes: int, shards: Sequence[Sequence[torch.Tensor]],
             extras: Sequence[torch.Tensor | None] | None = None, *, parallel: bool = False) -> Sums:
    """For each shard j and each of its tensors x (all of shard j's length): [<R_p, x> / PROBE_STD for p in
    range(probes)] over x's length, followed by <extras[j], x> where shard j has an extra vector (the credit
    probe's gradient).

    Every shard reads its length's prefix of the same `probes` vectors: each element of a probe is drawn once
    however many shards and tensors it meets, and each tensor is widened to float64 once, a chunk at a time, and
    dotted with every vector while it is in cache. (One probe for every shard is as good as one per shard: a
    shard's check only needs its probes unknown to its reducer when it fixed its result, and the seed is drawn
    after every result is fixed.) With `parallel`, the chunks are spread over `_POOL`'s threads. The chunks' sums
    are added in chunk order whatever the threads, so a sketch does not depend on the machine's core count."""
    extra_of = list(extras) if extras is not None else [None] * len(shards)
    lengths = [ts[0].numel() if ts else 0 for ts in shards]
    longest = max(lengths, default=0)
    keys = [probe_key(seed, p) for p in range(probes)]
    starts = list(range(0, longest, PROBE_CHUNK))

    def chunk_sums(piece: Sequence[int]) -> list[Sums]:
        size = min(PROBE_CHUNK, longest)
        buffers = [torch.empty(size, dtype=torch.float64) for _ in range(len(keys) + 2)]
        probe_bufs, extra_buf, wide = buffers[:-2], buffers[-2], buffers[-1]
        out: list[Sums] = []
        for start in piece:
            n = min(PROBE_CHUNK, longest - start)
            vectors = [probe_values(key, start, n, buf) for key, buf in zip(keys, probe_bufs, strict=True)]
            sums: Sums = []
            for tensors, extra, length in zip(shards, extra_of, lengths, strict=True):
                m = max(0, min(n, length - start))
                here = [v[:m] for v in vectors]
                if extra is not None:
                    here.append(extra_buf[:m].copy_(extra[start : start + m]))
                rows = []
                for x in tensors:
                    w = wide[:m].copy_(x[start : start + m])
                    rows.append([float(torch.dot(v, w)) for v in here])
                sums.append(rows)
            out.append(sums)
        return out

    workers = max(1, min(_WORKERS if parallel else 1, len(starts)))
    pieces = [starts[i::workers] for i in range(workers)]
    by_chunk: dict[int, Sums] = {}
    for piece, sums in zip(pieces, (_POOL.map if workers > 1 else map)(chunk_sums, pieces), strict=True):
        by_chunk.update(zip(piece, sums, strict=True))
    total: Sums = [[[0.0] * (probes + (e is not None)) for _ in ts] for ts, e in zip(shards, extra_of, strict=True)]
    for start in starts:  # chunk order: the same additions on every machine
        for shard_total, shard_sums in zip(total, by_chunk[start], strict=True):
            for values, row in zip(shard_total, shard_sums, strict=True):
                for i, v in enumerate(row):
                    values[i] += v
    return [[[v / PROBE_STD for v in values[:probes]] + values[probes:] for values in shard] for shard in total]

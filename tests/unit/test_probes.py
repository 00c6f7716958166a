"""The audit's random probes: what their values are, that a sketch taken a chunk at a time is the sketch of the
whole, and that the combination check (`robust.combination_ok`) built on them passes every honest reducer and
catches the errors a cheating one would hide in a shard, including the ones a cheaper probe lets through."""
from __future__ import annotations

import hashlib
import math

import pytest
import torch

from swarmloco.protocol.base.codecs import get_codec
from swarmloco.protocol.round import probes
from swarmloco.protocol.round.probes import PROBE_STD, probe_key, probe_values, sketches
from swarmloco.protocol.round.robust import aggregate, combination_ok, norm, rounding_bound

pytestmark = pytest.mark.timeout(60)
SEEDS = [hashlib.sha256(b"seed %d" % i).digest() for i in range(200)]


def _parts(n: int, size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(size)
    return [torch.randn(size, generator=g) * (i + 1) for i in range(n)]


def _checks(seed: bytes, result: torch.Tensor, parts: list[torch.Tensor], coeffs: list[float],
            rounding: float = 0.0) -> bool:
    got = sketches(seed, 2, [[result, *parts]])[0]
    return combination_ok(got[0], coeffs, got[1:], [norm(p) for p in parts], rounding)


def test_probe_values_are_the_uniform_half_integers_with_no_zero() -> None:
    values = probe_values(probe_key(b"s", 0), 0, 1 << 20, torch.empty(1 << 20, dtype=torch.float64))
    assert bool(((values * 2) % 2 == 1).all()) and float(values.abs().min()) == 0.5
    assert float(values.abs().max()) <= 32767.5
    assert abs(float(values.mean())) < 5 * PROBE_STD / math.sqrt(values.numel())
    assert float(values.std()) == pytest.approx(PROBE_STD, rel=0.01)
    other = probe_values(probe_key(b"s", 1), 0, 1 << 20, torch.empty(1 << 20, dtype=torch.float64))
    assert float((values == other).double().mean()) < 1e-3  # another probe index draws other values


def test_a_sketch_taken_in_chunks_is_the_sketch_of_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    x, g = torch.randn(3500), torch.randn(3500)
    monkeypatch.setattr(probes, "PROBE_CHUNK", 1000)
    chunked = sketches(b"seed", 2, [[x]], [g])[0][0]
    for p in range(2):
        whole = probe_values(probe_key(b"seed", p), 0, 3500, torch.empty(3500, dtype=torch.float64))
        assert chunked[p] == pytest.approx(float(torch.dot(whole, x.double())) / PROBE_STD, rel=1e-12)
    assert chunked[2] == pytest.approx(float(torch.dot(g.double(), x.double())), rel=1e-12)


def test_every_shard_reads_its_prefix_of_one_probe_and_threads_change_no_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards of different lengths in one call: each is sketched as it would be alone (the probes' prefix of its
    length), and spreading the chunks over threads gives the very same floats (the chunks' sums are added in chunk
    order)."""
    monkeypatch.setattr(probes, "PROBE_CHUNK", 1000)
    monkeypatch.setattr(probes, "_WORKERS", 3)
    g = torch.Generator().manual_seed(1)
    shards = [[torch.randn(n, generator=g), torch.randn(n, generator=g)] for n in (4500, 4499, 1200, 0)]
    extras = [torch.randn(n, generator=g) if i % 2 else None for i, n in enumerate((4500, 4499, 1200, 0))]
    together = sketches(b"seed", 2, shards, extras)
    assert together == sketches(b"seed", 2, shards, extras, parallel=True)
    for tensors, extra, got in zip(shards, extras, together, strict=True):
        assert got == sketches(b"seed", 2, [tensors], [extra])[0]
        for x, values in zip(tensors, got, strict=True):
            whole = probe_values(probe_key(b"seed", 0), 0, x.numel(), torch.empty(x.numel(), dtype=torch.float64))
            assert values[0] == pytest.approx(float(torch.dot(whole, x.double())) / PROBE_STD, rel=1e-12, abs=1e-9)
            assert len(values) == 2 + (extra is not None)


def test_an_honest_combination_checks_out_at_every_seed() -> None:
    parts = _parts(4, 5000)
    coeffs = [0.1, 0.2, 0.3, 0.4]
    result = aggregate(parts, coeffs)  # what an honest reducer sends: float32 sums, in order
    assert all(_checks(seed, result, parts, coeffs) for seed in SEEDS)


@pytest.mark.parametrize("codec", ["int8", "fp16"])
def test_an_honest_lossy_result_checks_out_even_when_its_rounding_is_one_pattern_repeated(codec: str) -> None:
    """Parts that repeat one short pattern round the same way in every block: the honest error is as structured as
    it gets (one vector repeated), and the check must still allow it."""
    pattern = torch.tensor([0.3, 0.7001, -0.2, 0.1103])
    parts = [pattern.repeat(2048), pattern.flip(0).repeat(2048) * 3]
    coeffs = [0.5, 0.5]
    c = get_codec(codec)
    payload = c.encode(aggregate(parts, coeffs))
    result = c.decode(bytearray(payload), 8192)
    bound = rounding_bound(c, payload, result)
    assert bound > 0 and float((result - aggregate(parts, coeffs)).abs().max()) > 0
    assert all(_checks(seed, result, parts, coeffs, bound) for seed in SEEDS)


def _tampered(result: torch.Tensor, changes: dict[int, float]) -> torch.Tensor:
    out = result.clone()
    for i, delta in changes.items():
        out[i] += delta
    return out


@pytest.mark.parametrize("changes", [{17: 1.0}, {17: 1.0, 4000: -1.0}, {100: 0.5, 101: 0.5, 102: -0.5, 103: -0.5}],
                         ids=["one element", "a pair that cancels", "two pairs that cancel"])
def test_an_error_in_a_few_elements_is_caught_at_every_seed(changes: dict[int, float]) -> None:
    """Errors of about 1% of the shard's norm, in a few elements, arranged to cancel under any probe whose values
    repeat: every one of 200 seeds catches each."""
    parts = _parts(3, 5000)
    coeffs = [0.2, 0.3, 0.5]
    result = aggregate(parts, coeffs)
    bad = _tampered(result, changes)
    assert norm(bad - result) < 0.02 * norm(result)
    assert not any(_checks(seed, bad, parts, coeffs) for seed in SEEDS)


def test_the_control_a_probe_of_random_signs_lets_a_cancelling_pair_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check with ±1 probes (as cheap to draw): a pair of opposite changes escapes whenever the two signs
    agree, about half the seeds per probe."""

    def signs(key: bytes, start: int, count: int, out: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
        return out[:count].copy_(torch.randint(0, 2, (start + count,), generator=g)[start:] * 2 - 1)

    monkeypatch.setattr(probes, "probe_values", signs)
    parts = _parts(3, 5000)
    coeffs = [0.2, 0.3, 0.5]
    result = aggregate(parts, coeffs)
    bad = _tampered(result, {17: 1.0, 4000: -1.0})
    escaped = sum(_checks(seed, bad, parts, coeffs) for seed in SEEDS)
    assert escaped > 20, escaped  # about a quarter of them (both probes' signs agree)


def test_aggregate_into_a_given_tensor_writes_there_what_it_would_return() -> None:
    """A lossless reducer sums its shard straight into the average: the same floats as a fresh sum, and a zero
    vector when every coefficient is zero (the output's old contents never leak into a shard)."""
    parts = _parts(3, 5000)
    coeffs = [0.2, 0.0, 0.5]
    out = torch.full((5000,), 7.0)
    assert aggregate(parts, coeffs, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, aggregate(parts, coeffs))
    assert torch.equal(aggregate(parts, [0.0, 0.0, 0.0], out=out), torch.zeros(5000))
    with pytest.raises(ValueError, match="contiguous fp32"):
        aggregate(parts, coeffs, out=torch.zeros(4999))

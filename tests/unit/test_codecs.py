"""Tensor codecs: round-trip accuracy, exact sizes, and rejection of hostile bytes."""
from __future__ import annotations

import struct

import pytest
import torch

from swarmloco.protocol.base import codecs
from swarmloco.protocol.base.codecs import BLOCK, CODECS, CodecError, get_codec


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("numel", [0, 1, 127, 128, 129, 3 * BLOCK + 1, 1000])
def test_round_trip_and_size(name: str, numel: int) -> None:
    codec = get_codec(name)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 1e-3
    data = codec.encode(x)
    assert len(data) == codec.encoded_size(numel)
    y = codec.decode(data, numel)
    assert y.shape == (numel,) and y.dtype == torch.float32
    if numel:
        rel = float((y - x).norm() / x.norm())
        bound = {"fp32": 0.0, "fp16": 1e-3, "bf16": 1e-2, "int8": 1e-2, "int4": 0.2}[name]
        assert rel <= bound, (name, rel)


def test_lossless_is_bit_exact() -> None:
    x = torch.randn(5000)
    assert torch.equal(get_codec("fp32").decode(get_codec("fp32").encode(x), 5000), x)


@pytest.mark.parametrize("name", list(CODECS))
def test_wrong_length_rejected(name: str) -> None:
    codec = get_codec(name)
    data = codec.encode(torch.randn(300))
    with pytest.raises(CodecError, match="bytes for"):
        codec.decode(data[:-1], 300)
    with pytest.raises(CodecError, match="bytes for"):
        codec.decode(data, 301 + BLOCK)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rejected(bad: float) -> None:
    x = torch.randn(256)
    x[17] = bad
    for name in ("fp32", "fp16", "bf16"):
        with pytest.raises(CodecError, match="NaN or Inf"):
            get_codec(name).decode(get_codec(name).encode(x), 256)
    for name in ("int8", "int4"):
        data = bytearray(get_codec(name).encode(torch.randn(256)))
        data[0:4] = struct.pack("<f", bad)  # poison a block scale
        with pytest.raises(CodecError, match="scale"):
            get_codec(name).decode(bytes(data), 256)


def test_unknown_codec_names_choices() -> None:
    with pytest.raises(ValueError, match="allowed fp32, fp16, bf16, int8, int4"):
        get_codec("zip")


# --- fused decoding, hostile input against a live accumulator, slices, odd sizes, per-block error bounds ---

ODD_SIZES = [0, 1, 127, 128, 129, 3 * BLOCK + 1, 1000]
FLT_MAX = torch.finfo(torch.float32).max


def sample(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-3


@pytest.fixture(params=[False, True], ids=["one-chunk", "many-chunks"])
def chunked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also run with tiny chunks, so that chunk boundaries and the tail block are crossed at small sizes."""
    if request.param:
        monkeypatch.setattr(codecs, "CHUNK_ROWS", 2)


@pytest.mark.usefixtures("chunked")
@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("numel", ODD_SIZES)
@pytest.mark.parametrize("weight", [1.0, 0.25, -3.0])
def test_decode_accumulate_equals_add_of_decode(name: str, numel: int, weight: float) -> None:
    codec = get_codec(name)
    data = codec.encode(sample(numel, numel))
    base = sample(numel, 99)
    out = base.clone()
    codec.decode_accumulate(data, numel, out, weight)
    torch.testing.assert_close(out, base + weight * codec.decode(data, numel), rtol=1e-6, atol=1e-9)
    into = torch.full((numel,), 7.0)
    codec.decode_into(data, numel, into)
    assert torch.equal(into, codec.decode(data, numel))


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_any_buffer_type_decodes(name: str, kind: type) -> None:
    codec = get_codec(name)
    x = sample(300)
    data = kind(bytes(codec.encode(x)))
    ref = codec.decode(bytearray(codec.encode(x)), 300)
    assert torch.equal(codec.decode(data, 300), ref)
    out = torch.zeros(300)
    codec.decode_accumulate(data, 300, out, 2.0)
    torch.testing.assert_close(out, 2.0 * ref)


def test_typed_memoryview_counts_bytes() -> None:
    x = torch.randn(10)
    assert torch.equal(get_codec("fp32").decode(memoryview(x.numpy()), 10), x)  # format "f": len() is 10, not 40


def _hostile(name: str, numel: int) -> list[bytes]:
    """Encodings of `numel` elements broken in the *last* place a decoder looks: validation must see all of it."""
    codec = get_codec(name)
    good = bytes(codec.encode(sample(numel)))
    bad = [good[:-1], good + b"\0"]
    blocks = -(-numel // BLOCK)
    if name in ("fp32", "fp16", "bf16"):
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
        for v in (float("nan"), float("inf"), -float("inf")):
            x = sample(numel).to(dtype)
            x[-1] = v
            bad.append(x.view(torch.uint8).numpy().tobytes())
        return bad
    limit = FLT_MAX / (127 if name == "int8" else 7)
    for v in (float("nan"), float("inf"), -1e-3, -0.0 - 1e-30, limit * 1.0001):
        b = bytearray(good)
        b[4 * (blocks - 1):4 * blocks] = struct.pack("<f", v)  # the last block's scale
        bad.append(bytes(b))
    b = bytearray(good)
    if name == "int8":
        b[-1] = 0x80  # -128
        bad.append(bytes(b))
    else:
        b[-1] = (b[-1] & 0xF0) | 0x00  # low nibble 0
        bad.append(bytes(b))
        b = bytearray(good)
        b[-1] = b[-1] & 0x0F  # high nibble 0
        bad.append(bytes(b))
    return bad


@pytest.mark.usefixtures("chunked")
@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("numel", [1, 129, 1000])
def test_hostile_input_leaves_out_untouched(name: str, numel: int) -> None:
    codec = get_codec(name)
    for data in _hostile(name, numel):
        for fused in (True, False):
            out = sample(numel, 5)
            before = out.clone()
            with pytest.raises(CodecError):
                if fused:
                    codec.decode_accumulate(data, numel, out, 0.5)
                else:
                    codec.decode_into(data, numel, out)
            assert torch.equal(out, before), name
        with pytest.raises(CodecError):
            codec.decode(data, numel)


@pytest.mark.parametrize("name", list(CODECS))
def test_out_must_fit(name: str) -> None:
    codec = get_codec(name)
    data = codec.encode(sample(10))
    for out in (torch.zeros(11), torch.zeros(10, dtype=torch.float64), torch.zeros(20)[::2]):
        with pytest.raises(ValueError, match="out"):
            codec.decode_accumulate(data, 10, out, 1.0)


@pytest.mark.parametrize("name", list(CODECS))
def test_slices_encode_self_contained(name: str) -> None:
    codec = get_codec(name)
    x = sample(5 * BLOCK + 17, 3)
    for lo, hi in [(0, 129), (129, 400), (400, x.numel())]:
        piece = x[lo:hi]
        data = codec.encode(piece)
        assert bytes(data) == bytes(codec.encode(piece.clone()))  # nothing outside the slice leaks in
        assert torch.equal(codec.decode(data, hi - lo), codec.decode(codec.encode(piece.clone()), hi - lo))
    strided = x[::3]
    assert bytes(codec.encode(strided)) == bytes(codec.encode(strided.contiguous()))


@pytest.mark.parametrize("name,levels", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("numel", [1, 127, 129, 4 * BLOCK + 1])
def test_per_block_error_bound(name: str, levels: int, numel: int) -> None:
    codec = get_codec(name)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * torch.logspace(-6, 3, numel)
    y = codec.decode(codec.encode(x), numel)
    for b in range(0, numel, BLOCK):
        xb, yb = x[b:b + BLOCK], y[b:b + BLOCK]
        amax = float(xb.abs().max())
        assert float((yb - xb).abs().max()) <= amax / (2 * levels) * (1 + 1e-5) + 1e-30, (name, b)
        assert float(yb.abs().max()) <= amax * (1 + 1e-6)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_extreme_blocks(name: str) -> None:
    codec = get_codec(name)
    x = torch.zeros(4 * BLOCK)
    x[BLOCK:2 * BLOCK] = 1e-44  # subnormal block: no NaN or Inf may come out
    x[2 * BLOCK] = FLT_MAX
    x[3 * BLOCK] = -FLT_MAX
    y = codec.decode(codec.encode(x), x.numel())
    assert torch.isfinite(y).all() and torch.equal(y[:BLOCK], x[:BLOCK])  # all-zero block stays exactly zero
    assert float(y[2 * BLOCK]) > 0.99 * FLT_MAX and float(y[3 * BLOCK]) < -0.99 * FLT_MAX


def test_int4_wire_layout() -> None:
    """Byte j of a block: element j in the low nibble, element j + BLOCK/2 in the high nibble, both as q + 8."""
    q = torch.arange(BLOCK) % 15 - 7
    body = bytes(((int(q[j]) + 8) | ((int(q[j + BLOCK // 2]) + 8) << 4)) for j in range(BLOCK // 2))
    data = struct.pack("<f", 0.5) + body
    assert torch.equal(get_codec("int4").decode(data, BLOCK), q.float() * 0.5)
    assert bytes(get_codec("int4").encode(q.float() * 0.5)) == data


def test_all_finite_of_an_empty_tensor_is_true_and_any_nan_or_inf_is_caught() -> None:
    assert codecs.all_finite(torch.zeros(0)) and codecs.all_finite(torch.randn(1000))
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(1000)
        x[617] = bad
        assert not codecs.all_finite(x)


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("numel", [0, 1, 1000, 70_000])
def test_decode_with_norm_is_decode_and_its_norm(name: str, numel: int) -> None:
    codec = get_codec(name)
    data = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(numel)))
    decoded, size = codec.decode_with_norm(bytearray(data), numel)
    assert torch.equal(decoded, codec.decode(bytearray(data), numel))
    assert size == codecs.l2_norm(decoded)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("at", [0, 31_337, 69_999])
def test_the_norm_that_checks_finiteness_refuses_what_decode_refuses(bad: float, at: int) -> None:
    """One pass stands for two: a NaN or an infinity anywhere (first, middle, last of a tensor large enough to be
    summed in blocks and threads) must still be refused."""
    x = torch.randn(70_000)
    x[at] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        codecs.finite_norm(x)
    with pytest.raises(CodecError, match="NaN or Inf"):
        get_codec("fp32").decode_with_norm(bytearray(get_codec("fp32").encode(x)), 70_000)


@pytest.mark.parametrize("name", list(CODECS))
def test_finite_values_whose_norm_overflows_are_refused_with_their_norm(name: str) -> None:
    """Values near float32's maximum pass `decode` (they are finite), but their norm is infinite in float32, and an
    infinite norm in a reducer's signed header is what members refuse as proof against the reducer: such a tensor
    is refused where its norm is taken, whatever the codec."""
    x = torch.full((1000,), 3e38)
    data = bytearray(get_codec(name).encode(x)) if name in ("fp32", "int8", "int4") else None
    if data is None:  # fp16/bf16 cannot carry 3e38; the largest they hold squares to well within float32
        return
    assert torch.isfinite(get_codec(name).decode(bytearray(data), 1000)).all()
    with pytest.raises(CodecError, match="overflows"):
        get_codec(name).decode_with_norm(data, 1000)
    with pytest.raises(CodecError, match="overflows"):
        codecs.finite_norm(x)
    assert codecs.finite_norm(torch.zeros(0)) == 0.0

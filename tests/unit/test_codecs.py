"""Tensor codecs: round-trip accuracy, exact sizes, and rejection of hostile bytes."""
from __future__ import annotations

import struct

import pytest
import torch

from protocol.codecs import BLOCK, CODECS, CodecError, get_codec


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("numel", [0, 1, 127, 128, 1000])
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

"""Tensor codecs for pseudo-gradients on the wire: fp32 (lossless), fp16, bf16, int8 and int4 (blockwise absmax).

Every decoder treats its input as hostile: the byte length must equal exactly what `encoded_size` predicts for the
element count the receiver expects, scales must be finite and non-negative, and decoded values must be finite.
A violation raises `CodecError` before anything is accumulated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 128  # elements per quantisation block (int8/int4); one fp32 scale per block


class CodecError(ValueError):
    """Malformed or non-finite encoded tensor."""


@dataclass(frozen=True)
class Codec:
    name: str
    lossless: bool

    def encoded_size(self, numel: int) -> int:
        blocks = -(-numel // BLOCK)
        if self.name == "fp32":
            return 4 * numel
        if self.name in ("fp16", "bf16"):
            return 2 * numel
        if self.name == "int8":
            return 4 * blocks + blocks * BLOCK
        if self.name == "int4":
            return 4 * blocks + blocks * BLOCK // 2
        raise AssertionError(self.name)

    def encode(self, flat: torch.Tensor) -> bytes | memoryview:
        flat = flat.detach().reshape(-1).to("cpu", torch.float32)
        if self.name == "fp32":  # zero-copy view of the tensor's memory (the view keeps the tensor alive)
            return memoryview(flat.contiguous().numpy()).cast("B") if flat.numel() else b""
        if self.name in ("fp16", "bf16"):
            return _as_bytes(flat.to(torch.float16 if self.name == "fp16" else torch.bfloat16))
        levels = 127 if self.name == "int8" else 7
        blocks = _pad_blocks(flat)
        scale = blocks.abs().amax(dim=1) / levels
        q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-levels, levels).to(torch.int8)
        if self.name == "int4":
            u = (q + 8).to(torch.uint8).view(-1, BLOCK // 2, 2)
            q = (u[..., 0] | (u[..., 1] << 4)).to(torch.uint8)
        return _as_bytes(scale) + _as_bytes(q)

    def decode(self, data: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        expected = self.encoded_size(numel)
        if len(data) != expected:
            raise CodecError(f"{self.name}: got {len(data)} bytes for {numel} elements, expected {expected}")
        if numel == 0:
            return torch.zeros(0)
        buf = bytearray(data) if not isinstance(data, bytearray) else data
        if self.name in ("fp32", "fp16", "bf16"):
            dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.name]
            out = torch.frombuffer(buf, dtype=dtype, count=numel).to(torch.float32)
            if not _all_finite(out):
                raise CodecError(f"{self.name}: NaN or Inf in tensor")
            return out
        blocks = -(-numel // BLOCK)
        scale = torch.frombuffer(buf, dtype=torch.float32, count=blocks)
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise CodecError(f"{self.name}: non-finite or negative block scale")
        body = torch.frombuffer(buf, dtype=torch.uint8 if self.name == "int4" else torch.int8, offset=4 * blocks)
        if self.name == "int8":
            if bool((body == -128).any()):
                raise CodecError("int8: value -128 is outside the symmetric range")
            q = body.to(torch.float32).view(blocks, BLOCK)
        else:
            lo, hi = (body & 0x0F).to(torch.int16) - 8, (body >> 4).to(torch.int16) - 8
            if bool((lo < -7).any()) or bool((hi < -7).any()):
                raise CodecError("int4: nibble 0 is outside the symmetric range")
            q = torch.stack((lo, hi), dim=-1).to(torch.float32).view(blocks, BLOCK)
        out = (q * scale[:, None]).reshape(-1)[:numel]
        if not _all_finite(out):
            raise CodecError(f"{self.name}: decoded values overflow")
        return out


def _all_finite(t: torch.Tensor) -> bool:
    """True iff no element is NaN or ±Inf. Fast path: NaN and Inf propagate through a sum, so a finite float32 sum
    proves every element finite; only a non-finite sum (NaN/Inf present, or a mere overflow) pays for the exact
    check."""
    if math.isfinite(float(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _pad_blocks(flat: torch.Tensor) -> torch.Tensor:
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return flat.view(-1, BLOCK)


CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", lossless=True),
    "fp16": Codec("fp16", lossless=False),
    "bf16": Codec("bf16", lossless=False),
    "int8": Codec("int8", lossless=False),
    "int4": Codec("int4", lossless=False),
}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"codec: got {name!r}, allowed {', '.join(CODECS)}") from None

"""Tensor codecs for pseudo-gradients on the wire: fp32 (lossless), fp16, bf16, int8 and int4 (blockwise absmax).

Wire formats (little-endian): fp32/fp16/bf16 are the raw values. int8/int4 are `blocks` fp32 scales followed by the
body, one block per BLOCK elements (the last block zero-padded): int8 stores q in [-127, 127] per element; int4
stores q + 8 in [1, 15] as nibbles, byte j of a block holding element j (low nibble) and element j + BLOCK/2 (high
nibble), so both halves unpack with contiguous, vectorisable ops. Element value = q * scale.

Every decoder treats its input as hostile: the byte length must equal exactly what `encoded_size` predicts for the
element count the receiver expects, scales must be finite, non-negative and small enough that every decoded value
is finite, int8 -128 and int4 nibble 0 are refused (symmetric range), and decoded values must be finite. All of it
is checked before any output is written, so a `CodecError` leaves the caller's tensor untouched.

Speed: quantisation runs in chunks of CHUNK_ROWS blocks (a few MiB, so the passes of one chunk hit cache) with a
handful of in-place torch ops per chunk and no per-block Python; encoders write into one preallocated bytearray.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from swarmloco.protocol.base.buffers import large_empty
from swarmloco.protocol.base.codec_names import CODEC_NAMES, check_codec_name

BLOCK = 128  # elements per quantisation block (int8/int4); one fp32 scale per block
CHUNK_ROWS = 4096  # blocks per processing chunk: 512 Ki elements, 2 MiB of fp32 scratch
_HALF = BLOCK // 2
_FLT_MAX = float(torch.finfo(torch.float32).max)
_LEVELS = {"int8": 127, "int4": 7}
_FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

if sys.byteorder != "little":  # torch.frombuffer reads native order; the wire is little-endian
    raise ImportError("swarmloco.protocol.base.codecs needs a little-endian machine")


class CodecError(ValueError):
    """Malformed or non-finite encoded tensor."""


def _max_scale(levels: int) -> float:
    """Largest fp32 scale s with levels * s <= FLT_MAX exactly: every decoded q * s is then finite."""
    s = torch.tensor(_FLT_MAX / levels, dtype=torch.float32)
    while float(s) * levels > _FLT_MAX:  # float() is exact; the product is exact in float64
        s = torch.nextafter(s, torch.zeros(()))
    return float(s)


_SCALE_MAX = {name: _max_scale(levels) for name, levels in _LEVELS.items()}

Buffer = bytes | bytearray | memoryview


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
            return 4 * blocks + blocks * _HALF
        raise AssertionError(self.name)

    def encode(self, flat: torch.Tensor) -> bytes | bytearray | memoryview:
        """The wire bytes of `flat` (any shape or slice; the result describes only these elements)."""
        flat = flat.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        n = flat.numel()
        if n == 0:
            return b""
        if self.name == "fp32":  # zero-copy view of the tensor's memory (the view keeps the tensor alive)
            return memoryview(flat.numpy()).cast("B")
        out = bytearray(self.encoded_size(n))
        if self.name in ("fp16", "bf16"):
            torch.frombuffer(out, dtype=_FLOATS[self.name]).copy_(flat)
            return out
        _quantise(flat, out, self.name)
        return out

    def decode(self, data: Buffer, numel: int) -> torch.Tensor:
        """An fp32 tensor of `numel` elements for the caller to keep. fp32 is wrapped, not converted: the tensor
        shares memory with `data` when that is writable (a bytearray from the data plane), else with a copy."""
        view = self._checked(data, numel)
        if numel == 0:
            return torch.zeros(0)
        if self.name == "fp32":  # no conversion: wrap the bytes after the check
            t = _wrapped(view, numel)
            if not all_finite(t):
                raise CodecError("fp32: NaN or Inf in tensor")
            return t
        out = large_empty(numel)
        self._apply(view, numel, out, None)
        return out

    def decode_with_norm(self, data: Buffer, numel: int) -> tuple[torch.Tensor, float]:
        """(decode(data, numel), its L2 norm as `l2_norm` gives it), or CodecError where the norm is not finite
        (`finite_norm`); for fp32 the norm doubles as the finiteness check, in one pass over the values."""
        if self.name != "fp32" or numel == 0:
            out = self.decode(data, numel)
            return out, finite_norm(out)
        t = _wrapped(self._checked(data, numel), numel)
        return t, finite_norm(t)

    def decode_into(self, data: Buffer, numel: int, out: torch.Tensor) -> None:
        """out[:] = decode(data, numel), without the intermediate tensor. `out`: contiguous fp32 of `numel`
        elements, untouched when CodecError is raised."""
        _check_out(out, numel)
        view = self._checked(data, numel)
        if numel:
            self._apply(view, numel, out, None)

    def decode_accumulate(self, data: Buffer, numel: int, out: torch.Tensor, weight: float) -> None:
        """out += weight * decode(data, numel), fused. Everything is validated first: `out` is untouched when
        CodecError is raised. `out`: contiguous fp32 of `numel` elements."""
        _check_out(out, numel)
        if not math.isfinite(weight):
            raise ValueError(f"weight: got {weight}, need a finite number")
        view = self._checked(data, numel)
        if numel:
            self._apply(view, numel, out, float(weight))

    def _checked(self, data: Buffer, numel: int) -> memoryview:
        """`data` as a flat byte view of exactly the expected length."""
        try:
            view = memoryview(data)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
        except (TypeError, ValueError) as exc:
            raise CodecError(f"{self.name}: not a contiguous byte buffer ({exc})") from None
        expected = self.encoded_size(numel)
        if view.nbytes != expected:
            raise CodecError(f"{self.name}: got {view.nbytes} bytes for {numel} elements, expected {expected}")
        return view

    def _apply(self, view: memoryview, numel: int, out: torch.Tensor, weight: float | None) -> None:
        """Validate the whole of `view`, then write (weight None) or accumulate its decoded values into `out`."""
        if view.readonly:  # torch.frombuffer wants a writable buffer; one memcpy is cheap next to decoding
            view = memoryview(bytearray(view))
        if self.name in _FLOATS:
            src = torch.frombuffer(view, dtype=_FLOATS[self.name], count=numel)
            if not all_finite(src):
                raise CodecError(f"{self.name}: NaN or Inf in tensor")
            if weight is None:
                out.copy_(src)
            elif self.name == "fp32":
                out.add_(src, alpha=weight)
            else:  # a mixed-dtype add_ is ~5x slower than widening a cache-sized chunk first
                scratch = torch.empty(min(numel, CHUNK_ROWS * BLOCK))
                for i in range(0, numel, scratch.numel()):
                    chunk = src[i:i + scratch.numel()]
                    wide = scratch[: chunk.numel()]
                    out[i:i + chunk.numel()].add_(wide.copy_(chunk), alpha=weight)
            return
        _dequantise(view, numel, out, weight, self.name)


def _wrapped(view: memoryview, numel: int) -> torch.Tensor:
    """The fp32 values of `view` as a tensor sharing its memory (copied once if read-only: torch.frombuffer wants a
    writable buffer), unchecked."""
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.float32, count=numel)


def _check_out(out: torch.Tensor, numel: int) -> None:
    if out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"out: need a contiguous CPU float32 tensor of {numel} elements, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")


def all_finite(t: torch.Tensor) -> bool:
    """True iff no element is NaN or ±Inf (an empty tensor has none: a member's shard can be empty): min and max
    propagate NaN and expose ±Inf, and one fused reduction is as cheap as a sum (and exact, unlike the sum, which
    can overflow)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def l2_norm(t: torch.Tensor) -> float:
    """||t||, in float32 (blocked sums: about 1e-7 relative, 20× faster than widening to float64); NaN or inf when t
    holds one, and inf when the sum of squares overflows float32 (values beyond about 1.8e19)."""
    return float(torch.linalg.vector_norm(t)) if t.numel() else 0.0


def finite_norm(t: torch.Tensor) -> float:
    """l2_norm(t), or CodecError unless it is finite: one pass where a finiteness check and a norm took two. A
    finite norm proves every value finite (NaN and ±Inf reach the sum of squares). Finite values beyond ~1e19 give
    an infinite norm too, and are refused as well: no Δ is that large, and an infinite norm in a reducer's signed
    header would make every member refuse an honest reducer's shard as proof against it."""
    value = l2_norm(t)
    if not math.isfinite(value):
        raise CodecError("NaN or Inf in tensor" if not all_finite(t) else
                         "values so large that the norm overflows float32")
    return value


def _quantise(flat: torch.Tensor, out: bytearray, name: str) -> None:
    """Write the int8/int4 encoding of `flat` (contiguous fp32) into `out` (exactly encoded_size bytes)."""
    n, levels = flat.numel(), _LEVELS[name]
    blocks, full = -(-n // BLOCK), n // BLOCK
    row_bytes = BLOCK if name == "int8" else _HALF
    scales = torch.frombuffer(out, dtype=torch.float32, count=blocks)
    body = torch.frombuffer(out, dtype=torch.int8 if name == "int8" else torch.uint8, offset=4 * blocks)
    body = body.view(blocks, row_bytes)
    rows = flat[: full * BLOCK].view(full, BLOCK)
    scratch = torch.empty(min(full, CHUNK_ROWS) or 1, BLOCK)
    half = torch.empty(scratch.shape[0], _HALF) if name == "int4" else None
    for r0 in range(0, full, CHUNK_ROWS):
        r1 = min(full, r0 + CHUNK_ROWS)
        _quantise_rows(rows[r0:r1], scales[r0:r1], body[r0:r1], levels, scratch, half, name)
    if full < blocks:  # the tail: zero-padded to one whole block
        tail = torch.zeros(1, BLOCK)
        tail[0, : n - full * BLOCK] = flat[full * BLOCK:]
        _quantise_rows(tail, scales[full:], body[full:], levels, scratch, half, name)


def _quantise_rows(x: torch.Tensor, scales: torch.Tensor, body: torch.Tensor, levels: int, scratch: torch.Tensor,
                   half: torch.Tensor | None, name: str) -> None:
    """One chunk: x (rows, BLOCK) fp32 → scales (rows,) and body (rows, row_bytes), both views into the output."""
    k = x.shape[0]
    # amax and amin are single vectorised reductions each; abs().amax() would materialise |x| first (5x slower).
    amax = torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_())
    torch.div(amax, levels, out=scales).clamp_(max=_SCALE_MAX[name])  # NaN input keeps a NaN scale: refused
    # Multiply by the reciprocal; 0/0 and 1/subnormal give NaN/inf factors, made finite so that x * inv stays
    # within [-levels, levels] (|x| <= amax) and an all-zero block encodes as zeros.
    inv = amax.reciprocal().mul_(levels).nan_to_num_(nan=0.0, posinf=_FLT_MAX).unsqueeze_(1)
    y = scratch[:k]
    torch.mul(x, inv, out=y).round_()  # |y| <= levels * (1 + 2^-23) rounds into range: no clamp needed
    if name == "int8":
        body.copy_(y)
        return
    assert half is not None
    packed = torch.add(y[:, :_HALF], y[:, _HALF:], alpha=16, out=half[:k])  # lo + 16 hi, exact small integers
    # Byte (lo + 8) | (hi + 8) << 4 = packed + 136. fp32 → uint8 conversion is scalar code, fp32 → int8 is
    # vectorised (3x faster): store packed + 136 - 128 as int8, then flip the top bit to add 128 back mod 256.
    body.view(torch.int8).copy_(packed.add_(8 + 16 * 8 - 128))
    body.bitwise_xor_(0x80)


def _dequantise(view: memoryview, numel: int, out: torch.Tensor, weight: float | None, name: str) -> None:
    """Validate an int8/int4 encoding, then write (weight None) or accumulate weight * its values into `out`."""
    blocks, full = -(-numel // BLOCK), numel // BLOCK
    scales = torch.frombuffer(view, dtype=torch.float32, count=blocks)
    lo, hi = torch.aminmax(scales)
    if not (float(lo) >= 0 and float(hi) <= _SCALE_MAX[name]):  # also false for NaN
        raise CodecError(f"{name}: non-finite, negative or overflowing block scale")
    if name == "int8":
        body = torch.frombuffer(view, dtype=torch.int8, offset=4 * blocks).view(blocks, BLOCK)
        if int(body.min()) == -128:
            raise CodecError("int8: value -128 is outside the symmetric range")
    else:
        body = torch.frombuffer(view, dtype=torch.uint8, offset=4 * blocks).view(blocks, _HALF)
        _check_nibbles(body)
    # Scales <= SCALE_MAX and |q| <= levels: every decoded value is finite, so nothing below can fail.
    factor = scales if weight is None else scales * weight
    rows = out[: full * BLOCK].view(full, BLOCK)
    scratch = torch.empty(min(full, CHUNK_ROWS) or 1, BLOCK)
    nib = torch.empty(scratch.shape[0], _HALF, dtype=torch.uint8) if name == "int4" else None
    for r0 in range(0, full, CHUNK_ROWS):
        r1 = min(full, r0 + CHUNK_ROWS)
        _dequantise_rows(body[r0:r1], factor[r0:r1], rows[r0:r1], weight is not None, scratch, nib)
    if full < blocks:
        tail = torch.empty(1, BLOCK)
        _dequantise_rows(body[full:], factor[full:], tail, False, scratch, nib)
        rest = out[full * BLOCK:]
        if weight is None:
            rest.copy_(tail[0, : rest.numel()])
        else:
            rest.add_(tail[0, : rest.numel()])


def _check_nibbles(body: torch.Tensor) -> None:
    """Refuse nibble 0 (q = -8) in either half of any byte: a high nibble 0 is a byte < 16."""
    if int(body.min()) < 16:
        raise CodecError("int4: nibble 0 is outside the symmetric range")
    low = torch.empty(min(body.shape[0], CHUNK_ROWS), _HALF, dtype=torch.uint8)
    for r0 in range(0, body.shape[0], CHUNK_ROWS):
        chunk = body[r0:r0 + CHUNK_ROWS]
        if int(torch.bitwise_and(chunk, 0x0F, out=low[: chunk.shape[0]]).min()) == 0:
            raise CodecError("int4: nibble 0 is outside the symmetric range")


def _dequantise_rows(body: torch.Tensor, factor: torch.Tensor, dest: torch.Tensor, accumulate: bool,
                     scratch: torch.Tensor, nib: torch.Tensor | None) -> None:
    """One chunk of validated rows: dest (rows, BLOCK) = or += body * factor per row."""
    k = body.shape[0]
    q = scratch[:k] if accumulate else dest
    if nib is None:
        q.copy_(body)
    else:  # nibbles → signed values in byte arithmetic (cheap), then one widening copy per half
        n = nib[:k]
        torch.bitwise_and(body, 0x0F, out=n).sub_(8)
        q[:, :_HALF].copy_(n.view(torch.int8))
        torch.bitwise_right_shift(body, 4, out=n).sub_(8)
        q[:, _HALF:].copy_(n.view(torch.int8))
    if accumulate:
        dest.addcmul_(q, factor.unsqueeze(1))
    else:
        dest.mul_(factor.unsqueeze(1))


CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", lossless=True),
    "fp16": Codec("fp16", lossless=False),
    "bf16": Codec("bf16", lossless=False),
    "int8": Codec("int8", lossless=False),
    "int4": Codec("int4", lossless=False),
}


assert tuple(CODECS) == CODEC_NAMES, "codec_names.CODEC_NAMES must list this registry"


def get_codec(name: str) -> Codec:
    return CODECS[check_codec_name(name)]

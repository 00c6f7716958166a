"""`bench codecs`: throughput of the pseudo-gradient codecs (protocol/base/codecs.py) on one flat fp32 tensor, against
the pre-vectorisation implementation ("before", kept verbatim below) and against moving the bytes over loopback TCP.

Per codec, in one process and on the same tensor (torch's thread count as the caller has it): encode, decode (into
a fresh tensor), decode_accumulate (into a reused accumulator, as the reducer does), the before-encode and
before-decode, and the relative error. Then `scripts.bench_net.socket_seconds` moves the encoded bytes, and the fp32
bytes, over 127.0.0.1 in separate processes, so the second table can state "encode + send + decode_accumulate"
against "send fp32" as a same-run ratio. Times are medians of --reps after one warm-up.
"""
from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from scripts.bench_common import ratio, table, write_json
from scripts.bench_net import socket_seconds
from swarmloco.protocol.base.codecs import CODECS, get_codec

logger = logging.getLogger(__name__)


# --- "before": the implementation this benchmark replaced (protocol/codecs.py at commit 88f3d87), kept as the
# baseline. Same wire format for every codec except the int4 nibble order, so only its own decode reads its bytes.

def _before_as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def before_encode(name: str, flat: torch.Tensor) -> bytes | memoryview:
    flat = flat.detach().reshape(-1).to("cpu", torch.float32)
    if name == "fp32":
        return memoryview(flat.contiguous().numpy()).cast("B") if flat.numel() else b""
    if name in ("fp16", "bf16"):
        return _before_as_bytes(flat.to(torch.float16 if name == "fp16" else torch.bfloat16))
    levels = 127 if name == "int8" else 7
    pad = (-flat.numel()) % 128
    blocks = (torch.cat((flat, flat.new_zeros(pad))) if pad else flat).view(-1, 128)
    scale = blocks.abs().amax(dim=1) / levels
    q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-levels, levels).to(torch.int8)
    if name == "int4":
        u = (q + 8).to(torch.uint8).view(-1, 64, 2)
        q = (u[..., 0] | (u[..., 1] << 4)).to(torch.uint8)
    return _before_as_bytes(scale) + _before_as_bytes(q)


def _before_all_finite(t: torch.Tensor) -> bool:
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def before_decode(name: str, data: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
    buf = bytearray(data) if not isinstance(data, bytearray) else data
    if name in ("fp32", "fp16", "bf16"):
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
        out = torch.frombuffer(buf, dtype=dtype, count=numel).to(torch.float32)
        if not _before_all_finite(out):
            raise ValueError("non-finite")
        return out
    blocks = -(-numel // 128)
    scale = torch.frombuffer(buf, dtype=torch.float32, count=blocks)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ValueError("bad scale")
    body = torch.frombuffer(buf, dtype=torch.uint8 if name == "int4" else torch.int8, offset=4 * blocks)
    if name == "int8":
        if bool((body == -128).any()):
            raise ValueError("-128")
        q = body.to(torch.float32).view(blocks, 128)
    else:
        lo, hi = (body & 0x0F).to(torch.int16) - 8, (body >> 4).to(torch.int16) - 8
        if bool((lo < -7).any()) or bool((hi < -7).any()):
            raise ValueError("nibble 0")
        q = torch.stack((lo, hi), dim=-1).to(torch.float32).view(blocks, 128)
    out = (q * scale[:, None]).reshape(-1)[:numel]
    if not _before_all_finite(out):
        raise ValueError("overflow")
    return out


# --- measurement ---

def timed(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """Median seconds of `reps` calls after one warm-up, and the last result."""
    result = fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def rel_error(y: torch.Tensor, x: torch.Tensor) -> float:
    return float((y - x).norm() / x.norm()) if x.numel() else 0.0


def measure_codec(name: str, x: torch.Tensor, reps: int, before: bool) -> dict[str, Any]:
    codec, n = get_codec(name), x.numel()
    encode_s, data = timed(lambda: codec.encode(x), reps)
    data = bytearray(data)  # what a receiver holds: the data plane fills a bytearray
    decode_s, y = timed(lambda: codec.decode(data, n), reps)
    acc = torch.zeros(n)
    into_s, _ = timed(lambda: codec.decode_into(data, n, acc), reps)
    acc_s, _ = timed(lambda: codec.decode_accumulate(data, n, acc, 1.0), reps)
    entry: dict[str, Any] = {
        "bytes": len(data),
        "size_ratio": len(data) / (4 * n),
        "encode_s": encode_s,
        "decode_s": decode_s,
        "decode_into_s": into_s,
        "decode_accumulate_s": acc_s,
        "rel_error": rel_error(y, x),
        "before_encode_s": None,
        "before_decode_s": None,
        "before_rel_error": None,
    }
    if before:
        entry["before_encode_s"], old = timed(lambda: before_encode(name, x), reps)
        old = bytearray(old)
        entry["before_decode_s"], y_old = timed(lambda: before_decode(name, old, n), reps)
        entry["before_rel_error"] = rel_error(y_old, x)
    entry["encode_speedup"] = ratio(entry["before_encode_s"], encode_s)
    entry["decode_speedup"] = ratio(entry["before_decode_s"], decode_s)
    return entry


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numel", type=int, default=25_000_000, help="fp32 elements in the tensor (100 MiB by default)")
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS), help="codecs to measure")
    p.add_argument("--reps", type=int, default=5, help="repetitions per measurement (median reported)")
    p.add_argument("--no-before", action="store_true", help="skip the old implementation's baseline")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per socket transfer")


def run(args: argparse.Namespace) -> int:
    numel, reps = (1_000_000, 1) if args.quick else (args.numel, max(1, args.reps))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3  # pseudo-gradient-like scale
    results = {name: measure_codec(name, x, reps, not args.no_before) for name in args.codecs}
    fp32_send = statistics.median(socket_seconds(4 * numel, timeout=args.timeout) for _ in range(reps))
    for name, entry in results.items():
        entry["send_s"] = (
            fp32_send
            if name == "fp32"
            else statistics.median(socket_seconds(entry["bytes"], timeout=args.timeout) for _ in range(reps))
        )
        entry["pipeline_s"] = entry["encode_s"] + entry["send_s"] + entry["decode_accumulate_s"]
        entry["pipeline_vs_fp32_send"] = ratio(entry["pipeline_s"], fp32_send)
        if entry["before_encode_s"] is not None:
            entry["before_pipeline_s"] = entry["before_encode_s"] + entry["send_s"] + entry["before_decode_s"]
            entry["before_pipeline_vs_fp32_send"] = ratio(entry["before_pipeline_s"], fp32_send)
    threads = torch.get_num_threads()
    speed_rows = [
        [name, e["size_ratio"], e["encode_s"], e["decode_s"], e["decode_into_s"], e["decode_accumulate_s"],
         e["before_encode_s"],
         e["before_decode_s"], e["encode_speedup"], e["decode_speedup"], e["rel_error"]]
        for name, e in results.items()
    ]
    print(table(
        f"codecs: {numel:,} fp32 elements ({4 * numel / 2**20:.0f} MiB), seconds",
        ["codec", "size / fp32", "encode s", "decode s", "decode_into s", "decode_acc s", "before encode s",
         "before decode s",
         "encode ×", "decode ×", "rel error"],
        speed_rows,
        [f"median of {reps} after one warm-up; torch threads {threads}",
         "decode = into a fresh tensor, so it pays the kernel's first-touch page faults for 4 bytes per element "
         "(as does before decode); decode_into / decode_acc (out += w·decode, the reducer's path) write a reused "
         "tensor",
         "before = protocol/codecs.py as of 88f3d87 (copy kept in scripts/bench_codecs.py); × = before / now"],
    ))
    pipe_rows = [
        [name, e["bytes"] / 2**20, e["send_s"], e["pipeline_s"], e["pipeline_vs_fp32_send"],
         e.get("before_pipeline_s"), e.get("before_pipeline_vs_fp32_send")]
        for name, e in results.items()
    ]
    print(table(
        "codecs: encode + send over 127.0.0.1 + decode, against sending fp32",
        ["codec", "MiB sent", "send s", "encode+send+decode_acc s", "÷ fp32 send", "before: enc+send+dec s",
         "before ÷ fp32 send"],
        pipe_rows,
        [f"fp32 send = {fp32_send:.3g} s for {4 * numel:,} bytes: scripts.bench_net.socket_seconds, one TCP "
         f"connection between two processes, median of {reps}",
         "a ratio below 1 means the codec pays for itself even on loopback",
         "before has no fused path: its decode returns a fresh tensor that a reducer still has to add (not timed)"],
    ))
    write_json(args.json, {"benchmark": "codecs", "quick": bool(args.quick), "numel": numel, "reps": reps,
                           "threads": threads, "fp32_send_s": fp32_send, "results": results})
    return 0

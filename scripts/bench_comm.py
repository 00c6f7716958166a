"""`bench comm`: bytes each peer sends per trained token — data-parallel vs DiLoCo with each pseudo-gradient codec.

Analytic model (same model, same per-peer batch b of T-token sequences, M peers):
- data-parallel, ring all-reduce of fp32 gradients every step: each peer sends 2·(M−1)/M · 4·P bytes per step and
  trains b·T tokens per step, so bytes/token = 2·(M−1)/M · 4·P / (b·T).
- DiLoCo, star (leader-reduce) topology, once per round of H inner steps: a member sends its encoded Δ to the leader
  and receives the encoded average back; the leader receives and sends M−1 of them. Mean bytes sent per peer per
  round = 2·(M−1)/M · bytes_c(P); tokens per peer per round = H·b·T. So DP / DiLoCo = 4·P·H / bytes_c(P).
- bytes_c per tensor of n elements: fp32 4n, fp16 2n, int8 n + 2·⌈n/64⌉, int4 ⌈n/2⌉ + 2·⌈n/64⌉ (blockwise absmax,
  one fp16 scale per 64-element block), summed over the model's parameter tensors; headers are ignored.
The measured column calls `bench_hooks.measured_round_bytes(codec, peers)` (bytes counted where our
averaging writes to the wire) and scales its per-parameter cost to this model.
"""
from __future__ import annotations

import argparse
import logging
import math
from typing import Any

from scripts.bench_common import NOT_AVAILABLE, ratio, run_hook, table, write_json

logger = logging.getLogger(__name__)

CODECS = ("fp32", "fp16", "int8", "int4")
BLOCK = 64


def codec_bytes(codec: str, n: int) -> int:
    """Encoded payload size of one tensor of n elements."""
    scales = 2 * math.ceil(n / BLOCK)
    sizes = {"fp32": 4 * n, "fp16": 2 * n, "int8": n + scales, "int4": math.ceil(n / 2) + scales}
    if codec not in sizes:
        raise ValueError(f"codec: got {codec!r}, allowed {', '.join(sizes)}")
    return sizes[codec]


def model_shapes(preset: str) -> tuple[list[int], int, int]:
    """(numel of every parameter tensor, context, default batch) for a preset of the default task."""
    import torch

    from swarmloco.peer.model import GPT, PRESETS
    from swarmloco.peer.task import DEFAULT_BATCH

    cfg = PRESETS[preset]
    with torch.device("meta"):
        model = GPT(cfg)
    return [p.numel() for p in model.parameters()], cfg.context, DEFAULT_BATCH[preset]


def dp_bytes_per_token(params: int, peers: int, tokens_per_step: int) -> float:
    return 2 * (peers - 1) / peers * 4 * params / tokens_per_step


def diloco_bytes_per_token(encoded: int, peers: int, inner_steps: int, tokens_per_step: int) -> float:
    return 2 * (peers - 1) / peers * encoded / (inner_steps * tokens_per_step)


def measured(codec: str, peers: int, timeout: float) -> tuple[dict[str, Any] | None, str]:
    value, why = run_hook("measured_round_bytes", codec, peers, timeout=timeout)
    if value is None:
        return None, why
    out = dict(value)
    if not out.get("params") or out.get("sent_bytes") is None:
        return None, f"hook returned {out} (needs params and sent_bytes)"
    return out, ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", nargs="+", default=["tiny", "base"], help="model presets to compute for")
    p.add_argument("--peers", type=int, default=4, help="M: peers in the data-parallel ring and in a DiLoCo round")
    p.add_argument(
        "--inner-steps", type=int, nargs="+", default=[50, 100, 250, 500], help="H values (inner steps per round)"
    )
    p.add_argument("--batch", type=int, default=0, help="sequences per peer step (0 = the task's default per preset)")
    p.add_argument("--codecs", nargs="+", default=list(CODECS), help="codecs to report")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per measured round")


def run(args: argparse.Namespace) -> int:
    presets, hs = (["tiny"], [100]) if args.quick else (args.preset, sorted(args.inner_steps))
    m = args.peers
    if m < 2:
        raise SystemExit("comm: --peers must be >= 2")
    # --quick measures one codec only (each measured round starts real peers)
    measured_by_codec = {
        c: measured(c, m, args.timeout) if not args.quick or c == "fp32" else (None, "") for c in args.codecs
    }
    results: dict[str, Any] = {}
    rows, notes = [], []
    for preset in presets:
        shapes, context, default_batch = model_shapes(preset)
        params, batch = sum(shapes), args.batch or default_batch
        tps = batch * context
        dp = dp_bytes_per_token(params, m, tps)
        entry: dict[str, Any] = {
            "params": params,
            "batch": batch,
            "context": context,
            "peers": m,
            "dp_bytes_per_token": dp,
            "codecs": {},
        }
        rows.append(
            [preset, "data-parallel (every step)", 4.0, 2 * (m - 1) / m * 4 * params / 1e6, dp]
            + [1.0] * len(hs)
            + ["—", "—"]
        )
        for codec in args.codecs:
            enc = sum(codec_bytes(codec, n) for n in shapes)
            sent = 2 * (m - 1) / m * enc
            per_h = {h: diloco_bytes_per_token(enc, m, h, tps) for h in hs}
            meas, why = measured_by_codec[codec]
            meas_per_param = meas_vs = None
            if meas is not None:
                # wire bytes per parameter per encoded copy, comparable with the analytic bytes/param column
                meas_per_param = float(meas["sent_bytes"]) / float(meas["params"]) / (2 * (m - 1) / m)
                analytic_small = 2 * (m - 1) / m * codec_bytes(codec, int(meas["params"]))
                meas_vs = ratio(float(meas["sent_bytes"]), analytic_small)
            elif why:
                notes.append(f"measured: {why}" if why == NOT_AVAILABLE else f"measured ({codec}): {why}")
            entry["codecs"][codec] = {
                "encoded_bytes": enc,
                "bytes_per_param": enc / params,
                "sent_per_peer_per_round": sent,
                "bytes_per_token": {str(h): v for h, v in per_h.items()},
                "dp_over_diloco": {str(h): ratio(dp, v) for h, v in per_h.items()},
                "measured": meas,
                "measured_bytes_per_param": meas_per_param,
                "measured_over_analytic": meas_vs,
                "measured_note": why or None,
            }
            rows.append(
                [preset, f"DiLoCo {codec} (every H steps)", enc / params, sent / 1e6, per_h[hs[len(hs) // 2]]]
                + [ratio(dp, per_h[h]) for h in hs]
                + [meas_per_param, f"{meas_vs:.4f}" if meas_vs else None]
            )
        results[preset] = entry
    mid = hs[len(hs) // 2]
    notes = list(dict.fromkeys(notes)) + [
        (
            f"M = {m} peers; per-peer batch = task default (tiny 16, small 16, base 8 sequences) unless --batch; "
            "data-parallel = ring all-reduce of fp32 gradients each step"
        ),
        "DiLoCo = star/leader-reduce: member sends encoded Δ, receives encoded average; mean over peers incl. leader",
        "int8/int4 = blockwise absmax, one fp16 scale per 64 elements; payload only (no headers)",
        "DP÷DiLoCo = data-parallel bytes per token / DiLoCo bytes per token (goal: >= 1000)",
        (
            "measured = bench_hooks.measured_round_bytes: wire bytes sent per peer per round / (2·(M−1)/M · params), "
            "i.e. bytes per parameter per encoded copy incl. headers; measured/analytic = wire / payload-only model"
        ),
    ]
    headers = (
        ["preset", "scheme", "bytes/param", "sent/peer/round MB", f"bytes/token (H={mid})"]
        + [f"DP÷DiLoCo H={h}" for h in hs]
        + ["measured bytes/param", "measured/analytic"]
    )
    print(table(f"comm: bytes sent per peer per trained token (analytic; M={m})", headers, rows, notes))
    write_json(
        args.json,
        {
            "benchmark": "comm",
            "quick": bool(args.quick),
            "topology": "star (leader-reduce)",
            "inner_steps": hs,
            "results": results,
        },
    )
    return 0

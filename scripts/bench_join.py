"""`bench join`: a late joiner fetching the verified global state (θ + outer momentum, fp32) of a preset model from
1 and from 3 donors, against the time to move the same bytes over plain TCP on loopback (one sender per donor).

The baseline is measured now (`scripts.bench_net.socket_seconds`: sender and receiver processes, timed from "all
connected, go" until the receiver holds every byte), twice: into a small reused buffer, and into one fresh buffer
of the state's size, which a joiner cannot avoid (its pages are mapped on first touch). Ours calls
`bench_hooks.join_seconds(preset, donors)` lazily: seconds from the joiner's first state request to holding a
hash-verified state; null when missing.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any

from scripts.bench_common import (
    NOT_AVAILABLE,
    median,
    ratio,
    run_hook,
    table,
    write_json,
)
from scripts.bench_net import socket_seconds

logger = logging.getLogger(__name__)


def state_bytes(preset: str) -> tuple[int, int]:
    """(parameters, bytes of fp32 θ + fp32 outer momentum) for a preset of the default task."""
    from scripts.bench_comm import model_shapes

    params = sum(model_shapes(preset)[0])
    return params, 2 * 4 * params


def ours_join(preset: str, donors: int, reps: int, timeout: float) -> tuple[list[float] | None, str]:
    times = []
    for _ in range(reps):
        value, why = run_hook("join_seconds", preset, donors, timeout=timeout)
        if value is None:
            return None, why
        times.append(float(value))
    return (times, "") if all(t > 0 for t in times) else (None, f"hook returned invalid times {times}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="base", help="model preset whose θ + momentum the joiner fetches")
    p.add_argument("--donors", type=int, nargs="+", default=[1, 3], help="donor counts to try")
    p.add_argument("--reps", type=int, default=3, help="repetitions per measurement (median reported)")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per socket transfer and per join")


def run(args: argparse.Namespace) -> int:
    preset, donor_counts, reps = ("tiny", [1, 3], 1) if args.quick else (args.preset, args.donors, max(1, args.reps))
    params, nbytes = state_bytes(preset)
    rows, notes, results = [], [], {}
    for donors in donor_counts:
        sock = [socket_seconds(nbytes, streams=donors, timeout=args.timeout) for _ in range(reps)]
        fresh = [socket_seconds(nbytes, streams=donors, timeout=args.timeout, keep=True) for _ in range(reps)]
        ours, why = (
            (None, "skipped in --quick") if args.quick and donors > 1 else ours_join(preset, donors, reps, args.timeout)
        )
        if why:
            notes.append(f"ours ({donors} donors): {why}")
        sock_s = float(median(sock) or 0.0)
        entry: dict[str, Any] = {
            "donors": donors,
            "bytes": nbytes,
            "socket_s": sock_s,
            "socket_all_s": sock,
            "socket_mib_s": nbytes / sock_s / 2**20,
            "socket_fresh_s": median(fresh),
            "socket_fresh_all_s": fresh,
            "ours_s": median(ours),
            "ours_note": why or None,
        }
        entry["ours_vs_socket"] = ratio(entry["ours_s"], entry["socket_s"])
        entry["ours_vs_fresh_socket"] = ratio(entry["ours_s"], entry["socket_fresh_s"])
        results[str(donors)] = entry
        rows.append(
            [
                donors,
                nbytes / 2**20,
                entry["socket_s"],
                entry["socket_mib_s"],
                "not available" if why == NOT_AVAILABLE else entry["ours_s"],
                entry["ours_vs_socket"],
                entry["socket_fresh_s"],
                entry["ours_vs_fresh_socket"],
            ]
        )
    if any(n.endswith(NOT_AVAILABLE) for n in notes):
        print(f"ours: {NOT_AVAILABLE}")
    notes = list(dict.fromkeys(notes)) + [
        f"preset {preset}: {params:,} parameters; state = fp32 θ + fp32 outer momentum = {nbytes:,} bytes",
        "plain socket: one TCP connection per donor on 127.0.0.1, each sending 1/donors of the bytes; "
        f"median of {reps}",
        "fresh socket: the same, landing the bytes in one newly allocated buffer of the state's size (a joiner keeps "
        "what it receives) instead of reusing a small one; it verifies nothing",
        "ours = bench_hooks.join_seconds: first request → hash-verified state held by the joiner",
    ]
    print(
        table(
            "join: fetching the global state, seconds",
            ["donors", "MiB", "plain socket s", "socket MiB/s", "ours s", "ours/socket", "fresh socket s",
             "ours/fresh socket"],
            rows,
            notes,
        )
    )
    write_json(
        args.json,
        {"benchmark": "join", "quick": bool(args.quick), "preset": preset, "params": params, "results": results},
    )
    return 0

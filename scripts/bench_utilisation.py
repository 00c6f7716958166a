"""`bench utilisation`: share of wall time heterogeneous peers (slowed 1×, 1×, 2×, 4×) spend computing vs waiting,
for our asynchronous quorum rounds and for a synchronous wait-for-everyone mode run the same way; on loopback and
with every peer in its own network namespace behind a link shaped to 100 Mbit/s.

The swarm runs come from the hooks module's `utilisation(slowdowns, mode, shaped, netns=None)` (scripts.bench_hooks,
called in a child process with a timeout). `netns` lists (namespace, address) per peer, created here by
`scripts.bench_net.shaped_star`. A self-check first measures a TCP transfer through one shaped link (~100 Mbit/s).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any

from scripts.bench_common import (
    NOT_AVAILABLE,
    run_hook,
    table,
    write_json,
)
from scripts.bench_net import NetnsUnavailable, shaped_link_check, shaped_star

logger = logging.getLogger(__name__)

MODES = ("async", "sync")


def call_hook(
    slowdowns: list[float], mode: str, shaped: bool, timeout: float, *, rounds: int | None = None
) -> tuple[dict[str, Any] | None, str]:
    try:
        with contextlib.ExitStack() as stack:
            optional: dict[str, Any] = {} if rounds is None else {"rounds": rounds}
            if shaped:
                namespaces = stack.enter_context(shaped_star(len(slowdowns)))
                optional["netns"] = [(ns.name, ns.address) for ns in namespaces]
            value, why = run_hook("utilisation", list(slowdowns), mode, shaped, timeout=timeout, optional=optional)
    except NetnsUnavailable as exc:
        return None, f"skipped: {exc}"
    return (dict(value), "") if value is not None else (None, why)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slowdowns", type=float, nargs="+", default=[1, 1, 2, 4], help="per-peer slowdown factors")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="round modes to compare")
    p.add_argument("--no-shaped", action="store_true", help="skip the namespace runs with 100 Mbit/s links")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per swarm run")
    p.add_argument("--check-mb", type=float, default=25, help="MiB sent through the shaped link by the self-check")


def run(args: argparse.Namespace) -> int:
    slowdowns, check_mb = ([1.0, 2.0], 2.0) if args.quick else (list(args.slowdowns), args.check_mb)
    check: dict[str, Any] | None = None
    check_note = ""
    if not args.no_shaped:
        try:
            check = shaped_link_check(int(check_mb * 2**20))
        except NetnsUnavailable as exc:
            check_note = f"shaped-link self-check skipped: {exc}"
    if check:
        print(
            table(
                "utilisation: shaped-link self-check",
                ["tc rate", "MiB", "seconds", "measured Mbit/s"],
                [[check["rate"], check_mb, check["seconds"], check["mbit_s"]]],
                ["one TCP stream between two of our namespaces over veth+bridge, tbf on both ends of each veth"],
            )
        )
    elif check_note:
        print(check_note)
    rows, notes, runs = [], [check_note] if check_note else [], []
    # --quick: one short loopback run (the shaped links are exercised by the self-check above)
    shaped_modes = [False] if args.quick or args.no_shaped or check is None else [False, True]
    for shaped in shaped_modes:
        for mode in ["async"] if args.quick else args.modes:
            out, why = call_hook(slowdowns, mode, shaped, args.timeout, rounds=1 if args.quick else None)
            runs.append({"mode": mode, "shaped": shaped, "result": out, "note": why or None})
            logger.info("utilisation %s shaped=%s: %s", mode, shaped, out if out is not None else why)
            if out is None:
                notes.append(f"{mode}, {'100 Mbit/s' if shaped else 'loopback'}: {why}")
                rows.append(
                    [mode, shaped, "—", "not available" if why == NOT_AVAILABLE else "failed", "—", "—", "—", "—"]
                )
                continue
            for slow, peer in zip(slowdowns, out.get("peers", []), strict=False):
                wall = float(peer["wall_s"]) or float("nan")
                rows.append(
                    [
                        mode,
                        shaped,
                        slow,
                        float(peer["compute_s"]) / wall,
                        float(peer["wait_s"]) / wall,
                        wall,
                        peer.get("rounds_committed"),
                        peer.get("tokens"),
                    ]
                )
    if any(n.endswith(NOT_AVAILABLE) for n in notes):
        print(f"ours: {NOT_AVAILABLE}")
    notes += [
        "compute share = compute_s / wall_s per peer; wait = time blocked on rounds "
        "(goal: >= 97% compute for every peer)"
    ]
    print(
        table(
            f"utilisation: peers slowed {', '.join(f'{s:g}x' for s in slowdowns)}",
            [
                "mode",
                "shaped 100 Mbit/s",
                "slowdown",
                "compute share",
                "wait share",
                "wall s",
                "rounds committed",
                "tokens",
            ],
            rows,
            notes,
        )
    )
    write_json(
        args.json,
        {
            "benchmark": "utilisation",
            "quick": bool(args.quick),
            "slowdowns": slowdowns,
            "shaped_link_check": check,
            "shaped_link_note": check_note or None,
            "runs": runs,
        },
    )
    return 0

"""`bench cli`: how long the `swarmloco` console script takes to answer what needs no training: --help, a command's
--help and a mistyped flag. Each is timed as a fresh process, as a user runs it (the interpreter's start included),
next to what every call paid before torch and hivemind were imported lazily: importing both.

Nothing is cached between calls: every parser is built from modules that import neither torch nor hivemind (the
peer's flags from its config dataclasses), so each time here is what a first call after an install or an edit costs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bench_common import median, table, write_json

TARGET_S = 0.5  # the bar for `swarmloco --help` and `swarmloco peer --help` on the 2-core CI machine
TARGETS = ("swarmloco --help", "swarmloco peer --help")  # the calls the exit status answers for
CALLS: tuple[tuple[str, ...], ...] = (
    ("--help",),
    ("peer", "--help"),
    ("peer", "--rounds", "3"),  # an argument error: usage and the closest flag
    ("swarm", "--help"),
    ("coordinator", "--help"),
    ("status", "--help"),
    ("ticket", "--help"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=5, help="runs per call (median reported)")


def _script() -> str:
    path = Path(sys.executable).parent / "swarmloco"
    if not path.exists():
        raise SystemExit(f"{path} is missing: install the project first (make install)")
    return str(path)


def _time(argv: list[str], env: dict[str, str], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=False)
        times.append(time.perf_counter() - started)
    return times


def run(args: argparse.Namespace) -> int:
    reps = 1 if args.quick else max(1, args.reps)
    script, env = _script(), dict(os.environ, OMP_NUM_THREADS="1")
    results: dict[str, Any] = {}
    for call in CALLS:
        results["swarmloco " + " ".join(call)] = median(_time([script, *call], env, reps))
    results["before: import torch, hivemind"] = median(
        _time([sys.executable, "-c", "import torch, hivemind"], env, reps))
    rows = [[name, f"{seconds:.2f}", "yes" if seconds < TARGET_S else "no"] for name, seconds in results.items()]
    print(table(f"swarmloco answers without training (median of {reps}, fresh process each, nothing cached)",
                ["call", "seconds", f"< {TARGET_S} s"], rows,
                notes=["`before` is what every call paid when the console script imported torch and hivemind "
                       "first (3.5-8 s on this 2-core machine under load)",
                       f"the exit status is 1 when {' or '.join(TARGETS)} misses the target"]))
    write_json(args.json, {"bench": "cli", "reps": reps, "target_s": TARGET_S, "seconds": results})
    return 0 if all(results[name] < TARGET_S for name in TARGETS) else 1

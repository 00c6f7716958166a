"""Shared helpers for the benchmark scripts: tables, JSON output, statistics, lazy hooks and child cleanup.

Benchmarks print tables of *ratios* measured side by side in one run (this machine is shared and noisy, so only
same-run ratios mean something), and write the same numbers as JSON. Every multi-process benchmark cleans up the
processes it started, by pid.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import signal
import statistics
import subprocess
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from swarmloco.proc_memory import descendants  # the launcher's /proc walker, for the benchmarks too

logger = logging.getLogger(__name__)

# Our side of the benchmarks, imported lazily (in the child process that runs a measurement).
HOOKS_MODULE = "scripts.bench_hooks"
NOT_AVAILABLE = f"not available ({HOOKS_MODULE} lacks it)"


def load_hook(name: str) -> tuple[Callable[..., Any] | None, str]:
    """The named function of the hooks module; (None, reason) when there is no such function."""
    fn = getattr(importlib.import_module(HOOKS_MODULE), name, None)
    if not callable(fn):
        return None, NOT_AVAILABLE
    return fn, ""


def _hook_child(name: str, args: tuple[Any, ...], optional: dict[str, Any], out: Any) -> None:
    """Runs in a child process: import the hook, call it, send back ("ok", value) or (status, message)."""
    import inspect

    fn, why = load_hook(name)
    if fn is None:
        out.put(("missing", why))
        return
    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in optional.items() if k in params}
    try:
        out.put(("ok", fn(*args, **kwargs)))
    except Exception as exc:
        logger.exception("bench hook %s failed", name)
        out.put(("error", f"failed: {exc!r}"))


def run_hook(name: str, *args: Any, timeout: float, optional: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Call the hooks module's <name>(*args) in a child process with a timeout; (value, "") or (None, reason).

    `optional` keyword arguments are passed only if the hook's signature accepts them. The child and everything it
    started are killed by pid when the call returns or times out.
    """
    import queue

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_hook_child, args=(name, args, optional or {}, out), daemon=False)
    try:
        proc.start()
        try:
            status, value = out.get(timeout=timeout)
        except queue.Empty:
            return None, f"timed out after {timeout:.0f} s"
    finally:
        kill_processes([proc])
    if status == "ok":
        return value, ""
    return None, value


def median(values: Sequence[float] | None) -> float | None:
    return statistics.median(values) if values else None


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def fmt(value: Any, digits: int = 3) -> str:
    """Table cell: numbers to `digits` significant digits, None as a dash."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:,.0f}"
    return str(value)


def table(title: str, headers: Sequence[str], rows: Iterable[Sequence[Any]], notes: Sequence[str] = ()) -> str:
    """A GitHub-markdown table with a title line and notes, ready for stdout and docs/benchmarks.md."""
    cells = [[fmt(c) for c in row] for row in rows]
    lines = [f"### {title}", "", "| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import hivemind
    import torch

    hv = hivemind.__version__
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "torch": torch.__version__,
        "hivemind": hv,
        "python": platform.python_version(),
    }


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2, default=_json_default) + "\n")
    logger.info("wrote %s", out)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_processes(procs: Sequence[mp.process.BaseProcess | subprocess.Popen[Any]], *, grace: float = 5.0) -> None:
    """Terminate then kill each process we started, and its own children (p2pd daemons), by pid."""
    for proc in procs:
        pid = proc.pid
        if pid is None:
            continue
        for child in descendants(pid):
            _signal(child, signal.SIGKILL)
        alive = proc.is_alive() if isinstance(proc, mp.process.BaseProcess) else proc.poll() is None
        if alive:
            _signal(pid, signal.SIGTERM)
    for proc in procs:
        if isinstance(proc, mp.process.BaseProcess):
            proc.join(grace)
            if proc.is_alive():
                proc.kill()
                proc.join(grace)
        elif proc.poll() is None:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(grace)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

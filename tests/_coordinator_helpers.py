"""Shared helpers for the coordinator tests: identities, sample report bodies, in-thread and subprocess servers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from swarmloco.coordinator.authority import AuthorityConfig
from swarmloco.coordinator.server import CoordinatorConfig, CoordinatorServer
from swarmloco.coordinator.service import ServiceConfig
from swarmloco.proc_memory import descendants  # noqa: F401  (re-exported: one /proc walker for all tests)
from swarmloco.protocol.trust.identity import Identity, load_or_create_identity

ROOT = Path(__file__).resolve().parents[1]
# Open runs in tests ask for 2**8 hashes per new identity (about a millisecond), not the default's CPU-minute.
TEST_WORK_BITS = 8


def open_authority(**kw: Any) -> AuthorityConfig:
    """The default authority (open admission), with the tests' tiny proof of work unless ``work_bits`` is given."""
    return AuthorityConfig(**{"work_bits": TEST_WORK_BITS, **kw})


def make_identities(directory: Path, n: int) -> list[Identity]:
    directory.mkdir(parents=True, exist_ok=True)
    return [load_or_create_identity(directory / f"peer{i}.key") for i in range(n)]


def hello_body(device: str = "cpu", tokens_per_s: float = 1234.5) -> dict[str, Any]:
    return {"version": "0.1.0", "device": device, "memory_bytes": 8 * 2**30, "tokens_per_s": tokens_per_s}


def metrics_body(step: int, loss: float = 3.0, tokens_total: int | None = None) -> dict[str, Any]:
    return {"step": step, "train_loss": loss, "tokens_per_s": 900.0,
            "tokens_total": tokens_total if tokens_total is not None else step * 256}


def round_body(rnd: int, members: list[str], *, outcome: str = "committed", eval_loss: float | None = 2.5,
               failure_reason: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "round": rnd, "members": members, "tokens": [1000 + i for i in range(len(members))],
        "state_hash": f"{rnd:08x}" * 8 if outcome == "committed" else None, "train_s": 4.0, "wait_s": 0.5,
        "average_s": 0.25, "outcome": outcome, "failure_reason": failure_reason,
    }
    if eval_loss is not None:
        body["eval_loss"] = eval_loss
    return body


def start_server(db: Path, **service_kw: Any) -> CoordinatorServer:
    """An in-thread coordinator on 127.0.0.1, port 0, without DHT (open admission with TEST_WORK_BITS unless
    ``authority`` is given)."""
    service_kw.setdefault("authority", open_authority())
    config = CoordinatorConfig(db=db, host="127.0.0.1", port=service_kw.pop("port", 0), dht=False,
                               service=ServiceConfig(**service_kw))
    return CoordinatorServer(config).start(timeout=20)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def spawn_coordinator(db: Path, ready: Path, *extra: str, port: int = 0,
                      timeout: float = 60.0) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start ``python -m swarmloco.coordinator`` and wait for its ready file; returns the process and its JSON.
    Without ``--admission`` in ``extra`` its run is invite-only (the default) and ``info["invite"]`` its code."""
    ready.unlink(missing_ok=True)
    with open(ready.with_suffix(".log"), "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "swarmloco.coordinator", "--db", str(db), "--port", str(port),
                                 "--ready-file", str(ready), "--log-level", "WARNING", *extra],
                                cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill(proc)
            raise RuntimeError(f"coordinator did not start: {ready.with_suffix('.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
    """Signal one process we started (by pid) and reap it."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_sessions(procs: list[subprocess.Popen[bytes]], baseline: set[int], *, grace_s: float = 30.0) -> None:
    """End processes we started, each in a session of its own (SIGTERM, then SIGKILL to the session), and assert
    that nothing started since `baseline` (our descendants then) is left: p2pd daemons included."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    deadline = time.monotonic() + 20
    while (left := [c for c in descendants(os.getpid()) if c not in baseline and alive(c)]) and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes left running: {left}"


def run_config(*, inner_steps: int, seed: int) -> str:
    """A small run's --run-config: the tiny preset, quorum 2, short timeouts."""
    return (f'[run]\npreset = "tiny"\n[train]\ninner_lr = 1e-3\nwarmup_steps = 5\ninner_steps = {inner_steps}\n'
            f"[round]\nquorum = 2\ngrace_max_s = 3\nround_timeout_s = 60\n[runtime]\nseed = {seed}\n")


@contextlib.contextmanager
def run_coordinator(root: Path, run_config: str, *extra: str) -> Iterator[dict[str, Any]]:
    """`swarmloco coordinator` with a DHT node, run id "joined", the run config given and invite code "let-me-in";
    yields its ready file's content with "procs" (the processes to end: add the peers you start) and "dir"."""
    (root / "run.toml").write_text(run_config)
    ready = root / "ready.json"
    baseline = set(descendants(os.getpid()))
    with open(root / "coordinator.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarmloco.cli", "coordinator", "--db", str(root / "c.sqlite"), "--port", "0",
             "--dht-host", "127.0.0.1", "--ready-file", str(ready), "--run-id", "joined", "--run-config",
             str(root / "run.toml"), "--invite-code", "let-me-in", *extra],
            cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    procs = [proc]
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (root / "coordinator.log").read_text()
            time.sleep(0.1)
        yield {**json.loads(ready.read_text()), "procs": procs, "dir": root}
    finally:
        stop_sessions(procs, baseline)


def join_peer(url: str, root: Path, i: int, n: int, *extra: str, invite: str = "let-me-in", host: str = "127.0.0.1",
              netns: str | None = None) -> subprocess.Popen[bytes]:
    """`swarmloco peer --join URL` as peer i of n, in root/peer-i (log: root/peer-i.log, JSON events), listening
    on `host`; `netns`: inside that network namespace (root only)."""
    workdir = root / f"peer-{i}"
    prefix = ["ip", "netns", "exec", netns] if netns else []
    with open(root / f"peer-{i}.log", "ab") as log:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "swarmloco.cli", "peer", "--join", url, "--invite", invite,
             "--workdir", str(workdir), "--batch-size", "4", "--threads", "1", "--host-maddr", f"/ip4/{host}/tcp/0",
             "--log-format", "json", "--eval-every", "1", "--checkpoint-every", "0", "--wait-for-peers", str(n),
             "--summary-json", str(workdir / "summary.json"), "--shard-index", str(i), "--num-shards", str(n),
             *extra],
            cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

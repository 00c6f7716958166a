"""The processes of a local swarm: peer processes (exec'd, or forked by the zygote), the coordinator, cleanup, and
the per-round records merged from the peers' JSON logs."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from swarmloco.protocol.base.outcome import Outcome

PR_SET_CHILD_SUBREAPER = 36


class Spawner(Protocol):
    def spawn(self, argv: list[str], stdout: str, stderr: str, *, env: dict[str, str] | None = None) -> Any: ...


class Handle(Protocol):
    """What the launcher needs of a started peer: `subprocess.Popen`, or the zygote's `ForkedPeer`."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class PeerProc:
    index: int
    workdir: Path
    argv: list[str]
    proc: Handle | None = None
    log_offset: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    spawner: Spawner | None = None  # None: exec a fresh interpreter (Popen)
    last_step: dict[str, Any] = field(default_factory=dict)  # the newest "step" event: progress, never kept

    @property
    def log(self) -> Path:
        return self.workdir / "log.jsonl"

    def start(self, env: dict[str, str], *, resume: bool) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.proc is None and self.log.exists():
            # An earlier launch's lines are not this run's events: read only what this run appends. (A restarted
            # peer keeps the offset, so the lines its killed predecessor wrote last are still read.)
            self.log_offset = self.log.stat().st_size
        argv = self.argv + (["--resume"] if resume else [])
        if self.spawner is not None:
            self.proc = self.spawner.spawn(argv, str(self.log), str(self.workdir / "stderr.log"), env=env)
            return
        with open(self.log, "ab") as out, open(self.workdir / "stderr.log", "ab") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the peer's whole session (the peer, its DHT process and p2pd), which we started."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def read_events(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        if not self.log.exists():
            return new
        with open(self.log, "rb") as f:
            f.seek(self.log_offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.log_offset += len(complete)
        for line in complete.splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(event, dict):
                continue
            if event.get("event") == "step":
                self.last_step = event
            else:
                new.append(event)
        self.events.extend(new)
        return new


def set_aside_previous_run(root: Path, *, markers: tuple[str, ...]) -> Path | None:
    """Move an earlier run out of `root` so that a new run starts clean: to ROOT.previous (replacing an older one).
    Returns where it went, or None when `root` holds no earlier run (none of `markers` exists in it)."""
    if not any((root / name).exists() for name in markers) and not any(root.glob("peer-*")):
        return None
    previous = root.with_name(root.name + ".previous")
    if previous.exists():
        shutil.rmtree(previous)
    root.rename(previous)
    return previous


def raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def become_subreaper() -> None:
    """Orphans of killed peers (their DHT process, p2pd) re-parent to us, so nothing escapes cleanup."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def start_coordinator(
    root: Path, run_id: str, env: dict[str, str], *, timeout: float = 90.0
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start `python -m swarmloco.coordinator` on a free port (its own session) and wait for its ready file.

    The run is invite-only: the coordinator generates a code (kept next to its database) and writes it into the
    ready file, whose JSON this returns; the caller hands ``info["invite"]`` to its peers."""
    ready = root / "coordinator.json"
    ready.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "swarmloco.coordinator",
        "--db",
        str(root / "coordinator.sqlite"),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--dht-host",
        "127.0.0.1",
        "--ready-file",
        str(ready),
        "--run-id",
        run_id,
        "--admission",
        "invite",
    ]
    with open(root / "coordinator.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.exists():
            return proc, json.loads(ready.read_text())
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop_session(proc)
    raise RuntimeError(f"coordinator did not start; see {root / 'coordinator.log'}")


def stop_session(proc: Handle, *, timeout: float = 15.0) -> None:
    """SIGTERM a process we started in its own session, then SIGKILL whatever of that session is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def merge_rounds(peers: list[PeerProc]) -> list[dict[str, Any]]:
    """One record per committed round number: members, weights, each reporting peer's hash, outcome."""
    by_round: dict[int, dict[str, Any]] = {}
    for p in peers:
        for e in p.events:
            if e.get("event") != "round" or e.get("outcome") not in (Outcome.COMMITTED, Outcome.MISMATCH):
                continue
            rec = by_round.setdefault(
                int(e["round"]), {"round": int(e["round"]), "hashes": {}, "leader": e.get("leader")}
            )
            rec["hashes"][f"peer-{p.index}"] = e.get("state_hash_full") or e.get("state_hash")
            if e.get("role") == "leader":
                rec.update(
                    members=e.get("member_count"),
                    train_s=e.get("train_s"),
                    wait_s=e.get("wait_s"),
                    average_s=e.get("average_s"),
                    eval_loss=e.get("eval_loss"),
                    weights=e.get("weights"),
                    excluded=e.get("excluded"),
                )
    for rec in by_round.values():
        # peers that applied the same round but disagree on its result: the swarm split, whatever each peer logged
        agreed = len(set(rec["hashes"].values())) == 1
        rec["outcome"] = Outcome.COMMITTED.value if agreed else Outcome.MISMATCH.value
    return [by_round[k] for k in sorted(by_round)]

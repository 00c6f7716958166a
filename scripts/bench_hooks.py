"""Our side of the benchmarks (`scripts/bench.py` loads these lazily): real processes, real libp2p streams.

- ours_allreduce, measured_round_bytes, round_phases: real rounds of N peer processes (scripts.bench_allreduce_hooks;
  re-exported here, where the harness looks hooks up by name).
- join_seconds: donors serve a preset's θ+m; the joiner's chunk-verified download_state (scripts.bench_join_hooks).
- utilisation: a real swarm of peer processes with per-peer slowdowns; compute vs wall time per peer.

What the hook modules share (a benchmark SwarmNode, the benchmark chain's hash) lives in scripts.bench_nodes.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench_allreduce_hooks import measured_round_bytes, ours_allreduce, round_phases
from scripts.bench_join_hooks import join_seconds

__all__ = ["join_seconds", "measured_round_bytes", "ours_allreduce", "round_phases"]  # and the hooks below

ROOT = Path(__file__).resolve().parents[1]


def utilisation(
    slowdowns: list[float],
    mode: str,
    shaped: bool,
    netns: list[tuple[str, str]] | None = None,
    rounds: int = 4,
    preset: str = "tiny",
) -> dict[str, Any]:
    """Run len(slowdowns) real peers and report compute/wait/wall seconds per peer.

    async: our decoupled rounds — quorum 2, a *time* budget per round (slow peers run fewer inner steps) and
           training continues while the group forms.
    sync:  wait-for-everyone DiLoCo — quorum = all peers, H inner steps each, idle while waiting.
    """
    if shaped and not netns:
        raise RuntimeError("shaped runs need network namespaces (netns=[(name, address), ...])")
    n = len(slowdowns)
    common = [
        "--preset",
        preset,
        "--max-rounds",
        str(rounds),
        "--threads",
        "1",
        "--log-format",
        "json",
        "--linger",
        "3",
        "--checkpoint-every",
        "0",
        "--eval-every",
        "1000",
        "--grace-max",
        "5",
        "--round-timeout",
        "120",
        "--codec",
        "int8",
    ]
    if mode == "async":
        common += ["--quorum", "2", "--round-seconds", "6", "--train-while-waiting"]
    elif mode == "sync":
        common += [
            "--quorum",
            str(n),
            "--inner-steps",
            "40",
            "--no-train-while-waiting",
            "--no-close-early",
            "--grace-min",
            "0",
        ]
    else:
        raise ValueError(f"mode: got {mode!r}, allowed async, sync")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory(prefix="swarmloco-util-") as tmp:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            bootstrap: list[str] = []
            for i, slow in enumerate(slowdowns):
                host = netns[i][1] if netns else "127.0.0.1"
                workdir = Path(tmp) / f"peer-{i}"
                workdir.mkdir()
                argv = [
                    sys.executable,
                    "-m",
                    "swarmloco.cli",
                    "peer",
                    *common,
                    "--slowdown",
                    str(slow),
                    "--workdir",
                    str(workdir),
                    "--shard-index",
                    str(i),
                    "--num-shards",
                    str(n),
                    "--summary-json",
                    str(workdir / "summary.json"),
                    "--host-maddr",
                    f"/ip4/{host}/tcp/0",
                ]
                for maddr in bootstrap:
                    argv += ["--initial-peer", maddr]
                if netns:
                    argv = ["ip", "netns", "exec", netns[i][0], *argv]
                with open(workdir / "log.jsonl", "wb") as log, open(workdir / "stderr.log", "wb") as err:
                    procs.append(subprocess.Popen(argv, stdout=log, stderr=err, env=env, start_new_session=True))
                if i == 0:
                    bootstrap = _wait_joined(workdir / "log.jsonl", procs[0])
            for p in procs:
                p.wait(900)
            peers = []
            for i in range(n):
                path = Path(tmp) / f"peer-{i}" / "summary.json"
                if not path.exists():
                    raise RuntimeError(
                        f"peer {i} wrote no summary; see its stderr:\n"
                        f"{(Path(tmp) / f'peer-{i}' / 'stderr.log').read_text()[-2000:]}"
                    )
                s = json.loads(path.read_text())
                committed = [h for h in s["history"] if h.get("outcome") == "committed"]
                peers.append(
                    {
                        "slowdown": slowdowns[i],
                        "compute_s": s["compute_s"],
                        "wall_s": s["wall_s"],
                        "wait_s": max(0.0, s["wall_s"] - s["compute_s"]),
                        "rounds_committed": len(committed),
                        "tokens": s["tokens"],
                        "final_eval_loss": s["final_eval_loss"],
                    }
                )
            return {"mode": mode, "shaped": shaped, "peers": peers}
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _wait_joined(log: Path, proc: subprocess.Popen[bytes], timeout: float = 120) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"peer 0 exited with {proc.returncode} before joining")
        for line in log.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "joined":
                return list(event["maddrs"])
        time.sleep(0.3)
    raise RuntimeError("peer 0 did not join within the timeout")

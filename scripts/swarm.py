"""`swarmloco swarm`: a local multi-peer swarm on loopback — the process-level twin of docker-compose.yml.

Starts a DHT bootstrap node (or a coordinator, which is one), then N peer processes, each in its own session so
that a SIGKILL takes its DHT process and p2pd daemon with it, like a machine dying. Logs go to one file per peer;
per-round records (members, weights, every member's state hash, outcome) are merged into --summary-json.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.identity import load_or_create_identity
from protocol.outcome import Outcome

logger = logging.getLogger(__name__)
PR_SET_CHILD_SUBREAPER = 36
AUTHORITY_KEY = "authority.key"  # a local swarm without a coordinator: the run's authority key, in --workdir


def add_swarm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=int, default=3, help="number of peer processes")
    parser.add_argument("--preset", default="tiny", help="model preset of the default task: tiny, small, base")
    parser.add_argument("--rounds", type=int, default=3, help="outer rounds each peer trains for")
    parser.add_argument("--inner-steps", type=int, default=30, help="H: inner steps per round")
    parser.add_argument("--quorum", type=int, default=0, help="K, minimum group size (0 = half the peers, at least 2)")
    parser.add_argument("--codec", default="int8", help="pseudo-gradient codec: fp32, fp16, bf16, int8, int4")
    parser.add_argument(
        "--workdir", default="runs/swarm", help="directory for per-peer logs, checkpoints and identities"
    )
    parser.add_argument(
        "--slowdown",
        default="",
        help="per-peer slowdown factors, e.g. 1,1,2,4 (a peer with 4 sleeps 3x its step time after every step)",
    )
    parser.add_argument(
        "--kill-every",
        type=float,
        default=0.0,
        help="SIGKILL a random peer every this many seconds and restart it (chaos demo)",
    )
    parser.add_argument("--summary-json", default=None, help="write per-round records and eval losses here")
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="give up (and stop every peer) after this many seconds"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads per peer (0 = cores / peers)")
    parser.add_argument(
        "--coordinator", default=None, help="report to this existing coordinator URL instead of starting one"
    )
    parser.add_argument(
        "--no-coordinator", action="store_true", help="start no coordinator (peers then report nowhere)"
    )
    parser.add_argument("--run-id", default="local-swarm", help="run id (DHT namespace and coordinator run)")
    parser.add_argument(
        "--peer-arg",
        action="append",
        default=[],
        help="extra argument passed to every peer (repeatable), e.g. --peer-arg=--round-seconds=5",
    )


@dataclass
class PeerProc:
    index: int
    workdir: Path
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    log_offset: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0

    @property
    def log(self) -> Path:
        return self.workdir / "log.jsonl"

    def start(self, env: dict[str, str], *, resume: bool) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = self.argv + (["--resume"] if resume else [])
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
            if isinstance(event, dict) and event.get("event") != "step":
                new.append(event)
        self.events.extend(new)
        return new


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _become_subreaper() -> None:
    """Orphans of killed peers (their DHT process, p2pd) re-parent to us, so nothing escapes cleanup."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _peer_argv(
    args: argparse.Namespace,
    i: int,
    workdir: Path,
    bootstrap: list[str],
    slowdowns: list[float],
    threads: int,
    coordinator_url: str | None,
) -> list[str]:
    quorum = args.quorum or min(args.peers, max(2, args.peers // 2))
    argv = [
        sys.executable,
        "-m",
        "scripts.cli",
        "peer",
        "--preset", args.preset,
        "--max-rounds", str(args.rounds),
        "--inner-steps", str(args.inner_steps),
        "--quorum", str(quorum),
        "--codec", args.codec,
        "--workdir",
        str(workdir),
        "--shard-index",
        str(i),
        "--num-shards",
        str(args.peers),
        "--log-format",
        "json",
        "--summary-json",
        str(workdir / "summary.json"),
        "--host-maddr",
        "/ip4/127.0.0.1/tcp/0",
        "--threads",
        str(threads),
        "--slowdown",
        str(slowdowns[i]),
        "--linger",
        "5",
        "--checkpoint-every",
        "1",
        "--run-id",
        args.run_id,
        "--wait-for-peers",
        str(args.peers),
    ]
    if coordinator_url:
        argv += ["--coordinator", coordinator_url]  # the coordinator is the run's authority and issues tickets
    else:
        # No coordinator: the launcher holds the run's authority key, and every local peer signs its own ticket.
        argv += ["--authority-key", str(workdir.parent / AUTHORITY_KEY)]
    for maddr in bootstrap:
        argv += ["--initial-peer", maddr]
    return argv + list(args.peer_arg)


def start_coordinator(
    root: Path, run_id: str, env: dict[str, str], *, timeout: float = 90.0
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start `python -m coordinator` on a free port (its own session) and wait for its ready file."""
    ready = root / "coordinator.json"
    ready.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "coordinator",
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


def stop_session(proc: subprocess.Popen[bytes], *, timeout: float = 15.0) -> None:
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


def run_swarm(args: argparse.Namespace) -> int:
    import hivemind

    if args.peers < 1 or args.rounds < 1:
        logger.error("--peers and --rounds must be at least 1 (got %d, %d)", args.peers, args.rounds)
        return 2
    slowdowns = [float(x) for x in args.slowdown.split(",")] if args.slowdown else [1.0] * args.peers
    if len(slowdowns) != args.peers or any(s < 1 for s in slowdowns):
        logger.error("--slowdown needs %d factors >= 1, got %r", args.peers, args.slowdown)
        return 2
    _become_subreaper()
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM too must reach the cleanup below
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    load_or_create_identity(root / AUTHORITY_KEY)  # before any peer reads it
    threads = args.threads or max(1, (os.cpu_count() or 2) // args.peers)
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    coordinator: subprocess.Popen[bytes] | None = None
    bootstrap_dht = None
    coordinator_url = args.coordinator
    if not args.coordinator and not args.no_coordinator:
        coordinator, info = start_coordinator(root, args.run_id, env)
        coordinator_url, bootstrap = info["url"], list(info["dht_maddrs"])
        print(
            f"coordinator: dashboard at {coordinator_url}/  "
            f"(API {coordinator_url}/api/rounds, metrics {coordinator_url}/metrics)",
            flush=True,
        )
    else:
        bootstrap_dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        bootstrap = [str(m) for m in bootstrap_dht.get_visible_maddrs()]
    print(f"bootstrap DHT node: {bootstrap[0]}", flush=True)
    peers = [
        PeerProc(
            i,
            root / f"peer-{i}",
            _peer_argv(args, i, root / f"peer-{i}", bootstrap, slowdowns, threads, coordinator_url),
        )
        for i in range(args.peers)
    ]
    started, kills, last_kill, best_round = time.monotonic(), [], time.monotonic(), 0
    try:
        for p in peers:
            p.start(env, resume=False)
        print(f"started {args.peers} peers; logs in {root}/peer-*/log.jsonl", flush=True)
        while any(p.alive() for p in peers):
            time.sleep(0.5)
            for p in peers:
                for e in p.read_events():
                    if e.get("event") == "round" and e.get("outcome") == "committed" and int(e["round"]) > best_round:
                        best_round = int(e["round"])
                        print(
                            f"round {best_round}/{args.rounds} committed by {e.get('member_count')} peers"
                            f" | eval loss {e.get('eval_loss')} | hash {str(e.get('state_hash'))[:12]}"
                            f" | train {e.get('train_s')}s wait {e.get('wait_s')}s average {e.get('average_s')}s",
                            flush=True,
                        )
            elapsed = time.monotonic() - started
            if elapsed > args.timeout:
                logger.error("swarm did not finish within %.0fs; stopping peers", args.timeout)
                break
            if args.kill_every and time.monotonic() - last_kill >= args.kill_every and best_round < args.rounds:
                victims = [p for p in peers if p.alive()]
                if victims:
                    victim = random.choice(victims)
                    victim.kill_group()
                    victim.proc.wait(10)  # type: ignore[union-attr]
                    kills.append({"peer": victim.index, "at_s": round(elapsed, 1)})
                    print(f"chaos: SIGKILLed peer-{victim.index}; restarting it", flush=True)
                    victim.restarts += 1
                    victim.start(env, resume=(victim.workdir / "checkpoint" / "state.json").exists())
                last_kill = time.monotonic()
    except KeyboardInterrupt:
        print("interrupted: stopping peers (they checkpoint first)", flush=True)
    finally:
        for p in peers:
            if p.alive():
                p.kill_group(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in peers:
            if p.proc is not None:
                try:
                    p.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            p.kill_group(signal.SIGKILL)  # whatever is left of the session, p2pd included
            p.read_events()
        if bootstrap_dht is not None:
            bootstrap_dht.shutdown()
        if coordinator is not None:
            stop_session(coordinator)
    summaries = {}
    for p in peers:
        path = p.workdir / "summary.json"
        if path.exists():
            summaries[f"peer-{p.index}"] = json.loads(path.read_text())
    rounds = merge_rounds(peers)
    finals = [
        s
        for s in summaries.values()
        if s.get("rounds") == max((x.get("rounds", 0) for x in summaries.values()), default=0)
    ]
    summary = {
        "peers": args.peers,
        "rounds_requested": args.rounds,
        "preset": args.preset,
        "codec": args.codec,
        # every fresh peer evaluates the same θ_0 before syncing, so these agree; a peer restarted without a
        # checkpoint still evaluates θ_0, never the synced state
        "initial_eval_loss": max((s["initial_eval_loss"] for s in summaries.values()), default=None),
        "final_eval_loss": finals[0]["final_eval_loss"] if finals else None,
        "final_state_hashes": {k: s.get("state_hash") for k, s in summaries.items()},
        "rounds": rounds,
        "kills": kills,
        "wall_s": round(time.monotonic() - started, 2),
        "peer_summaries": summaries,
    }
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    ok = bool(rounds) and all(r["outcome"] == Outcome.COMMITTED for r in rounds) and len(summaries) == args.peers
    print(
        f"done: {len(rounds)} rounds, eval loss {summary['initial_eval_loss']} -> {summary['final_eval_loss']},"
        f" {'all hashes equal' if ok else 'SEE SUMMARY: not every round agreed'}",
        flush=True,
    )
    return 0 if ok else 1

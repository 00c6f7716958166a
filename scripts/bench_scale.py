"""`bench scale`: how a round's overhead and a peer's memory grow with the number of peers, on this one machine.

For each N, the local swarm launcher (`swarmloco swarm`, tiny preset, no coordinator) runs N real peer processes
for a few rounds. Each committed round's overhead is split from the peers' JSON logs into matchmaking (ready until
the group closed: `wait_s`; and `formation_s`, the least of the members' waits: from the last member's readiness to
the close), exchange (until the average arrived: `exchange_s`) and commit (votes and certificate:
`certify_s`), each the median over the round's members, then over rounds. Memory is the launcher's peak PSS of the
whole swarm (fork server included) divided by N, and the largest single peer tree's RSS.

All N peers share this machine's cores, so at large N every peer gets cores / N of a core and every phase slows by
that alone. "× CPU share" multiplies the overhead by min(1, cores / N): the overhead a peer would see on a machine
of its own if the round's cost were pure CPU. Its growth from the smallest N, divided by the growth of log2(N), is
the number to watch: at or below 1, the round scales no faster than log(peers). For the same reason peers wait for
their group idle here (`--no-train-while-waiting`, unless `--train-while-waiting`): 32 waiting peers training on 2
shared cores would starve the matchmaking of all of them, which peers on machines of their own do not do.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench_common import kill_processes, median, ratio, table, write_json

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=int, nargs="+", default=None, help="peer counts (default 2 4 8 16 32; quick 2 3)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per swarm (the first includes start-up)")
    p.add_argument("--inner-steps", type=int, default=20, help="H: inner steps per round")
    p.add_argument("--codec", default="int8", help="wire codec of the rounds")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per swarm")
    p.add_argument("--spawn", choices=("fork", "exec"), default="fork", help="how the launcher starts peers")
    p.add_argument("--workdir", default=None, help="keep the swarms' logs here (default: a temporary directory)")
    p.add_argument("--train-while-waiting", action="store_true",
                   help="let peers train while their group forms, as they do by default (here all N share these "
                        "cores, so every waiting peer's training slows everyone's matchmaking; on machines of their "
                        "own it would not): off by default")


def round_events(workdir: Path) -> dict[int, list[dict[str, Any]]]:
    """Every peer's committed round events, by round number."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for log in sorted(workdir.glob("peer-*/log.jsonl")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(e, dict) and e.get("event") == "round" and e.get("outcome") == "committed":
                by_round.setdefault(int(e["round"]), []).append(e)
    return by_round


def _phases(e: dict[str, Any]) -> tuple[float | None, float | None, float | None]:
    """(matchmaking, exchange, commit) seconds of one peer's round; older logs lack exchange_s or certify_s."""
    avg, exch, cert = e.get("average_s"), e.get("exchange_s"), e.get("certify_s")
    if exch is None and avg is not None and cert is not None:
        exch = avg - cert
    if cert is None and avg is not None and exch is not None:
        cert = avg - exch
    return e.get("wait_s"), exch, cert


def summarise(by_round: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    rounds = []
    for number in sorted(by_round):
        events = by_round[number]
        phases = [_phases(e) for e in events]
        rounds.append({
            "round": number,
            "members": max(int(e.get("member_count") or 0) for e in events),
            "committed_at": min(float(e["time"]) for e in events),
            # the last member to become ready waited least: from then until the group closed is what forming the
            # group cost once everyone it needed was there (the rest of the others' waits was their training)
            "formation_s": min((p[0] for p in phases if p[0] is not None), default=None),
            **{name: median([p[i] for p in phases if p[i] is not None])
               for i, name in enumerate(("matchmaking_s", "exchange_s", "commit_s"))},
        })
    gaps = [b["committed_at"] - a["committed_at"] for a, b in zip(rounds, rounds[1:], strict=False)]
    out: dict[str, Any] = {"rounds": rounds, "round_s": median(gaps) if gaps else None,
                           "members": [r["members"] for r in rounds]}
    for name in ("matchmaking_s", "exchange_s", "commit_s", "formation_s"):
        out[name] = median([r[name] for r in rounds if r[name] is not None])
    parts = [out[n] for n in ("matchmaking_s", "exchange_s", "commit_s")]
    out["overhead_s"] = sum(parts) if all(p is not None for p in parts) else None
    # the measure of matchmaking at scale: its share of a round's time (target: at most 0.1)
    mm, per_round = out["matchmaking_s"], out["round_s"]
    out["matchmaking_share"] = round(mm / per_round, 3) if mm is not None and per_round else None
    # the same, counting only the wait after the group's last member was ready (on a shared machine most of a
    # member's wait is the slowest peer's training, which no protocol can shorten)
    form = out["formation_s"]
    out["formation_share"] = round(form / per_round, 3) if form is not None and per_round else None
    return out


def _failure(rc: int | None, workdir: Path, timed_out: bool) -> str:
    if timed_out:
        return "timed out"
    text = "".join(p.read_text(errors="replace")[-20000:] for p in workdir.glob("peer-*/stderr.log"))
    if "MemoryError" in text or "Cannot allocate memory" in text:
        return "out of memory"
    if rc is not None and rc < 0:
        return f"launcher killed by signal {-rc}"
    return f"launcher exited {rc}"


def run_swarm(n: int, args: argparse.Namespace, workdir: Path, *, rounds: int, inner_steps: int) -> dict[str, Any]:
    """One `swarmloco swarm` run of n peers; the summary and round phases, or a failure reason."""
    summary_path = workdir / "summary.json"
    argv = [sys.executable, "-m", "swarmloco.cli", "swarm", "--peers", str(n), "--preset", "tiny",
            "--rounds", str(rounds), "--inner-steps", str(inner_steps), "--codec", args.codec,
            "--no-coordinator", "--workdir", str(workdir), "--summary-json", str(summary_path),
            "--timeout", str(args.timeout), "--spawn", args.spawn, "--run-id", f"scale-{n}"]
    if not args.train_while_waiting:
        argv.append("--peer-arg=--no-train-while-waiting")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started, timed_out = time.monotonic(), False
    with open(workdir.parent / f"launcher-{n}.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(args.timeout + 120)  # the launcher stops its own swarm at --timeout; this is the backstop
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_processes([proc])
    result: dict[str, Any] = {"peers": n, "wall_s": round(time.monotonic() - started, 1), "rc": proc.returncode}
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    result["memory"] = summary.get("memory", {})
    result.update(summarise(round_events(workdir)))
    committed = len(result["rounds"])
    if proc.returncode != 0 or committed < rounds:
        result["note"] = f"{_failure(proc.returncode, workdir, timed_out)}; {committed}/{rounds} rounds committed"
    return result


def _row(r: dict[str, Any], cores: int, base: dict[str, Any] | None) -> list[Any]:
    n = r["peers"]
    share = min(1.0, cores / n)
    norm = r["overhead_s"] * share if r.get("overhead_s") is not None else None
    r["cpu_share"], r["overhead_x_share_s"] = share, norm
    growth = log_ratio = None
    if base is not None and norm is not None and base.get("overhead_x_share_s"):
        growth = norm / base["overhead_x_share_s"]
        log_growth = math.log2(n) / math.log2(base["peers"]) if base["peers"] > 1 else None
        log_ratio = ratio(growth, log_growth)
    r["growth"], r["growth_over_log2"] = growth, log_ratio
    members = "/".join(str(m) for m in r.get("members", [])) or None
    mem = r.get("memory", {})
    return [n, members, r.get("round_s"), r.get("matchmaking_s"), r.get("matchmaking_share"), r.get("formation_s"),
            r.get("formation_share"), r.get("exchange_s"), r.get("commit_s"),
            r.get("overhead_s"), share, norm, growth, log_ratio, mem.get("per_peer_pss_mb"),
            mem.get("peak_peer_tree_rss_mb"), r.get("note", "")]


def run(args: argparse.Namespace) -> int:
    counts = args.peers or ([2, 3] if args.quick else [2, 4, 8, 16, 32])
    rounds, inner = (1, 10) if args.quick else (max(1, args.rounds), args.inner_steps)
    cores = os.cpu_count() or 1
    keep = args.workdir is not None
    root = Path(args.workdir) if keep else Path(tempfile.mkdtemp(prefix="bench-scale-"))
    results: list[dict[str, Any]] = []
    for n in counts:
        logger.info("scale: %d peers, %d rounds of %d inner steps", n, rounds, inner)
        workdir = root / f"swarm-{n}"
        workdir.mkdir(parents=True, exist_ok=True)
        results.append(run_swarm(n, args, workdir, rounds=rounds, inner_steps=inner))
    base = next((r for r in results if r.get("overhead_s")), None)
    rows = [_row(r, cores, base) for r in results]
    waiting = "train while waiting" if args.train_while_waiting else "idle while waiting"
    print(table(f"Round overhead and memory vs peers ({cores} cores, tiny preset, {args.codec}, {args.spawn}, "
                f"{waiting})",
                ["peers", "members per round", "s per round", "matchmaking s", "matchmaking share", "formation s",
                 "formation share", "exchange s", "commit s",
                 "overhead s", "CPU share", "overhead × share s", "growth", "growth ÷ log2 growth",
                 "PSS per peer MB", "max peer tree RSS MB", "note"], rows,
                [f"{rounds} rounds of H={inner} per swarm, median over each round's members, then over rounds; "
                 "s per round: between consecutive commits (the first round includes start-up and is not in it)",
                 "overhead = matchmaking (ready → group closed, includes the grace window) + exchange + commit; "
                 "matchmaking share = matchmaking s ÷ s per round; formation s: the round's least member wait (from "
                 "its last member's readiness to the close), its share likewise",
                 f"CPU share = min(1, {cores} cores / peers); growth = (overhead × share) ÷ the same at "
                 f"{base['peers'] if base else '—'} peers; ÷ log2 growth: growth ÷ (log2 N ÷ log2 N₀), ≤ 1 is "
                 "no faster than log(peers)",
                 "PSS per peer: peak PSS of the whole swarm (fork server included) ÷ peers; RSS double-counts "
                 "shared pages"]))
    write_json(args.json, {"benchmark": "scale", "cores": cores, "rounds": rounds, "inner_steps": inner,
                           "train_while_waiting": bool(args.train_while_waiting),
                           "results": results, "workdir": str(root) if keep else None})
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0

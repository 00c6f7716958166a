"""`swarmloco swarm`: a local multi-peer swarm on loopback — the process-level twin of docker-compose.yml.

Starts a DHT bootstrap node (or a coordinator, which is one), then N peer processes, each in its own session so
that a SIGKILL takes its p2pd daemon with it, like a machine dying. Peers are forked from one fork server that
imported torch and hivemind once (`--spawn fork`, shared pages: a fraction of the memory) or exec'd fresh
(`--spawn exec`). They start a few at a time, so that dozens of p2pd and DHT bootstraps do not time out on a small
machine, and the round deadlines grow with the number of peers per core. Logs go to one file per peer; per-round
records (members, weights, every member's state hash, outcome) and the swarm's peak memory go to --summary-json.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from swarmloco.peer.presets import PRESETS
from swarmloco.proc_memory import SwarmMemory
from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.base.text import short_hash
from swarmloco.protocol.trust.identity import load_or_create_identity
from swarmloco.swarm_procs import (
    PeerProc,
    become_subreaper,
    merge_rounds,
    raise_interrupt,
    set_aside_previous_run,
    start_coordinator,
    stop_session,
)

__all__ = ["PeerProc", "add_swarm_arguments", "run_swarm", "merge_rounds"]
logger = logging.getLogger(__name__)
AUTHORITY_KEY = "authority.key"  # a local swarm without a coordinator: the run's authority key, in --workdir
# glibc gives every thread that allocates its own arena (up to 8 per core); a peer has a dozen threads and barely
# allocates in most of them. (p2pd's ~60 MB is not its Go heap: GOGC and GOMEMLIMIT do not move it.)
LEAN_ENV = {"MALLOC_ARENA_MAX": "2"}
PROGRESS_EVERY_S = 10.0  # while no round commits, how often the launcher says where the swarm is


def add_swarm_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--peers", type=int, default=3, help="number of peer processes")
    add("--preset", default="tiny", help=f"model preset of the default task: {', '.join(PRESETS)}")
    add("--rounds", type=int, default=3, help="outer rounds each peer trains for")
    add("--inner-steps", type=int, default=30, help="H: inner steps per round")
    add("--quorum", type=int, default=0, help="K, minimum group size (0 = half the peers, at least 2)")
    add("--codec", default="int8", help="pseudo-gradient codec: fp32, fp16, bf16, int8, int4")
    add("--workdir", default="runs/swarm", help="directory for per-peer logs, checkpoints and identities")
    add("--slowdown", default="",
        help="per-peer slowdown factors, e.g. 1,1,2,4 (a peer with 4 sleeps 3x its step time after every step)")
    add("--kill-every", type=float, default=0.0,
        help="SIGKILL a random peer every this many seconds and restart it (chaos demo)")
    add("--summary-json", default=None, help="write per-round records, eval losses and peak memory here")
    add("--timeout", type=float, default=1800.0, help="give up (and stop every peer) after this many seconds")
    add("--threads", type=int, default=0, help="torch threads per peer (0 = cores / peers)")
    add("--coordinator", default=None, help="report to this existing coordinator URL instead of starting one (its "
                                           "invite code, if any, goes in --peer-arg=--invite=CODE)")
    add("--no-coordinator", action="store_true", help="start no coordinator (peers then report nowhere)")
    add("--run-id", default=None, help="run id (DHT namespace and coordinator run; default: the --coordinator's "
                                       "run, or local-swarm)")
    add("--spawn", choices=("fork", "exec"), default="fork",
        help="fork peers from one process that imported torch once (shares its memory), or exec each afresh")
    add("--start-parallel", type=int, default=4,
        help="peers starting at once: the next one starts when an earlier one has joined the DHT")
    add("--memory-every", type=float, default=5.0, help="sample the swarm's memory every this many seconds (0: off)")
    add("--peer-arg", action="append", default=[],
        help="extra argument passed to every peer (repeatable; wins over the launcher's defaults), "
             "e.g. --peer-arg=--round-seconds=5")


def load_factor(peers: int, cores: int | None = None) -> float:
    """How much slower than one peer per core each peer runs here: the round deadlines are scaled by it."""
    return max(1.0, peers / (2 * (cores or os.cpu_count() or 2)))


def _peer_argv(args: argparse.Namespace, i: int, workdir: Path, bootstrap: list[str], slowdowns: list[float],
               threads: int, coordinator_url: str | None, invite: str = "") -> list[str]:
    quorum = args.quorum or min(args.peers, max(2, args.peers // 2))
    f = load_factor(args.peers)
    argv = [
        sys.executable, "-m", "swarmloco.cli", "peer",
        "--preset", args.preset, "--max-rounds", str(args.rounds), "--inner-steps", str(args.inner_steps),
        "--quorum", str(quorum), "--codec", args.codec, "--workdir", str(workdir),
        "--shard-index", str(i), "--num-shards", str(args.peers), "--log-format", "json",
        "--summary-json", str(workdir / "summary.json"), "--host-maddr", "/ip4/127.0.0.1/tcp/0",
        "--threads", str(threads), "--slowdown", str(slowdowns[i]), "--linger", str(round(5 * f)),
        "--checkpoint-every", "1", "--run-id", args.run_id, "--wait-for-peers", str(args.peers),
    ]
    if f > 1:
        # Dozens of peers on a few cores: every frame and tensor waits for a time slice, and the leader serves the
        # whole group on one of them. The defaults are made for one peer per machine.
        argv += ["--control-timeout", f"{10 * f:g}", "--exchange-timeout", f"{60 * f:g}",
                 "--round-timeout", f"{60 * f:g}", "--grace-max", f"{10 * f:g}"]
        # Every heartbeat re-signs a record that every other peer then re-verifies (~0.7 ms each): N² checks per
        # heartbeat, which alone ate a core at 32 peers. DHT requests between starved processes need more time.
        argv += ["--heartbeat", f"{2 * f:g}", "--record-ttl", f"{min(300.0, 20 * f):g}",
                 "--dht-timeout", f"{min(8.0, 3 * f):g}"]
    if coordinator_url:
        argv += ["--coordinator", coordinator_url]  # the coordinator is the run's authority and issues tickets
        if invite:  # the code our own coordinator generated (its run is invite-only, like every coordinator's default)
            argv += [f"--invite={invite}"]  # one word: a code may start with "-"
    else:
        # No coordinator: the launcher holds the run's authority key, and every local peer signs its own ticket.
        argv += ["--authority-key", str(workdir.parent / AUTHORITY_KEY)]
    for maddr in bootstrap:
        argv += ["--initial-peer", maddr]
    return argv + list(args.peer_arg)


def _validate(args: argparse.Namespace) -> list[float] | None:
    if args.peers < 1 or args.rounds < 1 or args.start_parallel < 1:
        logger.error("--peers, --rounds and --start-parallel must be at least 1 (got %d, %d, %d)",
                     args.peers, args.rounds, args.start_parallel)
        return None
    slowdowns = [float(x) for x in args.slowdown.split(",")] if args.slowdown else [1.0] * args.peers
    if len(slowdowns) != args.peers or any(s < 1 for s in slowdowns):
        logger.error("--slowdown needs %d factors >= 1, got %r", args.peers, args.slowdown)
        return None
    return slowdowns


class Swarm:
    """One local swarm run: its infrastructure, its peers, and what was seen of them."""

    def __init__(self, args: argparse.Namespace, slowdowns: list[float]) -> None:
        self.args, self.slowdowns = args, slowdowns
        self.root = Path(args.workdir)
        self.threads = args.threads or max(1, (os.cpu_count() or 2) // args.peers)
        self.env = dict(os.environ, OMP_NUM_THREADS=str(self.threads))
        for key, value in LEAN_ENV.items():
            self.env.setdefault(key, value)
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.invite = ""  # the invite code of the coordinator we started
        self.bootstrap_dht: Any = None
        self.zygote: Any = None
        self.peers: list[PeerProc] = []
        self.memory = SwarmMemory()
        self.kills: list[dict[str, Any]] = []
        self.best_round = 0
        self.started = time.monotonic()
        self._last_sample = 0.0

    def start_infra(self) -> tuple[list[str], str | None]:
        args = self.args
        if not args.coordinator and not args.no_coordinator:
            self.coordinator, info = start_coordinator(self.root, args.run_id, self.env)
            self.invite = str(info.get("invite") or "")
            url = info["url"]
            print(f"coordinator: dashboard at {url}/  (API {url}/api/rounds, metrics {url}/metrics)", flush=True)
            return list(info["dht_maddrs"]), url
        from swarmloco.protocol.network.dht_host import LocalDHT  # a thread of ours: no forked child to outlive us

        self.bootstrap_dht = LocalDHT.on_own_thread(name="bootstrap-dht", host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        return [str(m) for m in self.bootstrap_dht.get_visible_maddrs()], args.coordinator

    def start_peers(self, bootstrap: list[str], coordinator_url: str | None) -> None:
        """Start every peer, at most --start-parallel of them still joining at a time; print progress."""
        args = self.args
        if args.spawn == "fork":
            from swarmloco.zygote import Zygote

            self.zygote = Zygote(self.env)
        self.peers = [PeerProc(i, self.root / f"peer-{i}", _peer_argv(args, i, self.root / f"peer-{i}", bootstrap,
                                                                        self.slowdowns, self.threads, coordinator_url,
                                                                        self.invite),
                               spawner=self.zygote) for i in range(args.peers)]
        pending = list(self.peers)
        joined: set[int] = set()
        starting: list[PeerProc] = []
        shown = -1
        while pending or starting:
            while pending and len(starting) < args.start_parallel:
                p = pending.pop(0)
                p.start(self.env, resume=False)
                starting.append(p)
            time.sleep(0.5)
            self.sample_memory()
            for p in list(starting):
                if any(e.get("event") == "joined" for e in p.read_events()) or not p.alive():
                    starting.remove(p)
                    if p.alive():
                        joined.add(p.index)
            if len(joined) != shown and (len(joined) % 4 == 0 or not (pending or starting)):
                shown = len(joined)
                print(f"peers joined: {len(joined)}/{args.peers} ({time.monotonic() - self.started:.0f}s)", flush=True)
            if time.monotonic() - self.started > args.timeout:
                raise TimeoutError(f"only {len(joined)} of {args.peers} peers joined within {args.timeout:.0f}s")
        print(f"started {args.peers} peers ({args.spawn}); logs in {self.root}/peer-*/log.jsonl", flush=True)
        print(f"round 1: waiting until all {args.peers} peers see each other, then training {args.inner_steps} inner "
              f"steps each before they average (a line every {PROGRESS_EVERY_S:.0f}s)", flush=True)

    def sample_memory(self) -> None:
        if not self.args.memory_every or time.monotonic() - self._last_sample < self.args.memory_every:
            return
        self._last_sample = time.monotonic()
        shared = [self.zygote.proc.pid] if self.zygote is not None else []
        self.memory.sample([p.proc.pid for p in self.peers if p.alive() and p.proc is not None], shared)

    def watch(self) -> None:
        args = self.args
        last_kill = last_progress = time.monotonic()
        done_at: float | None = None  # when the last requested round was committed
        while any(p.alive() for p in self.peers):
            time.sleep(0.5)
            self.sample_memory()
            for p in self.peers:
                for e in p.read_events():
                    if e.get("event") == "round" and e.get("outcome") == "committed" and \
                            int(e["round"]) > self.best_round:
                        self.best_round = int(e["round"])
                        last_progress = time.monotonic()
                        print(f"round {self.best_round}/{args.rounds} committed by {e.get('member_count')} peers"
                              f" | eval loss {e.get('eval_loss')} | hash {short_hash(str(e.get('state_hash')))}"
                              f" | train {e.get('train_s')}s wait {e.get('wait_s')}s average {e.get('average_s')}s"
                              f" | {time.monotonic() - self.started:.0f}s", flush=True)
            if self.best_round < args.rounds and time.monotonic() - last_progress >= PROGRESS_EVERY_S:
                last_progress = time.monotonic()
                print(self.progress_line(), flush=True)
            elapsed = time.monotonic() - self.started
            if elapsed > args.timeout:
                logger.error("swarm did not finish within %.0fs; stopping peers", args.timeout)
                return
            if self.best_round >= args.rounds and done_at is None:
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at > 60 * load_factor(args.peers):
                # The swarm finished; a peer that missed the last round can no longer form a group, and would
                # otherwise wait for the whole --timeout.
                print(f"round {args.rounds} is committed; stopping {sum(p.alive() for p in self.peers)} peer(s) "
                      "that missed it", flush=True)
                return
            if args.kill_every and time.monotonic() - last_kill >= args.kill_every and self.best_round < args.rounds:
                self.chaos(elapsed)
                last_kill = time.monotonic()

    def progress_line(self) -> str:
        """Where round best+1 stands: each live peer's inner steps so far (a silent minute says nothing)."""
        steps = [int(p.last_step.get("step", 0)) for p in self.peers if p.alive()]
        shown = ", ".join(map(str, steps)) or "none alive"
        return (f"round {self.best_round + 1}/{self.args.rounds}: training or averaging; inner steps so far per peer: "
                f"{shown} ({self.args.inner_steps} per round) | {time.monotonic() - self.started:.0f}s")

    def chaos(self, elapsed: float) -> None:
        victims = [p for p in self.peers if p.alive()]
        if not victims:
            return
        victim = random.choice(victims)
        victim.kill_group()
        victim.proc.wait(10)  # type: ignore[union-attr]
        self.kills.append({"peer": victim.index, "at_s": round(elapsed, 1)})
        print(f"chaos: SIGKILLed peer-{victim.index}; restarting it", flush=True)
        victim.restarts += 1
        victim.start(self.env, resume=(victim.workdir / "checkpoint" / "state.json").exists())

    def stop(self) -> None:
        for p in self.peers:
            if p.alive():
                p.kill_group(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.peers:
            if p.proc is not None:
                try:
                    p.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            p.kill_group(signal.SIGKILL)  # whatever is left of the session, p2pd included
            p.read_events()
        if self.zygote is not None:
            self.zygote.close()
        if self.bootstrap_dht is not None:
            self.bootstrap_dht.shutdown()
        if self.coordinator is not None:
            stop_session(self.coordinator)

    def summary(self) -> dict[str, Any]:
        args = self.args
        summaries = {}
        for p in self.peers:
            path = p.workdir / "summary.json"
            if path.exists():
                summaries[f"peer-{p.index}"] = json.loads(path.read_text())
        most = max((x.get("rounds", 0) for x in summaries.values()), default=0)
        finals = [s for s in summaries.values() if s.get("rounds") == most]
        return {
            "peers": args.peers,
            "rounds_requested": args.rounds,
            "preset": args.preset,
            "codec": args.codec,
            "spawn": args.spawn,
            # every fresh peer evaluates the same θ_0 before syncing, so these agree; a peer restarted without a
            # checkpoint still evaluates θ_0, never the synced state
            "initial_eval_loss": max((s["initial_eval_loss"] for s in summaries.values()), default=None),
            "final_eval_loss": finals[0]["final_eval_loss"] if finals else None,
            "final_state_hashes": {k: s.get("state_hash") for k, s in summaries.items()},
            "rounds": merge_rounds(self.peers),
            "kills": self.kills,
            "wall_s": round(time.monotonic() - self.started, 2),
            "memory": self.memory.to_dict(args.peers),
            "peer_summaries": summaries,
        }


def _run_id(args: argparse.Namespace) -> str | None:
    """The run the swarm trains in: an existing --coordinator's (read from its manifest; a different --run-id is
    refused in one line, since its peers would never be admitted), or --run-id, or local-swarm."""
    if not args.coordinator:
        return str(args.run_id or "local-swarm")
    from swarmloco.peer.join import JoinError, fetch_manifest

    try:
        manifest, _ = fetch_manifest(args.coordinator)
    except JoinError as exc:
        logger.error("%s", str(exc).replace("--join", "--coordinator", 1))
        return None
    if args.run_id and args.run_id != manifest.run_id:
        logger.error("the coordinator at %s runs %r, not %r: its peers would never be admitted; pass --run-id %s "
                     "or leave it out", args.coordinator, manifest.run_id, args.run_id, manifest.run_id)
        return None
    return manifest.run_id


def run_swarm(args: argparse.Namespace) -> int:
    slowdowns = _validate(args)
    args.run_id = _run_id(args) if slowdowns is not None else None
    if slowdowns is None or args.run_id is None:
        return 2
    become_subreaper()
    signal.signal(signal.SIGTERM, raise_interrupt)  # SIGTERM too must reach the cleanup below
    swarm = Swarm(args, slowdowns)
    previous = set_aside_previous_run(swarm.root, markers=(AUTHORITY_KEY, "coordinator.sqlite", "summary.json"))
    if previous is not None:
        # Peers would otherwise reuse the old identities and checkpoints, and the coordinator its database.
        print(f"{swarm.root} holds an earlier run: moved it to {previous}; starting clean", flush=True)
    swarm.root.mkdir(parents=True, exist_ok=True)
    load_or_create_identity(swarm.root / AUTHORITY_KEY)  # before any peer reads it
    try:
        bootstrap, coordinator_url = swarm.start_infra()
        print(f"bootstrap DHT node: {bootstrap[0]}", flush=True)
        swarm.start_peers(bootstrap, coordinator_url)
        swarm.watch()
    except KeyboardInterrupt:
        print("interrupted: stopping peers (they checkpoint first)", flush=True)
    except (TimeoutError, RuntimeError) as exc:
        logger.error("%s", exc)
    finally:
        swarm.stop()
    summary = swarm.summary()
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    rounds, summaries = summary["rounds"], summary["peer_summaries"]
    ok = bool(rounds) and all(r["outcome"] == Outcome.COMMITTED for r in rounds) and len(summaries) == args.peers
    mem = summary["memory"]
    if mem.get("peak_total_pss_mb"):
        print(f"memory: peak {mem['peak_total_pss_mb']:.0f} MB PSS for the whole swarm, "
              f"{mem['peak_total_pss_mb'] / args.peers:.0f} MB per peer", flush=True)
    if swarm.coordinator is not None:
        print(f"the dashboard stopped with the swarm; to browse this run again: swarmloco coordinator --db "
              f"{swarm.root / 'coordinator.sqlite'} --run-id {args.run_id} --no-dht", flush=True)
    print(
        f"done: {len(rounds)} rounds, eval loss {summary['initial_eval_loss']} -> {summary['final_eval_loss']},"
        f" {'all hashes equal' if ok else 'SEE SUMMARY: not every round agreed'}",
        flush=True,
    )
    return 0 if ok else 1

"""`swarmloco chaos run SCENARIO`: real peer processes under a fault scenario, measured.

The run starts a bootstrap DHT node (and a coordinator when the scenario needs one), then the peers, each in its own
session with its own workdir and identity (the local swarm launcher's `PeerProc`): on 127.0.0.1, forked from one
process that imported torch and hivemind once (swarmloco.zygote; `--spawn exec` starts fresh interpreters), or each
exec'd in a network namespace of its own for a scenario that cuts links (swarmloco.chaos_net). Once all have joined, the
scenario's driver injects its faults for --duration seconds; then every fault is undone and the run waits (at most
--settle seconds) until all live peers hold one state, so that their final hashes can be compared. Every process
started is stopped in a `finally`, by pid or by the session created for it, and `orphans` counts those still alive
afterwards. Writes --json (rounds, goodput, faults, per-peer peaks) and a PNG beside it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from swarmloco.chaos_net import NetnsError, SplitNet
from swarmloco.chaos_report import (
    ProcSampler,
    agreed_rounds,
    agreement,
    final_hash,
    is_running,
    run_notes,
    summary_fields,
    token_curve,
    write_plot,
)
from swarmloco.chaos_scenarios import SCENARIOS, ChaosConfig, Scenario
from swarmloco.proc_memory import cmdline, descendants
from swarmloco.protocol.trust.identity import load_or_create_identity
from swarmloco.swarm_procs import (
    Handle,
    PeerProc,
    become_subreaper,
    raise_interrupt,
    set_aside_previous_run,
    stop_session,
)
from swarmloco.zygote import Zygote

logger = logging.getLogger(__name__)
AUTHORITY_KEY = "authority.key"
SHM_MANAGER = "torch_shm_manager"  # torch's shared-memory manager, if this process started one: ends with it


class ChaosRun:
    """One run: the processes it started (and only those), the faults it injected, and what it saw."""

    def __init__(self, cfg: ChaosConfig, scenario: Scenario) -> None:
        self.cfg, self.scenario = cfg, scenario
        self.round_timeout = cfg.round_timeout
        self.root = cfg.workdir
        self.env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2")
        self.env.pop("SWARMLOCO_FAULTS", None)
        self.peers: dict[str, PeerProc] = {}
        self.bootstrap: list[str] = []
        self.bootstrap_dht: Any = None
        self.net: SplitNet | None = None  # scenarios that cut links: each peer in a network namespace of its own
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.coordinator_url: str | None = None
        self.coordinator_port, self.coordinator_invite = 0, ""  # its run is invite-only, with a generated code
        self.started: list[Handle] = []  # burners, hostile peers and coordinators, every one we ever started
        self.zygote: Zygote | None = None  # the fork server of --spawn fork
        self.peer_pids: set[int] = set()
        self.sampler = ProcSampler()
        self.faults: list[dict[str, Any]] = []
        self.t0 = time.time()  # the fault window's start (all peers joined)

    # --- ChaosTarget ---------------------------------------------------------------------------------------------
    def live_peers(self) -> list[str]:
        return [name for name, p in self.peers.items() if p.alive()]

    def kill_peer(self, name: str) -> None:
        p = self.peers[name]
        p.kill_group(signal.SIGKILL)
        if p.proc is not None:
            p.proc.wait(10)
        p.read_events()

    def restart_peer(self, name: str) -> None:
        p = self.peers[name]
        p.restarts += 1
        p.argv = self._peer_argv(p.index, p.workdir, wait_for=0)
        p.start(self._env(p.index), resume=(p.workdir / "checkpoint" / "state.json").exists())
        self._record(p)

    def signal_peer(self, name: str, sig: int) -> None:
        self.peers[name].kill_group(sig)

    def leader_peer(self) -> str | None:
        """The peer that led the newest round committed so far, from the `role: leader` round events: the round's
        seed that ranks the next leader is in its certificate, which the event logs do not carry."""
        best: tuple[int, str] | None = None
        for name, p in self.peers.items():
            p.read_events()
            for e in p.events:
                if e.get("event") == "round" and e.get("outcome") == "committed" and e.get("role") == "leader":
                    if best is None or int(e["round"]) > best[0]:
                        best = (int(e["round"]), name)
        return best[1] if best and self.peers[best[1]].alive() else None

    def start_burner(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.started.append(proc)
        return proc

    def start_hostile(self, kind: str, index: int) -> Handle:
        """An admitted peer that is never honest: a `claimant` or a `holder` (swarmloco.chaos_hostile)."""
        workdir = self.root / f"{kind}-{index}"
        workdir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "swarmloco.chaos_hostile", kind, "--run-id", self.cfg.run_id,
                "--authority-key", str(self.root / AUTHORITY_KEY), "--workdir", str(workdir)]
        for maddr in self.bootstrap:
            argv += ["--initial-peer", maddr]
        log = workdir / f"{kind}.log"
        proc: Handle
        if self.zygote is not None:
            proc = self.zygote.spawn(argv, str(log), str(log), env=self.env)
        else:
            with open(log, "ab") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=out, env=self.env, start_new_session=True)
        self.started.append(proc)
        return proc

    def stop_process(self, proc: Handle) -> None:
        stop_session(proc, timeout=5.0)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            logger.warning("pid %d did not exit", proc.pid)

    def kill_coordinator(self) -> None:
        if self.coordinator is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.coordinator.pid, signal.SIGKILL)
            self.coordinator.wait(10)

    def start_coordinator(self) -> None:
        """The coordinator on the run's database and a fixed port (the same one after a restart); no DHT of its own."""
        if not self.coordinator_port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.coordinator_port = int(s.getsockname()[1])
        ready = self.root / "coordinator.json"
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "swarmloco.coordinator", "--db", str(self.root / "coordinator.sqlite"),
                "--host", "127.0.0.1", "--port", str(self.coordinator_port), "--no-dht", "--ready-file", str(ready),
                "--run-id", self.cfg.run_id, "--admission", "invite"]
        with open(self.root / "coordinator.log", "ab") as log:
            self.coordinator = subprocess.Popen(argv, stdout=log, stderr=log, env=self.env, start_new_session=True)
        self.started.append(self.coordinator)
        self.coordinator_url = f"http://127.0.0.1:{self.coordinator_port}"
        deadline = time.monotonic() + 60
        while not ready.exists() and self.coordinator.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if not ready.exists():
            raise RuntimeError(f"coordinator did not start; see {self.root / 'coordinator.log'}")
        self.coordinator_invite = str(json.loads(ready.read_text()).get("invite") or "")  # the same after a restart

    def split(self, cut: bool) -> None:
        assert self.net is not None, "only a scenario with a split network cuts links"
        self.net.split(cut)

    def fault(self, kind: str, peer: str | None) -> None:
        self.faults.append({"t": round(time.time() - self.t0, 2), "kind": kind, "peer": peer})
        logger.info("fault at %.1fs: %s %s", time.time() - self.t0, kind, peer or "")

    # --- the run -------------------------------------------------------------------------------------------------
    def _peer_argv(self, index: int, workdir: Path, *, wait_for: int) -> list[str]:
        cfg = self.cfg
        quorum = cfg.quorum or max(2, cfg.peers // 2 + 1)
        host = "127.0.0.1" if self.net is None else self.net.address(index)
        argv = [sys.executable, "-m", "swarmloco.cli", "peer", "--preset", "tiny", "--batch-size", "4",
                "--threads", "1", "--warmup-steps", "5", "--inner-lr", "1e-3", "--inner-steps", str(cfg.inner_steps),
                "--slowdown", f"{cfg.slowdown:g}",
                "--grace-min", "0.3", "--grace-max", "3", "--round-timeout", f"{self.round_timeout:g}",
                "--exchange-timeout", "20", "--eval-every", "1000", "--checkpoint-every", "1", "--max-rounds", "0",
                "--quorum", str(quorum), "--workdir", str(workdir), "--shard-index", str(index),
                "--num-shards", str(cfg.peers), "--log-format", "json", "--summary-json", str(workdir / "summary.json"),
                "--host-maddr", f"/ip4/{host}/tcp/0", "--run-id", cfg.run_id, "--linger", "0",
                "--wait-for-peers", str(wait_for), "--seed", "0"]
        if self.coordinator_url:
            argv += ["--coordinator", self.coordinator_url, f"--invite={self.coordinator_invite}"]
        else:
            argv += ["--authority-key", str(self.root / AUTHORITY_KEY)]
        for maddr in self.bootstrap:
            argv += ["--initial-peer", maddr]
        return argv if self.net is None else self.net.prefix(index) + argv

    def _env(self, index: int) -> dict[str, str]:
        """A peer's environment: the run's, with the scenario's fault spec for this peer if it has one."""
        spec = dict(self.scenario.faults).get(index)
        return self.env if spec is None else {**self.env, "SWARMLOCO_FAULTS": spec}

    def _record(self, p: PeerProc) -> None:
        if p.proc is not None:
            self.peer_pids.add(p.proc.pid)

    def start(self) -> None:
        from swarmloco.protocol.network.dht_host import LocalDHT

        self.root.mkdir(parents=True, exist_ok=True)
        load_or_create_identity(self.root / AUTHORITY_KEY)
        if self.scenario.split:
            self.net = SplitNet(sides=tuple(int(i >= self.cfg.peers // 2) for i in range(self.cfg.peers)))
            self.net.create()
            proc, self.bootstrap = self.net.start_bootstrap(self.root, self.env)
            self.started.append(proc)
        else:
            self.bootstrap_dht = LocalDHT.on_own_thread(name="chaos-bootstrap", host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            self.bootstrap = [str(m) for m in self.bootstrap_dht.get_visible_maddrs()]
        if self.scenario.coordinator:
            self.start_coordinator()
        if self.cfg.spawn == "fork" and self.net is None:  # in a namespace, a peer is exec'd by `ip netns exec`
            self.zygote = Zygote(self.env)
        for i in range(self.cfg.peers):
            workdir = self.root / f"peer-{i}"
            p = PeerProc(i, workdir, self._peer_argv(i, workdir, wait_for=self.cfg.peers), spawner=self.zygote)
            p.start(self._env(i), resume=False)
            self._record(p)
            self.peers[f"peer-{i}"] = p
        deadline = time.monotonic() + self.cfg.join_timeout_s
        joined: set[str] = set()
        while len(joined) < len(self.peers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {sorted(joined)} joined within {self.cfg.join_timeout_s:.0f}s")
            time.sleep(0.5)
            self.sample()
            for name, p in self.peers.items():
                if any(e.get("event") == "joined" for e in p.read_events()) or name in joined:
                    joined.add(name)
                elif not p.alive():
                    raise RuntimeError(f"{name} exited before joining; see {p.workdir / 'stderr.log'}")
        self.t0 = time.time()
        for index, spec in self.scenario.faults:
            self.fault(spec, f"peer-{index}")  # armed from the start, in the peer's environment
        logger.info("all %d peers joined; %s for %.0fs", len(self.peers), self.scenario.name, self.cfg.duration_s)

    def sample(self) -> None:
        self.sampler.sample({name: p.proc.pid for name, p in self.peers.items() if p.alive() and p.proc is not None})

    def drive(self) -> None:
        driver = self.scenario.make(self.cfg.quick, self.cfg.seed)
        last_sample = 0.0
        try:
            while (t := time.time() - self.t0) < self.cfg.duration_s:
                driver.tick(self, t)
                for p in self.peers.values():
                    p.read_events()
                if time.monotonic() - last_sample >= 1.0:
                    last_sample = time.monotonic()
                    self.sample()
                time.sleep(0.5)
        finally:
            driver.close(self)

    def settle(self) -> dict[str, str] | None:
        """Wait (at most --settle s) until the live peers agree (`agreement`); their short hashes then, or None."""
        deadline = time.monotonic() + self.cfg.settle_s
        last_fault = self.t0 + (self.faults[-1]["t"] if self.faults else 0.0)
        while time.monotonic() < deadline:
            for p in self.peers.values():
                p.read_events()
            if (agreed := agreement({n: p for n, p in self.peers.items() if p.alive()}, last_fault)) is not None:
                return agreed
            self.sample()
            time.sleep(1.0)
        return None

    def stop(self) -> None:
        """Every process this run started, by the session created for it (peers: with their DHT child and p2pd)."""
        for p in self.peers.values():
            if p.alive():
                p.kill_group(signal.SIGCONT)  # a stopped peer cannot act on SIGTERM
                p.kill_group(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self.peers.values():
            if p.proc is not None:
                try:
                    p.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            p.kill_group(signal.SIGKILL)
            if p.proc is not None:
                try:
                    p.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            p.read_events()
        for proc in self.started:
            if proc.poll() is None:
                self.stop_process(proc)
        if self.zygote is not None:
            self.zygote.close()  # after its children: it reports their exits
        if self.bootstrap_dht is not None:
            self.bootstrap_dht.shutdown()
            self.bootstrap_dht = None
        if self.net is not None:
            self.net.close()

    def orphans(self, timeout: float = 15.0) -> list[int]:
        """Processes this run started (peers and all seen under them, burners, coordinators, our own children) still
        alive after cleanup."""
        ours = self.peer_pids | self.sampler.seen | {p.pid for p in self.started}
        ours |= {self.zygote.proc.pid} if self.zygote is not None else set()
        deadline = time.monotonic() + timeout
        while True:
            children = [pid for pid in descendants(os.getpid()) if SHM_MANAGER not in cmdline(pid)]
            alive = sorted(pid for pid in ours | set(children) if pid != os.getpid() and is_running(pid))
            if not alive or time.monotonic() > deadline:
                return alive
            for pid in alive:  # ours by pid: the sessions are gone, so kill what is left one by one
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.5)


def run_chaos_config(cfg: ChaosConfig) -> dict[str, Any]:
    """Run one scenario end to end and return (and write) its results; cleanup happens whatever goes wrong."""
    scenario = SCENARIOS[cfg.scenario]
    previous = set_aside_previous_run(cfg.workdir, markers=(AUTHORITY_KEY, "coordinator.sqlite", "chaos.json"))
    if previous is not None:
        logger.info("%s holds an earlier run: moved it to %s", cfg.workdir, previous)
    run = ChaosRun(cfg, scenario)
    error, agreed, stopped_at = None, None, time.time()
    try:
        run.start()
        run.drive()
        agreed = run.settle()
    except (TimeoutError, RuntimeError, NetnsError, KeyboardInterrupt) as exc:
        error = repr(exc)
        logger.error("chaos run failed: %s", error)
    finally:
        stopped_at = time.time()
        run.stop()
    left = run.orphans()
    fields = summary_fields(run.peers, run.t0, stopped_at)
    at_exit = {name: final_hash(p, run.t0) for name, p in run.peers.items()}
    live = {**at_exit, **(agreed or {})}  # the agreed state where the run settled; else each peer's state at exit
    result: dict[str, Any] = {
        "scenario": cfg.scenario, "quick": cfg.quick, "peers": cfg.peers, "duration_s": cfg.duration_s,
        "quorum": cfg.quorum or max(2, cfg.peers // 2 + 1), "round_timeout_s": cfg.round_timeout, **fields,
        "slowdown": cfg.slowdown, "spawn": "exec" if run.zygote is None else "fork", "settled": agreed is not None,
        "final_hashes": live, "exit_hashes": at_exit,
        "one_final_hash": len(set(live.values())) == 1 and None not in live.values(), "orphans": len(left),
        "orphan_cmdlines": [cmdline(pid) for pid in left], "faults": run.faults,
        "restarts": {name: p.restarts for name, p in run.peers.items()}, "per_peer": run.sampler.to_dict(),
        "error": error, "notes": run_notes(cfg.scenario, fields),
    }
    plot = cfg.json_out.with_suffix(".png")
    write_plot(plot, token_curve(agreed_rounds(run.peers), run.t0), [f["t"] for f in run.faults], stopped_at - run.t0)
    result["plot"] = str(plot)
    cfg.json_out.parent.mkdir(parents=True, exist_ok=True)
    cfg.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def run_chaos(args: argparse.Namespace) -> int:
    if args.action == "list" or not args.scenario:
        for name, s in SCENARIOS.items():
            print(f"{name:22} {s.help}")
        return 0 if args.action == "list" else 2
    if args.scenario not in SCENARIOS:
        print(f"unknown scenario {args.scenario!r}; one of: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    become_subreaper()  # orphans of SIGKILLed peers re-parent to us, where cleanup finds them
    signal.signal(signal.SIGTERM, raise_interrupt)
    scenario = SCENARIOS[args.scenario]
    workdir = Path(args.workdir)
    cfg = ChaosConfig(
        scenario=args.scenario, workdir=workdir, json_out=Path(args.json_out or workdir / "chaos.json"),
        peers=args.peers or scenario.peers, quick=args.quick, quorum=args.quorum, seed=args.seed,
        duration_s=args.duration or (scenario.quick_duration_s if args.quick else scenario.duration_s),
        settle_s=args.settle or (60.0 if args.quick else 90.0), round_timeout_s=args.round_timeout,
        inner_steps=args.inner_steps, slowdown=args.slowdown, spawn=args.spawn,
    )
    result = run_chaos_config(cfg)
    print(f"{cfg.scenario}: {result['rounds_committed']} rounds committed, goodput "
          f"{result['goodput_tokens_per_s']} tokens/s, {len(result['faults'])} faults, final hashes "
          f"{sorted(set(map(str, result['final_hashes'].values())))}, orphans {result['orphans']}; "
          f"wrote {cfg.json_out}", flush=True)
    ok = result["error"] is None and result["one_final_hash"] and result["orphans"] == 0
    return 0 if ok else 1

"""The chaos harness's scenarios: one small fault driver each, in a registry keyed by the scenario's name.

A driver is ticked by the run about twice a second with the seconds since the peers all joined; it injects its
faults through the run (`ChaosTarget`), which records each one as {t, kind, peer}, and `close` undoes whatever is
still in effect (a stopped peer is continued, burners are killed). Drivers only ever signal processes the run
started, by pid or by the session the run created for them.
"""
from __future__ import annotations

import argparse
import logging
import random
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from swarmloco.swarm_procs import Handle

logger = logging.getLogger(__name__)


class ChaosTarget(Protocol):
    """What a driver may do to a run: its peers, faults recorded, processes started beside the peers."""

    round_timeout: float

    def live_peers(self) -> list[str]: ...

    def kill_peer(self, name: str) -> None: ...

    def restart_peer(self, name: str) -> None: ...

    def signal_peer(self, name: str, sig: int) -> None: ...

    def leader_peer(self) -> str | None: ...

    def start_burner(self) -> subprocess.Popen[bytes]: ...

    def start_hostile(self, kind: str, index: int) -> Handle: ...

    def stop_process(self, proc: Handle) -> None: ...

    def kill_coordinator(self) -> None: ...

    def start_coordinator(self) -> None: ...

    def split(self, cut: bool) -> None: ...

    def fault(self, kind: str, peer: str | None) -> None: ...


class Driver(Protocol):
    def tick(self, run: ChaosTarget, t: float) -> None: ...

    def close(self, run: ChaosTarget) -> None: ...


@dataclass(kw_only=True)
class Steady:
    """No faults: the baseline a faulty run is compared with."""

    def tick(self, run: ChaosTarget, t: float) -> None:
        return

    def close(self, run: ChaosTarget) -> None:
        return


@dataclass(kw_only=True)
class Churn:
    """SIGKILL a random live peer every `every_s` seconds, and restart it at once on its own identity and workdir
    (it resumes from its checkpoint and rejoins)."""

    every_s: float
    seed: int = 0
    next_at: float = -1.0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        if self.next_at < 0:
            self.next_at = self.every_s

    def tick(self, run: ChaosTarget, t: float) -> None:
        if t < self.next_at:
            return
        self.next_at = t + self.every_s
        victims = run.live_peers()
        if not victims:
            return
        victim = self.rng.choice(victims)
        run.kill_peer(victim)
        run.fault("sigkill", victim)
        run.restart_peer(victim)
        run.fault("restart", victim)

    def close(self, run: ChaosTarget) -> None:
        return


@dataclass(kw_only=True)
class SigstopLeader:
    """At `at_s`, SIGSTOP the peer that leads the swarm's current round (as its event logs show it) for `rounds`
    round timeouts, then SIGCONT it."""

    at_s: float
    rounds: float = 2.0
    stopped: str | None = None
    until: float = 0.0
    done: bool = False

    def tick(self, run: ChaosTarget, t: float) -> None:
        if self.stopped is not None and t >= self.until:
            self._resume(run)
        if self.done or self.stopped is not None or t < self.at_s:
            return
        leader = run.leader_peer()
        if leader is None:  # no round has committed yet: nobody is known to lead; look again next tick
            return
        run.signal_peer(leader, signal.SIGSTOP)
        run.fault("sigstop", leader)
        self.stopped, self.until = leader, t + self.rounds * run.round_timeout

    def _resume(self, run: ChaosTarget) -> None:
        assert self.stopped is not None
        run.signal_peer(self.stopped, signal.SIGCONT)
        run.fault("sigcont", self.stopped)
        self.stopped, self.done = None, True

    def close(self, run: ChaosTarget) -> None:
        if self.stopped is not None:
            self._resume(run)


@dataclass(kw_only=True)
class Burners:
    """`count` CPU burner processes (`python -c "while True: pass"`) beside the peers for the whole run."""

    count: int = 2
    kind: str = "burner"
    procs: list[Handle] = field(default_factory=list)

    def start(self, run: ChaosTarget, index: int) -> Handle:
        return run.start_burner()

    def tick(self, run: ChaosTarget, t: float) -> None:
        while len(self.procs) < self.count:
            self.procs.append(self.start(run, len(self.procs)))
            run.fault(f"{self.kind}-start", None)

    def close(self, run: ChaosTarget) -> None:
        for proc in self.procs:
            run.stop_process(proc)
            run.fault(f"{self.kind}-stop", None)
        self.procs.clear()


@dataclass(kw_only=True)
class SilentClaimants(Burners):
    """`count` admitted peers that claim a far newer state than the swarm's and never answer a request for it, for
    the whole run (started and stopped as burners are)."""

    count: int = 3
    kind: str = "claimant"

    def start(self, run: ChaosTarget, index: int) -> Handle:
        return run.start_hostile(self.kind, index)


@dataclass(kw_only=True)
class ReadyHolder(SilentClaimants):
    """An admitted peer, ready at the honest peers' newest state the moment it appears and in their view, that trains
    nothing and holds whoever joins it in a group it never closes, for the whole run."""

    count: int = 1
    kind: str = "holder"


@dataclass(kw_only=True)
class CoordinatorRestart:
    """At `at_s`, SIGKILL the coordinator, and `down_s` later start it again on the same database and port."""

    at_s: float
    down_s: float = 3.0
    killed_at: float | None = None
    done: bool = False

    def tick(self, run: ChaosTarget, t: float) -> None:
        if self.done:
            return
        if self.killed_at is None and t >= self.at_s:
            run.kill_coordinator()
            run.fault("coordinator-kill", None)
            self.killed_at = t
        elif self.killed_at is not None and t >= self.killed_at + self.down_s:
            run.start_coordinator()
            run.fault("coordinator-start", None)
            self.done = True

    def close(self, run: ChaosTarget) -> None:
        return


@dataclass(kw_only=True)
class Partition:
    """At `at_s`, cut every link between the two halves of the swarm; `for_s` later, heal it. Peers stay up and keep
    their state; the halves can only find each other again over the healed links."""

    at_s: float
    for_s: float
    cut_at: float | None = None
    done: bool = False

    def tick(self, run: ChaosTarget, t: float) -> None:
        if self.done:
            return
        if self.cut_at is None and t >= self.at_s:
            run.split(True)
            run.fault("partition", None)
            self.cut_at = t
        elif self.cut_at is not None and t >= self.cut_at + self.for_s:
            self.close(run)

    def close(self, run: ChaosTarget) -> None:
        if self.cut_at is not None and not self.done:
            run.split(False)
            run.fault("heal", None)
            self.done = True


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """One chaos run's settings (`swarmloco chaos run`'s flags)."""

    scenario: str
    workdir: Path
    json_out: Path
    peers: int = 4
    duration_s: float = 180.0
    settle_s: float = 90.0
    join_timeout_s: float = 240.0
    quick: bool = False
    quorum: int = 0  # 0: a majority of the peers (at least 2)
    round_timeout_s: float = 0.0  # 0: 15 s with --quick, else 40 s
    inner_steps: int = 10
    slowdown: float = 1.0  # peers' --slowdown
    spawn: str = "fork"  # "fork": peers forked from one process that imported torch (not in split networks); "exec"
    run_id: str = "chaos"
    seed: int = 0
    plot: bool = True

    def __post_init__(self) -> None:
        if self.spawn not in ("fork", "exec"):
            raise ValueError(f"spawn: got {self.spawn!r}, allowed 'fork' or 'exec'")

    @property
    def round_timeout(self) -> float:
        return self.round_timeout_s or (15.0 if self.quick else 40.0)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    help: str
    make: Callable[[bool, int], Any]  # (quick, seed) -> a Driver
    peers: int = 4
    duration_s: float = 180.0
    quick_duration_s: float = 20.0  # --quick: long enough for a few rounds around each fault
    coordinator: bool = False
    split: bool = False  # each peer in a network namespace of its own, so links can be cut (needs root)
    faults: tuple[tuple[int, str], ...] = ()  # (peer index, SWARMLOCO_FAULTS spec): hostile peers of the scenario


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(name="steady", help="no faults (the baseline)", make=lambda quick, seed: Steady()),
        Scenario(name="churn-30s", help="SIGKILL a random peer every 30 s (6 s with --quick) and restart it",
                 make=lambda quick, seed: Churn(every_s=6.0 if quick else 30.0, seed=seed)),
        Scenario(name="sigstop-leader", help="SIGSTOP the current round's leader for two round timeouts",
                 make=lambda quick, seed: SigstopLeader(at_s=3.0 if quick else 20.0), quick_duration_s=36.0),
        Scenario(name="burners", help="two CPU burner processes beside the peers", make=lambda quick, seed: Burners()),
        Scenario(name="leader-staller", help="one peer that, in every view it leads, accepts members and never closes",
                 make=lambda quick, seed: Steady(), faults=((0, "lead=hold@*"),)),
        Scenario(name="reducer-withholder", help="one peer that, as a reducer, never sends its reduced shard",
                 make=lambda quick, seed: Steady(), faults=((3, "reduce=withhold@*"),)),
        Scenario(name="ready-holder", help="one admitted peer, ready at every new state at once, that holds whoever "
                 "joins it and trains nothing", make=lambda quick, seed: ReadyHolder()),
        Scenario(name="silent-claimants", help="three admitted peers claim a far newer state and never answer",
                 make=lambda quick, seed: SilentClaimants()),
        Scenario(name="partition-2-2", help="cut the links between two halves of the swarm for 60 s (12 s with "
                 "--quick), then heal; needs root", make=lambda quick, seed: Partition(
                     at_s=5.0 if quick else 30.0, for_s=12.0 if quick else 60.0),
                 split=True, duration_s=150.0, quick_duration_s=25.0),
        Scenario(name="coordinator-restart", help="kill the coordinator mid-run, restart it on the same db and port",
                 make=lambda quick, seed: CoordinatorRestart(at_s=10.0 if quick else 60.0), coordinator=True),
    )
}


def _slowdown(text: str) -> float:
    value = float(text)
    if not 1.0 <= value <= 100.0:
        raise argparse.ArgumentTypeError(f"{text} is not in 1 .. 100")
    return value


def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("action", choices=("run", "list"), help="run a scenario, or list the scenarios")
    add("scenario", nargs="?", default="", help=f"one of: {', '.join(SCENARIOS)}")
    add("--workdir", default="runs/chaos", help="per-peer workdirs and logs go here (emptied first)")
    add("--json", dest="json_out", default=None, help="write the results here (default: WORKDIR/chaos.json)")
    add("--peers", type=int, default=0, help="peer processes (0: the scenario's default, 4)")
    add("--duration", type=float, default=0.0, help="seconds of faults once all peers joined (0: the scenario's)")
    add("--settle", type=float, default=0.0, help="then wait at most this long for one final state (0: 60/90 s)")
    add("--quick", action="store_true", help="short intervals and durations, for tests")
    add("--quorum", type=int, default=0, help="peers' --quorum (0: a majority, at least 2; lock-step: --peers)")
    add("--round-timeout", type=float, default=0.0, help="peers' --round-timeout (0: 15 s quick, 40 s otherwise)")
    add("--inner-steps", type=int, default=10, help="peers' --inner-steps")
    add("--slowdown", type=_slowdown, default=1.0, help="peers' --slowdown: each sleeps (x - 1) times every step's "
        "time after it, as slower hardware would, and leaves the rest of the CPU to other work (the tests use 3)")
    add("--spawn", choices=("fork", "exec"), default="fork", help="fork the peers from one process that imported "
        "torch once (a scenario that cuts links always execs each peer in its network namespace), or exec each")
    add("--seed", type=int, default=0, help="seed of the scenario's random choices")

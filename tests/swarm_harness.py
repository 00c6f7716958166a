"""Real multi-process swarms on 127.0.0.1 for integration tests: a bootstrap DHT, peer processes in their own
sessions (SIGKILL takes their DHT process and p2pd along), JSON event logs, and cleanup that proves nothing is left."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import hivemind
from conftest import _SHM_MANAGER, ROOT, _cmdline, _descendants

from swarmloco.protocol.round.schedule import view_rank
from swarmloco.protocol.trust.identity import load_or_create_identity
from swarmloco.swarm import PeerProc

# The harness's model: "nano" exercises the protocol at a seventh of tiny's compute per step. A test whose checks
# were calibrated on tiny's losses (test_poisoning.py) or need a state of several MiB (test_round_dos.py) asks for
# tiny: `@pytest.mark.preset("tiny")` on the test or module.
PRESET = "nano"
FAST = [
    "--batch-size",
    "4",
    "--threads",
    "1",
    "--warmup-steps",
    "5",
    "--inner-lr",
    "1e-3",
    "--grace-min",
    "0.3",
    "--grace-max",
    "3",
    "--round-timeout",
    "40",
    "--exchange-timeout",
    "20",
    "--eval-every",  # the summary still evaluates the final state; a test that needs a loss per round asks for it
    "1000",
    "--checkpoint-every",
    "0",
]


def replica(preset: str = PRESET) -> Any:
    """A replica of the harness's model at θ_0 (seed 0), as every peer of a swarm with `preset` builds it."""
    from swarmloco.peer.cli import build_replica
    from swarmloco.peer.config import build_config

    return build_replica(build_config(env={"SWARMLOCO_PRESET": preset}))


def genesis_hash(preset: str = PRESET) -> str:
    """θ_0's hash for the harness's model, as every peer computes it."""
    from swarmloco.peer.swarm_state import genesis_hash as of_replica

    return of_replica(replica(preset))


class Swarm:
    """Peers of one permissioned run: every peer started here signs its own ticket with the run's authority key
    (a test's attacker is started without it, or with `admitted=True` to play an admitted peer gone bad)."""

    def __init__(self, workdir: Path, *, run_id: str = "test-run", spawner: Any = None, preset: str = PRESET) -> None:
        """`spawner`: a `swarmloco.zygote.Zygote` to fork peers from (one import of torch for every peer of the
        session), or None to start each peer as a fresh interpreter. `preset`: every peer's model."""
        self.workdir, self.run_id, self.spawner, self.preset = workdir, run_id, spawner, preset
        self.authority_key = workdir / "authority.key"
        self.authority = load_or_create_identity(self.authority_key).peer_id
        self._genesis: str | None = None
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        self.env.pop("SWARMLOCO_FAULTS", None)
        self.dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.bootstrap = [str(m) for m in self.dht.get_visible_maddrs()]
        self.peers: dict[str, PeerProc] = {}

    def identities(self, n: int) -> list[tuple[str, Path]]:
        """n identity files in leader order of the first round (the best-ranked ready peer leads it)."""
        if self._genesis is None:
            self._genesis = genesis_hash(self.preset)
        out = []
        for i in range(n):
            path = self.workdir / f"id-{i}.key"
            out.append((load_or_create_identity(path).peer_id, path))
        return sorted(out, key=lambda item: view_rank(self._genesis, 0, item[0]))  # type: ignore[arg-type]

    def start(
        self,
        name: str,
        *args: str,
        identity: Path | None = None,
        faults: str = "",
        rounds: int = 3,
        inner_steps: int = 10,
        quorum: int = 2,
        resume: bool = False,
        wait_for: int = 0,
        admitted: bool = True,
        bootstrap: list[str] | None = None,
    ) -> PeerProc:
        workdir = self.workdir / name
        argv = [
            sys.executable,
            "-m",
            "swarmloco.cli",
            "peer",
            "--preset",
            self.preset,
            *FAST,
            "--max-rounds",
            str(rounds),
            "--inner-steps",
            str(inner_steps),
            "--quorum",
            str(quorum),
            "--workdir",
            str(workdir),
            "--log-format",
            "json",
            "--summary-json",
            str(workdir / "summary.json"),
            "--host-maddr",
            "/ip4/127.0.0.1/tcp/0",
            "--run-id",
            self.run_id,
            "--linger",
            "8",
            "--wait-for-peers",
            str(wait_for),
            *args,
        ]
        if identity is not None:
            argv += ["--identity", str(identity)]
        argv += ["--authority-key", str(self.authority_key)] if admitted else ["--authority", self.authority]
        for maddr in self.bootstrap if bootstrap is None else bootstrap:
            argv += ["--initial-peer", maddr]
        peer = self.peers.get(name) or PeerProc(len(self.peers), workdir, argv, spawner=self.spawner)
        peer.argv = argv
        env = dict(self.env, SWARMLOCO_FAULTS=faults) if faults else self.env
        peer.start(env, resume=resume)
        self.peers[name] = peer
        return peer

    def events(self, name: str, kind: str | None = None) -> list[dict[str, Any]]:
        peer = self.peers[name]
        peer.read_events()
        return [e for e in peer.events if kind is None or e.get("event") == kind]

    def committed(self, name: str) -> dict[int, str]:
        """round -> full state hash, for every round this peer committed."""
        return {
            int(e["round"]): e["state_hash_full"] for e in self.events(name, "round") if e.get("outcome") == "committed"
        }

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; logs: {self.tails()}")

    def wait_exit(self, timeout: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        for p in self.peers.values():
            if p.proc is not None and p.proc.poll() is None:
                try:
                    p.proc.wait(max(0.1, deadline - time.monotonic()))
                except Exception:  # reported through the return codes below
                    pass
        return {name: (p.proc.poll() if p.proc else None) for name, p in self.peers.items()}

    def stop(self, names: Iterable[str], timeout: float = 120) -> dict[str, int | None]:
        """SIGTERM the named peers (a clean shutdown: each finishes or gives up its round and writes its summary),
        then wait for every peer to exit; returns every peer's exit code, as `wait_exit`."""
        for name in names:
            self.peers[name].proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        return self.wait_exit(timeout)

    def summary(self, name: str) -> dict[str, Any]:
        return json.loads((self.peers[name].workdir / "summary.json").read_text())

    def tails(self) -> str:
        out = []
        for name, p in self.peers.items():
            err = p.workdir / "stderr.log"
            text = err.read_text()[-1500:] if err.exists() else ""
            out.append(f"--- {name} rc={p.proc.poll() if p.proc else None}\n{text}")
        return "\n".join(out)

    def close(self) -> None:
        for p in self.peers.values():
            if p.alive():
                p.kill_group(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self.peers.values():
            if p.proc is not None:
                try:
                    p.proc.wait(max(0.1, deadline - time.monotonic()))
                except Exception:
                    pass
            p.kill_group(signal.SIGKILL)
        self.dht.shutdown()

    def assert_nothing_left(self, timeout: float = 20.0) -> None:
        """No process this test started — peers, their DHT processes, p2pd — is still alive."""
        server = self.spawner.proc.pid if self.spawner is not None else -1  # the session's fork server stays
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # torch's shared-memory manager belongs to this test process (hivemind's DHT here) and ends with it.
            alive = [pid for pid in _descendants(os.getpid()) if _is_running(pid) and _SHM_MANAGER not in _cmdline(pid)
                     and pid != server]
            if not alive:
                return
            time.sleep(0.5)
        raise AssertionError(f"processes left running: {[_cmdline(pid) for pid in alive]}")


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_no_split(swarm: Swarm, names: list[str]) -> dict[int, str]:
    """Every round committed by any of these peers has exactly one state hash."""
    by_round: dict[int, set[str]] = {}
    for name in names:
        for rnd, h in swarm.committed(name).items():
            by_round.setdefault(rnd, set()).add(h)
    split = {r: hs for r, hs in by_round.items() if len(hs) > 1}
    assert not split, f"rounds with different states: {split}"
    return {r: next(iter(hs)) for r, hs in by_round.items()}

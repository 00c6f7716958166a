"""Contribution and cost accounting over real processes: a coordinator with a price table and three peers that join
by URL; one peer is killed while it holds local work the coordinator knows about.

The per-peer verified tokens must add up to the tokens of the certified rounds; the killed peer's unmerged work must
show as wasted once it is no longer online; every peer's account must hold its device kind, seconds, bytes and rounds;
the run must have a cost, a goodput and an eval-loss curve; and `swarmloco status` must print the contributors.

Everything runs on 127.0.0.1; each process the test starts runs in a session of its own and is ended by pid."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _coordinator_helpers import ROOT, child_env, join_peer, run_config, run_coordinator
from test_coordinator_e2e import get, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

RUN_CONFIG = run_config(inner_steps=12, seed=5)
PEERS, ROUNDS = 3, 4


def _joined(log: Path) -> str | None:
    """The peer id in a peer's 'joined' event (its JSON log on stdout), once it is there."""
    for line in log.read_text().splitlines() if log.exists() else []:
        if line.startswith('{"event": "joined"'):
            return str(json.loads(line)["peer_id"])
    return None


def _certified_without(url: str, peer_id: str, after: int) -> bool:
    rounds = get(url, "/api/rounds", run_id="joined", limit=1000)["items"]
    return any(r["certified"] and r["round"] > after and peer_id not in r["members"] for r in rounds)


def _victim(url: str, peers: dict[str, subprocess.Popen[bytes]]) -> tuple[str, int]:
    """Freeze a peer that holds reported work (SIGSTOP: it sends nothing more) until the others certify a round
    without it: by then no round can still merge what it held, and the coordinator knows what that was. Kill it if
    that is above 0, let it go on otherwise. Returns (peer id, its unmerged work as the coordinator holds it)."""
    def attempt() -> tuple[str, int] | None:
        rows = {p["peer_id"]: p for p in get(url, "/api/peers", run_id="joined")["items"]}
        ready = [pid for pid, p in rows.items() if pid in peers and p["pending_tokens"] > 0 and p["credited_rounds"]]
        if not ready:
            return None
        peer_id = ready[0]
        rounds = get(url, "/api/rounds", run_id="joined", limit=1000)["items"]
        last = max((r["round"] for r in rounds if r["certified"]), default=0)
        os.killpg(peers[peer_id].pid, signal.SIGSTOP)
        try:
            wait_for(lambda: _certified_without(url, peer_id, last), 90, "a round certified without the frozen peer")
        except AssertionError:  # the run ended meanwhile: no kill
            os.killpg(peers[peer_id].pid, signal.SIGCONT)
            raise
        pending = get(url, "/api/peers", run_id="joined", peer_id=peer_id)["items"][0]["pending_tokens"]
        if pending > 0:
            os.killpg(peers[peer_id].pid, signal.SIGKILL)
            peers[peer_id].wait(10)
            return peer_id, pending
        os.killpg(peers[peer_id].pid, signal.SIGCONT)
        return None

    return wait_for(attempt, 240, "a peer holding reported, unmerged work", every=0.3)


def test_three_peers_and_a_kill_are_accounted(tmp_path: Path) -> None:
    with run_coordinator(tmp_path, RUN_CONFIG, "--price", "cpu=0.5", "--online-window-s", "8") as coordinator:
        url = coordinator["url"]
        # --slowdown stretches each step (sleeping) so that a round spans the peers' 5 s metrics reports
        procs = [join_peer(url, tmp_path, i, PEERS, "--max-rounds", str(ROUNDS), "--slowdown", "8")
                 for i in range(PEERS)]
        coordinator["procs"].extend(procs)
        ids = [wait_for(lambda i=i: _joined(tmp_path / f"peer-{i}.log"), 120, f"peer-{i} joined")
               for i in range(PEERS)]
        by_id = dict(zip(ids, procs, strict=True))
        killed, pending = _victim(url, dict(by_id))
        for peer_id, proc in by_id.items():
            if peer_id != killed:
                assert proc.wait(300) == 0, (tmp_path / f"peer-{ids.index(peer_id)}.log").read_text()[-4000:]
        wait_for(lambda: not get(url, "/api/peers", run_id="joined", peer_id=killed)["items"][0]["online"], 60,
                 "the killed peer to fall out of the online window")

        peers = {p["peer_id"]: p for p in get(url, "/api/peers", run_id="joined")["items"]}
        rounds = get(url, "/api/rounds", run_id="joined", limit=1000)["items"]
        certified = [r for r in rounds if r["certified"]]
        assert len(certified) >= ROUNDS
        assert sum(p["credited_tokens"] for p in peers.values()) == sum(r["tokens_total"] for r in certified)
        assert peers[killed]["wasted_tokens"] >= pending > 0 and peers[killed]["device_kind"] == "cpu", peers[killed]
        for peer_id, p in peers.items():  # the killed peer's own round reports may never have been sent
            if peer_id != killed:
                assert p["device_kind"] == "cpu" and p["device_s"] > 0 and 0 < p["compute_s"] <= p["device_s"], p
                assert p["rounds_joined"] >= ROUNDS - 1 and p["bytes_sent"] > 0 and p["bytes_received"] > 0, p
        assert sum(p["rounds_led"] for p in peers.values()) >= len(certified) - 2  # the killed peer's word is missing
        run = get(url, "/api/accounting", run_id="joined")
        assert run["verified_tokens"] == sum(r["tokens_total"] for r in certified)
        assert run["wasted_tokens"] >= pending and run["goodput_tokens_per_s"] > 0
        assert run["cost"] == pytest.approx(0.5 * run["device_hours"]["cpu"]) and run["cost"] > 0
        tokens = [p["tokens"] for p in run["progress"]]
        assert tokens == sorted(tokens) and tokens[-1] == run["verified_tokens"]
        assert sum(p["eval_loss"] is not None for p in run["progress"]) >= 2

        status = subprocess.run([sys.executable, "-m", "swarmloco.cli", "status", "--coordinator", url], cwd=ROOT,
                                env=child_env(), capture_output=True, text=True, timeout=60, check=False)
        assert status.returncode == 0, status.stderr[-2000:]
        table = status.stdout[status.stdout.index("contributor"):]
        assert all(peer_id[-12:] in table for peer_id in ids), status.stdout
        assert f"{run['verified_tokens']:,} verified" in status.stdout and "cost " in status.stdout

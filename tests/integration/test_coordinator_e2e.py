"""Coordinator end to end, with real swarms (`swarmloco swarm`) reporting to a real coordinator process.

(a) `swarmloco swarm --peers 3 --rounds 3` with the coordinator it starts itself: `/api/rounds` lists the rounds
    with the members and state hashes of the swarm's summary, `/metrics` counts them, `swarmloco status` prints
    them, and `/api/checkpoint` vouches for the last one with each member's credited work.
(b) After round 3 the coordinator hangs (SIGSTOP), then dies (SIGKILL), and is restarted on the same port and
    database some seconds later: training goes on at the same speed meanwhile, and every round done during the
    outage shows up once it is back, reported by every member exactly once.

Everything runs on 127.0.0.1 with free ports. Each test kills, by pid, every process it started (the swarm launcher
and the coordinator run in their own sessions; peers that outlive their launcher re-parent to pytest, which conftest
makes a child subreaper) and then checks that none is left.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import requests
from _coordinator_helpers import ROOT, alive, child_env, descendants
from swarm_harness import PRESET

pytestmark = [pytest.mark.integration]

T = TypeVar("T")

# Small, quick peers (same spirit as swarm_harness.FAST, expressed as launcher --peer-arg flags).
PEER_ARGS = ["--peer-arg=--batch-size=4", "--peer-arg=--warmup-steps=5", "--peer-arg=--inner-lr=1e-3",
             "--peer-arg=--grace-max=3", "--peer-arg=--round-timeout=60", "--peer-arg=--eval-every=1",
             "--peer-arg=--checkpoint-every=0"]


class Procs:
    """Processes one test started, each in its own session; :meth:`close` ends them and everything they left."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.baseline = set(descendants(os.getpid()))
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, cwd=ROOT, env=dict(child_env(), PYTHONFAULTHANDLER="1"), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def coordinator(self, db: Path, run_id: str, *extra: str, port: int = 0, timeout: float = 90.0,
                    ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
        """``python -m swarmloco.coordinator`` without a DHT node (the swarm launcher runs its own bootstrap node);
        invite-only, the default: its ready file, returned, has the ``invite`` code it generated."""
        ready = self.workdir / "coordinator.ready.json"
        ready.unlink(missing_ok=True)
        proc = self.spawn([sys.executable, "-m", "swarmloco.coordinator", "--db", str(db), "--host", "127.0.0.1",
                           "--port", str(port), "--ready-file", str(ready), "--run-id", run_id, "--no-dht",
                           "--log-level", "WARNING", *extra], self.workdir / "coordinator.log")
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("coordinator did not start: "
                                     + (self.workdir / "coordinator.log").read_text()[-3000:])
            time.sleep(0.05)
        return proc, json.loads(ready.read_text())

    def swarm(self, workdir: Path, *args: str) -> subprocess.Popen[bytes]:
        """``swarmloco swarm`` (swarmloco.cli) writing per-peer logs under ``workdir``; output in ``workdir``.log."""
        workdir.mkdir(parents=True, exist_ok=True)
        return self.spawn([sys.executable, "-m", "swarmloco.cli", "swarm", "--workdir", str(workdir), *args],
                          workdir.with_suffix(".log"))

    def close(self) -> None:
        # The launcher stops its peers (and its own coordinator) on Ctrl-C; a coordinator stops on SIGTERM.
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # in case a test left it stopped
                os.kill(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 45
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:  # whatever is left in the sessions we created
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(10)
        left: list[int] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            left = [p for p in descendants(os.getpid()) if p not in self.baseline and alive(p)]
            if not left:
                return
            for pid in left:  # orphans of our processes (peers, their DHT processes, p2pd) re-parented to us
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        raise AssertionError(f"processes left running: {[_cmdline(p) for p in left]}")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    except OSError:
        return str(pid)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


def wait_for(check: Callable[[], T | None], timeout: float, what: str, *, every: float = 0.5) -> T:
    """Poll ``check`` until it returns something other than None/False; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except (requests.RequestException, OSError, ValueError):
            value = None
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def get(url: str, path: str, **params: Any) -> Any:
    resp = requests.get(url + path, params=params, timeout=10)
    resp.raise_for_status()
    return resp.json() if path.startswith("/api") else resp.text


def all_rounds(url: str, run_id: str) -> list[dict[str, Any]]:
    items, cursor = [], None
    while True:
        page = get(url, "/api/rounds", run_id=run_id, limit=1000, **({"cursor": cursor} if cursor else {}))
        items += page["items"]
        if page["next_cursor"] is None:
            return items
        cursor = page["next_cursor"]


def peer_events(workdir: Path, kind: str) -> list[dict[str, Any]]:
    """The JSON log events of one peer (``workdir`` = the launcher's peer-N folder); torn last lines skipped."""
    log = workdir / "log.jsonl"
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("event") == kind:
            out.append(event)
    return out


def peer_ids(workdir: Path, n: int) -> dict[str, str]:
    """peer-N -> libp2p peer id, from each peer's 'joined' event."""
    return {f"peer-{i}": peer_events(workdir / f"peer-{i}", "joined")[0]["peer_id"] for i in range(n)}


def finished(proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Wait for the swarm launcher to exit 0; if it hangs, fail with every hung process's Python stacks."""
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        hung = [pid for pid in [proc.pid, *descendants(proc.pid)] if "swarmloco.cli" in _cmdline(pid)]
        names = [f"{pid}: {_cmdline(pid)[40:100]}" for pid in hung]
        for pid in hung:  # faulthandler (PYTHONFAULTHANDLER=1) prints all threads' stacks on SIGABRT
            os.kill(pid, signal.SIGABRT)
        time.sleep(3)
        tails = [f"--- {p.parent.name}/{p.name}\n{p.read_text()[-6000:]}"
                 for p in sorted(log.with_suffix("").glob("peer-*/*.log"))]
        raise AssertionError(f"swarm still running after {timeout:.0f}s ({names}):\n"
                             f"{log.read_text()[-6000:]}\n" + "\n".join(tails)) from None
    assert rc == 0, f"swarm exited with {rc}: {log.read_text()[-3000:]}"


@pytest.mark.timeout(300)
def test_swarm_with_its_own_coordinator(procs: Procs, tmp_path: Path) -> None:
    """(a) The default `swarmloco swarm` starts a coordinator, prints its dashboard URL, and its peers report there:
    the rounds it lists are the rounds of the swarm's summary. Checked live, and from the database afterwards."""
    work, summary_path = tmp_path / "swarm", tmp_path / "summary.json"
    swarm = procs.swarm(work, "--peers", "3", "--preset", PRESET, "--rounds", "3", "--inner-steps", "10",
                        "--run-id", "e2e-a", "--summary-json", str(summary_path), *PEER_ARGS)
    log = work.with_suffix(".log")

    def dashboard_url() -> str | None:
        for line in log.read_text().splitlines():
            if line.startswith("coordinator: dashboard at "):
                return line.split()[3].rstrip("/")
        return None

    url = wait_for(dashboard_url, 120, "the launcher to print the dashboard URL")
    assert url.startswith("http://127.0.0.1:")
    page = requests.get(url + "/", timeout=10)
    assert page.status_code == 200 and "chart-train" in page.text
    # live: the launcher's coordinator lists committed rounds while the swarm trains
    live = wait_for(lambda: [r for r in get(url, "/api/rounds", run_id="e2e-a")["items"]
                             if r["outcome"] == "committed"] or None, 200, "a committed round on the live coordinator")
    assert live[0]["state_hash"] and len(live[0]["members"]) == 3
    finished(swarm, log, 240)
    summary = json.loads(summary_path.read_text())
    ids = peer_ids(work, 3)

    # afterwards: the launcher stopped its coordinator; its database holds the whole run
    url = procs.coordinator(work / "coordinator.sqlite", "e2e-a")[1]["url"]
    rounds = all_rounds(url, "e2e-a")
    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3]
    assert sorted((r["round"], r["outcome"]) for r in rounds) == [(n, "committed") for n in (1, 2, 3)], rounds
    for expected, got in zip(summary["rounds"], sorted(rounds, key=lambda r: r["round"]), strict=False):
        (state_hash,) = set(expected["hashes"].values())
        assert got["state_hash"] == state_hash, (expected, got)
        # the members a round's certificate names (a late peer may sit a round out)
        assert set(got["members"]) <= set(ids.values()) and len(got["members"]) == expected["members"], got
        assert got["certified"] and sorted(got["reporters"]) == sorted(got["members"]), got  # each member, once
        assert sorted(got["tokens"]) == sorted(expected["weights"]), (expected, got)
        assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-3)
    peers = get(url, "/api/peers", run_id="e2e-a")["items"]
    assert sorted(p["peer_id"] for p in peers) == sorted(ids.values())
    for p in peers:
        assert p["rounds_committed"] == sum(p["peer_id"] in r["members"] for r in rounds), p
        assert p["rounds_committed"] >= 1 and p["tokens_total"] > 0 and p["device"], p
        assert p["last_train_loss"] is not None, p  # an eval-only sample must not blank the last training loss
        assert p["left_at"] is not None, p  # each peer said bye when it finished

    credited = _assert_checkpoint(url, summary, rounds, ids)
    assert {p["peer_id"]: p["credited_tokens"] for p in peers} == credited

    prom = get(url, "/metrics")
    assert 'swarmloco_rounds_total{outcome="committed"} 3.0' in prom, prom
    reports = float(sum(len(r["members"]) for r in rounds))
    assert f"swarmloco_round_duration_seconds_count {reports}" in prom, prom  # one per member and round

    status = subprocess.run([sys.executable, "-m", "swarmloco.cli", "status", "--coordinator", url], cwd=ROOT,
                            env=child_env(), capture_output=True, text=True, timeout=60, check=False)
    assert status.returncode == 0, status.stderr
    out = status.stdout
    assert "run e2e-a: 0 of 3 peers online" in out, out
    for pid in ids.values():
        assert pid[-12:] in out, out
    for rec in summary["rounds"]:
        line = next(x for x in out.splitlines() if x.split()[:2] == [str(rec["round"]), "committed"])
        assert next(iter(rec["hashes"].values()))[:12] in line, line


def _assert_checkpoint(url: str, summary: dict[str, Any], rounds: list[dict[str, Any]],
                       ids: dict[str, str]) -> dict[str, int]:
    """The authority vouches for the run's last round, and for the tokens each member was credited on that chain;
    returns those per peer."""
    checkpoint, (last,) = get(url, "/api/checkpoint"), summary["rounds"][-1:]
    assert (checkpoint["round"], checkpoint["state_hash"]) == (last["round"], next(iter(last["hashes"].values())))
    credited = {p: sum(c for r in rounds for m, c in zip(r["members"], r["tokens"], strict=True) if m == p)
                for p in ids.values()}
    assert {p: t for p, t, _ in checkpoint["seniors"]} == {p: t for p, t in credited.items() if t}, checkpoint
    return credited


def _round_speed(workdir: Path, n: int, lo: float, hi: float) -> tuple[list[float], list[float]]:
    """For the committed rounds the n peers logged within wall-clock [lo, hi]: each round's train_s (inner steps
    only) and each gap between a peer's consecutive rounds (the whole loop, reporting calls included)."""
    train, gaps = [], []
    for i in range(n):
        events = [e for e in peer_events(workdir / f"peer-{i}", "round") if e.get("outcome") == "committed"]
        train += [e["train_s"] for e in events if lo <= e["time"] - e["train_s"] and e["time"] <= hi]
        gaps += [b["time"] - a["time"] for a, b in itertools.pairwise(events)
                 if b["round"] == a["round"] + 1 and lo <= a["time"] and b["time"] <= hi]
    return train, gaps


@pytest.mark.timeout(420)
def test_coordinator_down_mid_run(procs: Procs, tmp_path: Path) -> None:
    """(b) After round 3 the coordinator hangs (SIGSTOP: connections are accepted, never answered), then dies
    (SIGKILL: connections refused), and comes back on the same port and database: the peers train on at the same
    speed meanwhile, and the rounds done during the outage arrive once it is back, each exactly once."""
    db, run_id, peers, total = tmp_path / "coordinator.sqlite", "e2e-b", 2, 11
    coord, info = procs.coordinator(db, run_id)
    url, port = info["url"], info["port"]
    work = tmp_path / "swarm"
    swarm = procs.swarm(
        work,
        "--peers",
        str(peers),
        "--rounds",
        str(total),
        "--inner-steps",
        "12",
        "--coordinator",
        url,
        "--run-id",
        run_id,
        "--summary-json",
        str(tmp_path / "summary.json"),
        f"--peer-arg=--invite={info['invite']}",  # the coordinator is invite-only: the code it generated
        *PEER_ARGS,
        "--peer-arg=--eval-every=1000",  # (this test reads no eval loss: evaluating every round only slows it)
    )
    log = work.with_suffix(".log")

    def committed(i: int) -> list[int]:
        return [e["round"] for e in peer_events(work / f"peer-{i}", "round") if e.get("outcome") == "committed"]

    # rounds 1-3 give the reference speed; 3 has reached the coordinator, so what it lacks later came meanwhile
    wait_for(lambda: all(3 in committed(i) for i in range(peers)), 240, "round 3 on every peer")
    wait_for(
        lambda: any(r["round"] == 3 for r in get(url, "/api/rounds", run_id=run_id)["items"]),
        60,
        "round 3 on the coordinator",
    )
    # long enough for a few whole rounds at the speed this machine has right now
    outage = min(30.0, max(10.0, 4 * statistics.median(_round_speed(work, peers, 0, time.time())[1])))
    down_at = time.time()
    os.kill(coord.pid, signal.SIGSTOP)
    time.sleep(outage / 2)
    os.kill(coord.pid, signal.SIGKILL)
    coord.wait(10)
    time.sleep(outage / 2)
    coord, info = procs.coordinator(db, run_id, port=port)
    back_at = time.time()
    assert info["url"] == url
    finished(swarm, log, 240)

    # Speed: rounds the peers did while the coordinator was down vs the rounds outside the outage. Loose (2x plus
    # 1.5 s per round) because other work on this machine also changes the speed; a reporter that waited for the
    # hung coordinator would add its 5 s read timeout to every round.
    train_out = _round_speed(work, peers, 0, down_at)[0] + _round_speed(work, peers, back_at, math.inf)[0]
    gaps_out = _round_speed(work, peers, 0, down_at)[1] + _round_speed(work, peers, back_at, math.inf)[1]
    train_during, gaps_during = _round_speed(work, peers, down_at, back_at)
    where = (
        f"outage {down_at:.1f}..{back_at:.1f} ({outage:.0f}s + restart): train_s {train_out} vs "
        f"{train_during}, gaps {gaps_out} vs {gaps_during}"
    )
    assert train_out and train_during and gaps_out and gaps_during, where
    assert statistics.median(train_during) < 2 * statistics.median(train_out) + 1.5, where
    assert statistics.median(gaps_during) < 2 * statistics.median(gaps_out) + 1.5, where

    ids = peer_ids(work, peers)
    done = {r for i in range(peers) for r in committed(i)}
    assert done == set(range(1, total + 1)), done
    missed = {
        e["round"]
        for i in range(peers)
        for e in peer_events(work / f"peer-{i}", "round")
        if e.get("outcome") == "committed" and down_at + 1 <= e["time"] <= back_at
    }
    assert missed, "no round was committed while the coordinator was down"

    def all_reported() -> list[dict[str, Any]] | None:
        rounds = [r for r in all_rounds(url, run_id) if r["outcome"] == "committed"]
        got = {r["round"] for r in rounds if sorted(r["reporters"]) == sorted(ids.values())}
        return rounds if got == done else None

    rounds = wait_for(all_reported, 90, "every committed round reported by every peer")
    assert sorted(r["round"] for r in rounds) == sorted(done), rounds  # one row per round: no duplicates
    for r in rounds:
        assert len(r["reporters"]) == len(set(r["reporters"])) == peers, r
        assert sorted(r["members"]) == sorted(ids.values()) and r["state_hash"], r
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {r["round"]: next(iter(r["hashes"].values())) for r in summary["rounds"]} == {
        r["round"]: r["state_hash"] for r in rounds
    }
    _assert_checkpoint(url, summary, rounds, ids)  # vouched for across the outage and the restart

    prom = get(url, "/metrics")
    assert f'swarmloco_rounds_total{{outcome="committed"}} {float(total)}' in prom, prom

    # The ledger: one round report per (peer, round), and those of the outage arrived after the restart.
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT peer_id, json_extract(body, '$.round'), received_at FROM reports "
            "WHERE kind = 'round' AND run_id = ?",
            (run_id,),
        ).fetchall()
    conn.close()
    keys = [(peer, rnd) for peer, rnd, _ in rows]
    assert len(keys) == len(set(keys)) == peers * total, sorted(keys)
    late = {rnd for _, rnd, received in rows if received >= back_at - 1}
    assert missed <= late, (missed, late)

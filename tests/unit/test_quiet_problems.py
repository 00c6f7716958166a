"""The quieter first-hour problems, each said once and in plain words: a coordinator that cannot be reached, round
lines a person can read, rounds without a group, an earlier checkpoint, and where a local swarm stands."""
from __future__ import annotations

import argparse
import io
import logging
import time
from pathlib import Path

import pytest

from swarmloco.peer.config import PeerConfig, RunConfig
from swarmloco.peer.preflight import set_aside_checkpoint
from swarmloco.peer.progress import Progress
from swarmloco.peer.report_sender import ReportSender, ReportSenderConfig
from swarmloco.peer.round_reports import RoundReports
from swarmloco.protocol.trust.identity import load_or_create_identity
from swarmloco.swarm import Swarm

ID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def test_unreachable_coordinator_is_said_at_the_first_failure(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    config = ReportSenderConfig(backoff_initial_s=0.01, backoff_max_s=0.02, heartbeat_interval_s=0)
    reporter = ReportSender("http://127.0.0.1:9", load_or_create_identity(tmp_path / "id.key"), "run", config=config)
    with caplog.at_level(logging.WARNING, logger="swarmloco.peer.report_sender"):
        reporter.start()
        reporter.heartbeat(round=1)
        deadline = time.monotonic() + 10
        while reporter.stats.attempts_failed < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        reporter.close(timeout=0.5, reason=None)
    said = [r.getMessage() for r in caplog.records if "cannot reach the coordinator" in r.getMessage()]
    assert reporter.stats.attempts_failed >= 3 and len(said) == 1, said
    assert "http://127.0.0.1:9 (ConnectionError): training goes on" in said[0] and "check --coordinator" in said[0]


def test_text_round_line_is_short_and_the_json_line_complete() -> None:
    fields = {"round": 3, "leader": ID, "members": [ID, ID], "weights": {ID: 1.0}, "state_hash": "ab" * 8,
              "state_hash_full": "ab" * 32, "eval_loss": 4.1}
    text, js = io.StringIO(), io.StringIO()
    Progress(log_format="text", stream=text).event("round", **fields)
    Progress(log_format="json", stream=js).event("round", **fields)
    assert text.getvalue() == f"[round] round=3 leader=…{ID[-8:]} members=2 weights=1 state_hash={'ab' * 8} " \
                              "eval_loss=4.1\n"
    assert "ab" * 32 in js.getvalue() and js.getvalue().count(ID) == 4


def test_a_round_without_a_group_is_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    reports = RoundReports.__new__(RoundReports)

    class Recorder:
        calls: list[dict[str, object]] = []

        def report_round(self, **kw: object) -> None:
            self.calls.append(kw)

    reports.reporter = Recorder()
    with caplog.at_level(logging.WARNING):
        reports.round({"round": 2, "outcome": "discarded", "reason": "no group formed", "members": []})
    assert Recorder.calls == [] and not caplog.records


def test_an_earlier_checkpoint_is_moved_aside_without_resume(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "state.json").write_text("{}")
    cfg = PeerConfig(run=RunConfig(workdir=str(tmp_path), resume=True))
    assert set_aside_checkpoint(cfg) is None and (checkpoint / "state.json").exists()
    cfg = PeerConfig(run=RunConfig(workdir=str(tmp_path)))
    assert set_aside_checkpoint(cfg) == tmp_path / "checkpoint.previous"
    assert (tmp_path / "checkpoint.previous" / "state.json").exists() and not checkpoint.exists()
    assert set_aside_checkpoint(cfg) is None  # nothing left to move


def test_launcher_progress_line_names_every_live_peers_steps(tmp_path: Path) -> None:
    args = argparse.Namespace(workdir=str(tmp_path), peers=2, threads=1, rounds=5, inner_steps=30, memory_every=0)
    swarm = Swarm(args, [1.0, 1.0])

    class Alive:
        pid = 1

        def poll(self) -> None:
            return None

    from swarmloco.swarm_procs import PeerProc

    swarm.peers = [PeerProc(i, tmp_path / f"peer-{i}", [], proc=Alive()) for i in range(2)]  # type: ignore[arg-type]
    swarm.peers[0].last_step = {"event": "step", "step": 12}
    assert swarm.progress_line().startswith("round 1/5: training or averaging; inner steps so far per peer: 12, 0 "
                                            "(30 per round) | ")


@pytest.mark.timeout(120)
def test_solo_run_stops_on_the_flag_its_signal_handler_sets(tmp_path: Path) -> None:
    """A StopFlag is falsy until set: `stop or StopFlag()` used to train on a fresh flag, deaf to Ctrl+C."""
    import threading

    from swarmloco.peer.cli import build_replica
    from swarmloco.peer.config import TrainConfig
    from swarmloco.peer.signals import StopFlag
    from swarmloco.peer.solo import run_solo

    cfg = PeerConfig(run=RunConfig(solo=True, workdir=str(tmp_path), max_steps=100_000, checkpoint_every=0),
                     train=TrainConfig(batch_size=2, inner_steps=5))
    stop = StopFlag()
    threading.Timer(1.0, stop.request).start()
    summary = run_solo(build_replica(cfg), cfg, stop=stop)
    assert summary["stopped_early"] and summary["steps"] < 100_000

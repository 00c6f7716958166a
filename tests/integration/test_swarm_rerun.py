"""A second launch of the local swarm into the same workdir starts clean: the earlier run is moved aside, and
nothing of it (log lines, rounds, coordinator records) shows up as the new run's."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from conftest import run_swarmloco
from swarm_harness import PRESET

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ARGS = ["swarm", "--peers", "2", "--preset", PRESET, "--rounds", "1", "--inner-steps", "5", "--threads", "1",
        "--peer-arg=--batch-size=4", "--peer-arg=--warmup-steps=2", "--peer-arg=--grace-max=2"]


def _launch(workdir: Path, env: dict[str, str]) -> str:
    proc = run_swarmloco([*ARGS, "--workdir", str(workdir), "--summary-json", str(workdir / "summary.json")], env,
                         timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _events(log: Path, name: str) -> list[dict[str, object]]:
    return [e for line in log.read_text().splitlines() if (e := json.loads(line)).get("event") == name]


def test_second_launch_into_the_same_workdir_starts_clean(tmp_path: Path, cli_env: dict[str, str]) -> None:
    workdir = tmp_path / "demo"
    _launch(workdir, cli_env)
    first = json.loads((workdir / "summary.json").read_text())
    out = _launch(workdir, cli_env)
    previous = tmp_path / "demo.previous"
    assert f"{workdir} holds an earlier run: moved it to {previous}; starting clean" in out
    assert json.loads((previous / "summary.json").read_text()) == first
    assert out.count("round 1/1 committed") == 1, out
    second = json.loads((workdir / "summary.json").read_text())
    assert [r["round"] for r in second["rounds"]] == [1] and len(second["rounds"][0]["hashes"]) == 2
    for i in range(2):  # one run per log, and the new peers are new identities
        log = workdir / f"peer-{i}" / "log.jsonl"
        assert len(_events(log, "start")) == 1 and len(_events(log, "round")) == 1, log.read_text()[-2000:]
        assert _events(log, "joined")[0]["peer_id"] != _events(previous / f"peer-{i}" / "log.jsonl", "joined")[0][
            "peer_id"]
    with sqlite3.connect(workdir / "coordinator.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM rounds WHERE run_id = 'local-swarm'").fetchone() == (1,)

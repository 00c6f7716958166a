"""The console script end to end: a solo run learns, bad input gets one clear line, the README's task runs."""
from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import ROOT, run_cli

from swarmloco.peer.options import OPTIONS


def test_solo_run_learns_and_writes_summary(tmp_path: Path, cli_env: dict[str, str]) -> None:
    summary_path = tmp_path / "s.json"
    proc = run_cli(
        [
            "peer",
            "--solo",
            "--preset",
            "tiny",
            "--max-steps",
            "80",
            "--batch-size",  # 4 sequences: the default 16 costs 4x the CPU and shows nothing more here
            "4",
            "--inner-steps",
            "20",
            "--warmup-steps",
            "10",
            "--inner-lr",
            "1e-3",
            "--eval-every",  # the last round's eval is the summary's final loss; the others would only cost CPU
            "4",
            "--workdir",
            str(tmp_path / "w"),
            "--summary-json",
            str(summary_path),
            "--log-format",
            "json",
        ],
        cli_env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 80 and summary["rounds"] == 4 and summary["tokens"] == 80 * 4 * 128
    assert summary["final_eval_loss"] < 0.8 * summary["initial_eval_loss"]
    assert re.fullmatch(r"[0-9a-f]{64}", summary["state_hash"])
    events = [json.loads(line)["event"] for line in proc.stdout.splitlines()]
    assert events[0] == "start" and events.count("round") == 4 and events[-1] == "done"


def test_bad_value_is_one_line_without_traceback(tmp_path: Path, cli_env: dict[str, str]) -> None:
    proc = run_cli(["peer", "--solo", "--inner-lr", "3", "--workdir", str(tmp_path)], cli_env, timeout=60)
    assert proc.returncode == 2
    assert "inner_lr: got 3.0, allowed 0 < lr <= 1" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli(["peer", "--solo", "--config", str(tmp_path / "missing.toml")], cli_env, timeout=60)
    assert proc.returncode == 2 and "file not found" in proc.stderr and "missing.toml" in proc.stderr
    proc = run_cli(["peer", "--solo", "--resume", "--workdir", str(tmp_path / "none")], cli_env, timeout=60)
    assert proc.returncode == 2 and "no checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_env_var_and_missing_coordinator_are_one_line(tmp_path: Path, cli_env: dict[str, str]) -> None:
    env = dict(cli_env, SWARMLOCO_MAX_STEP="10")
    proc = run_cli(["peer", "--solo", "--workdir", str(tmp_path)], env, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "SWARMLOCO_MAX_STEP: unknown setting; did you mean SWARMLOCO_MAX_STEPS?" in proc.stderr
    ready = tmp_path / "bootstrap" / "coordinator.json"
    proc = run_cli(
        ["peer", "--workdir", str(tmp_path / "w"), "--bootstrap-file", str(ready), "--bootstrap-wait", "0.5"],
        cli_env,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"no dht_peer_id in {ready} after 0.5 s: is the coordinator up, with its DHT node?" in proc.stderr


def test_help_lists_every_flag_with_its_env_var(cli_env: dict[str, str]) -> None:
    proc = run_cli(["peer", "--help"], cli_env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    missing = [o.flag for o in OPTIONS if f"{o.flag} " not in text or f"[env {o.env}]" not in text]
    assert not missing, missing


def test_readme_custom_task_runs(tmp_path: Path, cli_env: dict[str, str]) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Bring your own model", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)  # type: ignore[union-attr]
    (tmp_path / "mytask.py").write_text(code)
    cli_env["PYTHONPATH"] = f"{tmp_path}:{cli_env['PYTHONPATH']}"
    summary_path = tmp_path / "s.json"
    proc = run_cli(
        [
            "peer",
            "--solo",
            "--task",
            "mytask:make_task",
            "--max-steps",
            "200",
            "--inner-steps",
            "20",
            "--inner-lr",
            "0.01",
            "--workdir",
            str(tmp_path / "w"),
            "--summary-json",
            str(summary_path),
        ],
        cli_env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["task"] == "line"
    assert summary["final_eval_loss"] < 0.2 * summary["initial_eval_loss"]

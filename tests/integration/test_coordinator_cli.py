"""Coordinator process and CLI: ready file with DHT multiaddrs, join command, clean SIGTERM, status table."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from _coordinator_helpers import (
    ROOT,
    alive,
    child_env,
    descendants,
    hello_body,
    kill,
    make_identities,
    metrics_body,
    round_body,
    spawn_coordinator,
    start_server,
)
from _ticket_helpers import admit_all, certificate, certified_round_body

from swarmloco.coordinator.cli import add_coordinator_arguments, add_status_arguments, run_status
from swarmloco.protocol.trust.reports import build_report

pytestmark = pytest.mark.timeout(90)


def test_every_flag_has_help() -> None:
    for add in (add_coordinator_arguments, add_status_arguments):
        parser = argparse.ArgumentParser()
        add(parser)
        for action in parser._actions:
            assert action.help, f"{action.option_strings} has no help"


@pytest.mark.integration
def test_process_with_dht_ready_file_and_clean_sigterm(tmp_path: Path) -> None:
    proc, info = spawn_coordinator(tmp_path / "runs.sqlite", tmp_path / "ready.json", "--run-id", "demo")
    children: list[int] = []
    try:
        assert info["port"] > 0 and info["url"] == f"http://127.0.0.1:{info['port']}"
        assert info["dht_peer_id"].startswith("12D3KooW")
        maddr = info["dht_maddrs"][0]
        assert maddr.startswith("/ip4/127.0.0.1/tcp/") and maddr.endswith("/p2p/" + info["dht_peer_id"])
        # invite-only by default: a generated code, kept beside the database, in the join command and the ready file
        invite = info["invite"]
        assert len(invite) >= 20 and (tmp_path / "runs.sqlite.invite").read_text() == invite + "\n"
        assert info["join_command"] == f"swarmloco peer --join {info['url']} --invite {invite}"
        manifest = requests.get(info["url"] + "/api/manifest", timeout=10).json()
        assert (manifest["run_id"], manifest["authority"], manifest["admission"]) == ("demo", info["authority"],
                                                                                      "invite")
        assert maddr in manifest["bootstrap"] and manifest["settings"] == {}
        for secret in ("runs.sqlite.invite", "ready.json"):
            assert (tmp_path / secret).stat().st_mode & 0o777 == 0o600, secret
        assert requests.get(info["url"] + "/healthz", timeout=10).json()["run_id"] == "demo"
        assert (tmp_path / "runs.sqlite.key").exists()  # stable DHT identity next to the database
        assert info["authority"] == info["dht_peer_id"] and info["admission"] == "invite"  # one key for both
        assert requests.get(info["url"] + "/api/authority", timeout=10).json()["work_bits"] == 0
        children = descendants(proc.pid)
        assert children, "expected p2pd as a child"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [c for c in children if alive(c)], "DHT/p2pd children outlived the coordinator"
        log = (tmp_path / "ready.log").read_text()
        assert "join with:" in log and "Traceback" not in log
        assert f"invite code  {invite}" in log and f"--join {info['url']} --invite {invite}\n" in log
    finally:
        kill(proc)
        for child in children:
            if alive(child):
                os.kill(child, signal.SIGKILL)


@pytest.mark.integration
def test_a_killed_coordinator_leaves_no_process_behind(tmp_path: Path) -> None:
    """SIGKILL, as a crash or an OOM kill would end it: every process the coordinator started goes with it. (Its
    DHT node once ran in hivemind's forked process, which left torch's shared-memory manager running in a session
    of its own.)"""
    proc, _ = spawn_coordinator(tmp_path / "runs.sqlite", tmp_path / "ready.json")
    children = descendants(proc.pid)
    try:
        assert children, "expected p2pd as a child"
        kill(proc, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while any(alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [c for c in children if alive(c)]
        assert not left, f"outlived the coordinator: {[Path(f'/proc/{c}/comm').read_text().strip() for c in left]}"
    finally:
        for child in children:
            if alive(child):
                os.kill(child, signal.SIGKILL)


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "swarmloco.coordinator", "--db", str(tmp_path / "no" / "x.sqlite"), "--no-dht"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and "does not exist" in result.stderr
    founders = tmp_path / "founders.txt"
    cases = [("not-a-peer-id\n", "invite", "is not a peer id"), ("# nobody\n", "invite", "holds no peer id"),
             ("Q" * 52 + "\n", "none", "needs checkpoints")]
    for content, admission, wanted in cases:
        founders.write_text(content)
        result = subprocess.run(
            [sys.executable, "-m", "swarmloco.coordinator", "--db", str(tmp_path / "x.sqlite"), "--no-dht",
             "--port", "0", "--founders", str(founders), "--admission", admission],
            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60, check=False,
        )
        assert result.returncode == 2 and wanted in result.stderr, result.stderr


def test_status_prints_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = start_server(tmp_path / "db.sqlite", run_id="run")
    try:
        (a, b) = make_identities(tmp_path / "ids", 2)
        cert = certificate([a, b], admit_all(server, [a, b], "run"), run_id="run", round=7)
        for ident, device in ((a, "gpu-a"), (b, "cpu-b")):
            for r in (
                build_report(ident, "run", "hello", hello_body(device=device)),
                build_report(ident, "run", "metrics", metrics_body(4, loss=2.3456)),
                build_report(ident, "run", "round", certified_round_body(round_body(7, [a.peer_id, b.peer_id]), cert)),
            ):
                assert requests.post(server.url + "/api/reports", data=r.encode(), timeout=10).status_code == 200
        parser = argparse.ArgumentParser()
        add_status_arguments(parser)
        assert run_status(parser.parse_args(["--coordinator", server.url])) == 0
        out = capsys.readouterr().out
        assert "run run: 2 of 2 peers online" in out
        assert "gpu-a" in out and "cpu-b" in out and "2.3456" in out
        assert "committed" in out and "2.5000" in out
    finally:
        server.stop()
    assert run_status(parser.parse_args(["--coordinator", server.url, "--timeout", "1"])) == 1
    assert "cannot read" in capsys.readouterr().err

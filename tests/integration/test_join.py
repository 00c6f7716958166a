"""`swarmloco peer --join URL` against a real coordinator: two peers given nothing but the URL and the invite code
commit rounds with the settings the run fixes; a wrong protocol version, a conflicting setting, a run config that
fixes a per-peer setting, an unreachable manifest and a launcher pointed at another run are each refused in one line.

Everything runs on 127.0.0.1; every process the test starts runs in its own session and is ended by pid, and the
test checks that none is left (p2pd included)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _coordinator_helpers import ROOT, child_env, join_peer, run_config, run_coordinator

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

RUN_CONFIG = run_config(inner_steps=10, seed=3)


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarmloco.cli", *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def _one_line(proc: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert proc.returncode == code, proc.stdout[-1000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line or line.startswith("swarmloco")]
    assert len(errors) == 1 and text in errors[0], proc.stderr[-3000:]


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with run_coordinator(tmp_path, RUN_CONFIG) as info:
        yield info


def test_two_peers_join_with_the_url_alone_and_commit_rounds(coordinator: dict[str, Any]) -> None:
    url, root = coordinator["url"], coordinator["dir"]
    manifest = json.loads(_cli_get(url + "/api/manifest"))
    assert manifest["run_id"] == "joined" and manifest["bootstrap"] and manifest["settings"]["train"] == {
        "lr": 1e-3, "warmup_steps": 5, "inner_steps": 10}  # the flag's name in the TOML, the field's in the manifest
    peers = [join_peer(url, root, i, 2, "--max-rounds", "2") for i in range(2)]
    coordinator["procs"].extend(peers)
    for i, p in enumerate(peers):
        assert p.wait(300) == 0, (root / f"peer-{i}.log").read_text()[-4000:]
    summaries = [json.loads((root / f"peer-{i}" / "summary.json").read_text()) for i in range(2)]
    assert all(s["rounds"] == 2 for s in summaries) and len({s["state_hash"] for s in summaries}) == 1, summaries
    # the run's 10 inner steps per round (and some taken while a group formed), not the default 50 per round
    assert all(20 <= s["steps"] < 100 for s in summaries), [s["steps"] for s in summaries]
    assert "joining run 'joined'" in (root / "peer-0.log").read_text()


def _cli_get(url: str) -> str:
    import requests

    return str(requests.get(url, timeout=10).text)


def test_what_cannot_join_is_refused_in_one_line(coordinator: dict[str, Any]) -> None:
    url, root = coordinator["url"], coordinator["dir"]
    _one_line(_cli("peer", "--join", url, "--invite", "let-me-in", "--inner-lr", "0.01", "--workdir",
                   str(root / "conflict")), 2, "--inner-lr is fixed by the run you join at 0.001")
    manifest = json.loads(_cli_get(url + "/api/manifest"))
    (root / "future.json").write_text(json.dumps({**manifest, "protocol_version": 999, "package_version": "9.0"}))
    _one_line(_cli("peer", "--join", str(root / "future.json"), "--workdir", str(root / "future")), 2,
              "install swarmloco==9.0")
    started = time.monotonic()
    _one_line(_cli("peer", "--join", "http://127.0.0.1:9", "--workdir", str(root / "nowhere")), 2,
              "cannot read the run manifest at http://127.0.0.1:9/api/manifest")
    assert time.monotonic() - started < 30  # the interpreter's start included; the fetch itself gives up in 10 s
    (root / "bad.toml").write_text('[runtime]\ndevice = "cuda"\n')
    _one_line(_cli("coordinator", "--db", str(root / "x.sqlite"), "--no-dht", "--run-config", str(root / "bad.toml")),
              2, "runtime.device is for each peer to choose")
    _one_line(_cli("swarm", "--coordinator", url, "--run-id", "default", "--workdir", str(root / "swarm")), 2,
              "runs 'joined', not 'default'")


def test_doctor_passes_a_healthy_setup_and_names_each_problem(coordinator: dict[str, Any]) -> None:
    url, root = coordinator["url"], coordinator["dir"]
    healthy = _cli("doctor", "--join", url, "--workdir", str(root / "doc"), "--json")
    report = json.loads(healthy.stdout)
    assert healthy.returncode == 0 and report["ok"] is True, healthy.stdout + healthy.stderr[-2000:]
    names = [c["name"] for c in report["checks"]]
    assert names == ["python", "config", "torch", "p2pd", "ports", "bootstrap", "reachable", "clock", "link"], names
    assert re.fullmatch(r"\d+ ms round trip, [\d,]+ Mbit/s down, [\d,]+ Mbit/s up \(to the coordinator\)",
                        report["checks"][-1]["detail"]), report["checks"][-1]
    # a taken listen port, and a bootstrap address nobody answers on: exit 1, each with what to do
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooW9yJKTxvq8JjKbkdwtZH7ZWLQXQTCYYLSr1KAekwtUkYj"
    port = url.rsplit(":", 1)[1]
    sick = _cli("doctor", "--private", "--initial-peer", dead, "--host-maddr", f"/ip4/127.0.0.1/tcp/{port}",
                "--workdir", str(root / "doc2"))
    assert sick.returncode == 1, sick.stdout + sick.stderr[-2000:]
    failed = [line for line in sick.stdout.splitlines() if line.startswith("✗")]
    assert [line.split()[1] for line in failed] == ["ports", "bootstrap"], sick.stdout
    assert "Address already in use" in failed[0] and "Connection refused" in failed[1]
    assert "is that peer running" in sick.stdout and sick.stdout.rstrip().endswith("see the ✗ lines")
    wrong = _cli("doctor", "--join", url, "--inner-lr", "0.5", "--workdir", str(root / "doc3"))
    assert wrong.returncode == 1 and "✗ config" in wrong.stdout and "--inner-lr is fixed" in wrong.stdout

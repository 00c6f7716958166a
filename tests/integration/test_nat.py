"""A peer behind NAT, in network namespaces this test creates: `swarmloco doctor` inside the NAT reaches the
coordinator and its bootstrap node (outgoing connections pass the NAT) but reports that nobody can dial it, and
recommends --client-mode or relays; with --client-mode it passes. The same doctor outside the NAT passes. With the
volunteer's uplink shaped to 20 Mbit/s, the doctor's link check measures about that.

Topology: a "public" namespace (10.79.N.1) runs the coordinator and its DHT node; a "router" namespace forwards
between it (10.79.N.254) and a LAN (192.168.N.0/24) with iptables MASQUERADE; the LAN namespace (192.168.N.2) is
the volunteer's machine. Needs root and iptables (CI installs it); every namespace and process is removed after."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _coordinator_helpers import ROOT, child_env, descendants, join_peer, run_config, stop_sessions

pytestmark = [
    pytest.mark.integration, pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("iptables") is None or shutil.which("ip") is None,
                       reason="network namespaces and iptables need root and the iptables package"),
]
N = os.getpid() % 250 + 1
TAG = f"slnat{os.getpid() % 100_000}"
PUB, RTR, LAN = f"{TAG}p", f"{TAG}r", f"{TAG}l"
PUB_IP, RTR_PUB_IP, RTR_LAN_IP, LAN_IP = f"10.79.{N}.1", f"10.79.{N}.254", f"192.168.{N}.1", f"192.168.{N}.2"


def _run(*cmd: str, ns: str | None = None) -> None:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    res = subprocess.run(full, capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 0, f"{' '.join(full)}: {res.stderr}"


@pytest.fixture
def nat() -> Iterator[None]:
    created: list[str] = []
    try:
        for ns in (PUB, RTR, LAN):
            _run("ip", "netns", "add", ns)
            created.append(ns)
            _run("ip", "link", "set", "lo", "up", ns=ns)
        _run("ip", "link", "add", "eth0", "type", "veth", "peer", "name", "wan", ns=PUB)
        _run("ip", "link", "set", "wan", "netns", RTR, ns=PUB)
        _run("ip", "link", "add", "eth0", "type", "veth", "peer", "name", "lan", ns=LAN)
        _run("ip", "link", "set", "lan", "netns", RTR, ns=LAN)
        for ns, dev, addr in ((PUB, "eth0", f"{PUB_IP}/24"), (RTR, "wan", f"{RTR_PUB_IP}/24"),
                              (RTR, "lan", f"{RTR_LAN_IP}/24"), (LAN, "eth0", f"{LAN_IP}/24")):
            _run("ip", "addr", "add", addr, "dev", dev, ns=ns)
            _run("ip", "link", "set", dev, "up", ns=ns)
        _run("ip", "route", "add", "default", "via", RTR_LAN_IP, ns=LAN)
        _run("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=RTR)
        _run("iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE", ns=RTR)
        # a NAT lets replies in and nothing else: what arrives on the public side unasked is dropped
        _run("iptables", "-A", "FORWARD", "-i", "wan", "-m", "conntrack", "!", "--ctstate", "ESTABLISHED,RELATED",
             "-j", "DROP", ns=RTR)
        yield
    finally:
        for ns in reversed(created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)


@pytest.fixture
def coordinator(nat: None, tmp_path: Path) -> Iterator[dict[str, Any]]:
    ready = tmp_path / "ready.json"
    baseline = set(descendants(os.getpid()))
    (tmp_path / "run.toml").write_text(run_config(inner_steps=10, seed=5))
    with open(tmp_path / "coordinator.log", "ab") as log:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", PUB, sys.executable, "-m", "swarmloco.cli", "coordinator", "--db",
             str(tmp_path / "c.sqlite"), "--host", PUB_IP, "--port", "0", "--dht-host", PUB_IP, "--ready-file",
             str(ready), "--run-id", "natrun", "--invite-code", "nat-code", "--run-config", str(tmp_path / "run.toml")],
            cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    procs = [proc]
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()
            time.sleep(0.1)
        yield {**json.loads(ready.read_text()), "procs": procs}
    finally:
        stop_sessions(procs, baseline)


def _doctor(ns: str, url: str, workdir: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    res = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "swarmloco.cli", "doctor", "--join", url,
                          "--workdir", str(workdir), "--json", "--check-timeout", "3", *extra],
                         cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120, check=False)
    assert res.stdout.strip(), res.stderr[-3000:]
    return res.returncode, json.loads(res.stdout)


def test_doctor_behind_nat_says_unreachable_and_what_to_do(coordinator: dict[str, Any], tmp_path: Path) -> None:
    url = coordinator["url"]
    assert url == f"http://{PUB_IP}:{coordinator['port']}"
    # the volunteer's uplink shaped to 20 Mbit/s (tbf on the LAN side of its link): the doctor must measure it
    _run("tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "20mbit", "burst", "32kbit", "latency", "400ms",
         ns=LAN)
    code, report = _doctor(LAN, url, tmp_path / "lan")
    _run("tc", "qdisc", "del", "dev", "eth0", "root", ns=LAN)
    checks = {c["name"]: c for c in report["checks"]}
    assert code == 1 and not report["ok"], report
    assert checks["config"]["ok"] and checks["bootstrap"]["ok"], report  # outgoing connections pass the NAT
    up, down = (float(re.search(rf"([\d,]+) Mbit/s {way}", checks["link"]["detail"])[1].replace(",", ""))
                for way in ("up", "down"))
    assert checks["link"]["ok"] and 12 <= up <= 24 and down > 2 * up, checks["link"]
    reach = checks["reachable"]
    assert not reach["ok"] and "behind NAT or a firewall" in reach["detail"], reach
    assert "--client-mode" in reach["advice"] and "--use-auto-relay" in reach["advice"], reach
    assert RTR_PUB_IP in reach["detail"] or "could not connect" in reach["detail"], reach
    code, report = _doctor(LAN, url, tmp_path / "lan2", "--client-mode")
    assert code == 0 and report["ok"], report  # dialled by nobody, so it need not be reachable
    code, report = _doctor(PUB, url, tmp_path / "pub")
    assert code == 0 and report["ok"], report  # the same checks on the public side pass


def test_a_peer_behind_nat_commits_rounds_with_a_public_one(coordinator: dict[str, Any], tmp_path: Path) -> None:
    url = coordinator["url"]
    peers = [join_peer(url, tmp_path, 0, 2, "--max-rounds", "3", invite="nat-code", host=PUB_IP, netns=PUB),
             join_peer(url, tmp_path, 1, 2, "--max-rounds", "3", "--client-mode", invite="nat-code", host=LAN_IP,
                       netns=LAN)]
    coordinator["procs"].extend(peers)
    for i, p in enumerate(peers):
        assert p.wait(240) == 0, (tmp_path / f"peer-{i}.log").read_text()[-4000:]
    summaries = [json.loads((tmp_path / f"peer-{i}" / "summary.json").read_text()) for i in range(2)]
    assert all(s["rounds"] == 3 for s in summaries) and len({s["state_hash"] for s in summaries}) == 1, summaries
    natted = summaries[1]["peer_id"]
    rounds = [e for e in _events(tmp_path / "peer-1.log") if e.get("event") == "round"]
    committed = [e for e in rounds if e["outcome"] == "committed"]
    assert len(committed) == 3 and all(natted in e["members"] for e in committed), rounds
    # nobody can dial it, so it never leads, and it opens its pipe itself: straight to the public peer's TCP port
    assert all(e["leader"] != natted and e["role"] == "member" for e in rounds), rounds
    assert all(e["pipes"] == 1 and e["direct"] == 1 for e in committed), committed


def _events(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict):
                out.append(event)
    return out

"""A new user's first mistakes, through the installed `swarmloco` script: each ends in one line that says what is
wrong and what to try, exit code 2 (or 3 for a network that cannot be reached), no traceback, nothing left behind.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _coordinator_helpers import alive, descendants, kill, spawn_coordinator
from conftest import ROOT, console_script, run_swarmloco

from swarmloco.protocol.network.ports import port_taken

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
PEER_ID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"  # well-formed; nobody listens as it


def _one_error_line(proc: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert proc.returncode == code, proc.stdout[-1000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line or line.startswith("swarmloco")]
    assert len(errors) == 1 and text in errors[0], proc.stderr[-3000:]


def _free_fixed_port() -> int:
    """A free port below the ephemeral range, where no outgoing connection takes it before the coordinator does."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 32000)
        if port_taken("0.0.0.0", port) is None:
            return port
    raise RuntimeError("no free port in 20000..32000")


@pytest.fixture
def listener() -> Iterator[int]:
    """A port this test owns and listens on."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, object]]]:
    """A coordinator with its DHT node (p2pd) on a fixed port, as a user's first one would be."""
    port = _free_fixed_port()
    proc, info = spawn_coordinator(tmp_path / "a.sqlite", tmp_path / "a.json", "--dht-port", str(port),
                                   "--host", "0.0.0.0", "--dht-host", "0.0.0.0")
    children = descendants(proc.pid)
    try:
        yield proc, {**info, "dht_port": port, "log": (tmp_path / "a.log")}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            kill(proc)
        deadline = time.monotonic() + 10
        while any(alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [c for c in children if alive(c)]
        for pid in left:  # ours: started by the coordinator this fixture started
            os.kill(pid, signal.SIGKILL)
        assert not left, "p2pd outlived the coordinator"


def test_coordinator_refuses_a_dht_port_another_p2pd_owns(tmp_path: Path, cli_env: dict[str, str],
                                                          coordinator: tuple[object, dict[str, object]]) -> None:
    port = coordinator[1]["dht_port"]
    started = time.monotonic()
    proc = run_swarmloco(["coordinator", "--db", str(tmp_path / "b.sqlite"), "--port", "0", "--dht-port", str(port)],
                         cli_env, timeout=60)
    _one_error_line(proc, 2, f"--dht-port {port} on 127.0.0.1 cannot be used (Address already in use)")
    assert time.monotonic() - started < 30 and not (tmp_path / "b.sqlite").exists()  # refused before starting


def test_coordinator_refuses_a_taken_http_port(tmp_path: Path, cli_env: dict[str, str], listener: int) -> None:
    proc = run_swarmloco(["coordinator", "--db", str(tmp_path / "c.sqlite"), "--port", str(listener), "--no-dht"],
                         cli_env, timeout=60)
    _one_error_line(proc, 2, f"--port {listener} on 127.0.0.1 cannot be used")


def test_join_command_works_from_elsewhere(coordinator: tuple[object, dict[str, object]]) -> None:
    """Listening on every interface: the banner's join command names an address other machines can dial."""
    log = Path(str(coordinator[1]["log"])).read_text()
    nodes = [line.split()[-1] for line in log.splitlines() if line.startswith("DHT node")]
    join = next(line for line in log.splitlines() if line.startswith("join with:"))
    public = [m for m in nodes if not m.startswith("/ip4/127.")]
    if public:
        host = public[0].split("/")[2]
        assert f"--join http://{host}:" in join and "127.0.0.1" not in join, log
    else:  # a machine without any other address: the banner says the command only works here
        assert "note:        only a loopback address is known" in log, log


@pytest.mark.parametrize(("maddr", "text"), [
    ("/ip4/127.0.0.1/tcp/9", "has no /p2p/PEER_ID part: copy the whole multiaddr"),
    (f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID[:20]}", "is not a whole peer id (20 characters"),
])
def test_malformed_initial_peer_is_one_line(tmp_path: Path, cli_env: dict[str, str], maddr: str, text: str) -> None:
    proc = run_swarmloco(["peer", "--private", "--workdir", str(tmp_path), "--initial-peer", maddr], cli_env,
                         timeout=60)
    _one_error_line(proc, 2, text)


def test_unreachable_initial_peer_is_one_line(tmp_path: Path, cli_env: dict[str, str], listener: int) -> None:
    maddr = f"/ip4/127.0.0.1/tcp/{listener}/p2p/{PEER_ID}"  # a port that accepts, but speaks no libp2p
    proc = run_swarmloco(["peer", "--private", "--workdir", str(tmp_path), "--initial-peer", maddr], cli_env,
                         timeout=90)
    _one_error_line(proc, 3, f"could not reach any --initial-peer ({maddr}): is that peer running")


def test_taken_listen_port_is_one_line(tmp_path: Path, cli_env: dict[str, str], listener: int) -> None:
    proc = run_swarmloco(["peer", "--private", "--workdir", str(tmp_path), "--initial-peer",
                          f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID}", "--host-maddr", f"/ip4/127.0.0.1/tcp/{listener}"],
                         cli_env, timeout=60)
    _one_error_line(proc, 2, f"host_maddr: cannot listen on /ip4/127.0.0.1/tcp/{listener} (Address already in use)")


@pytest.mark.parametrize(("spec", "pythonpath", "text"), [
    ("nosuchmodule:make", False, "task: no module named 'nosuchmodule'; is its directory on PYTHONPATH"),
    ("mytask", True, "task: got 'mytask', allowed 'package.module:factory'"),
    ("mytask:nothere", True, "has no function 'nothere'; it defines: make_task"),
    ("mytask:make_task", False, "it is in the current directory, which the swarmloco command does not search: "
                                "run with PYTHONPATH=."),
])
def test_task_mistakes_are_one_line(tmp_path: Path, cli_env: dict[str, str], spec: str, pythonpath: bool,
                                    text: str) -> None:
    (tmp_path / "mytask.py").write_text("def make_task(ctx):\n    raise AssertionError('not reached')\n")
    # without a trailing ":" (an empty entry would put the current directory on the path after all)
    env = dict(cli_env, PYTHONPATH=f"{tmp_path}:{ROOT}" if pythonpath else str(ROOT))
    proc = run_swarmloco(["peer", "--solo", "--workdir", str(tmp_path / "w"), "--task", spec], env, timeout=60,
                         cwd=tmp_path)
    _one_error_line(proc, 2, text)


def test_second_peer_in_one_workdir_is_refused(tmp_path: Path, cli_env: dict[str, str]) -> None:
    workdir = tmp_path / "w"
    # The first peer only has to hold the workdir: tiny steps, and a long sleep after each, leave the CPU to the rest.
    first = subprocess.Popen([console_script(), "peer", "--solo", "--workdir", str(workdir), "--max-steps", "100000",
                              "--batch-size", "1", "--slowdown", "100", "--log-format", "json"], env=cli_env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert first.stdout is not None and '"start"' in first.stdout.readline()  # it holds the lock by now
        proc = run_swarmloco(["peer", "--solo", "--workdir", str(workdir)], cli_env, timeout=60)
        _one_error_line(proc, 2, f"workdir {workdir} is in use by another swarmloco peer (pid {first.pid})")
        proc = run_swarmloco(["peer", "--solo", "--workdir", str(tmp_path / "other"), "--identity",
                              str(workdir / "identity.key")], cli_env, timeout=60)
        _one_error_line(proc, 2, f"identity {workdir / 'identity.key'} is in use by another swarmloco peer")
    finally:
        first.send_signal(signal.SIGTERM)
        kill(first)  # type: ignore[arg-type]

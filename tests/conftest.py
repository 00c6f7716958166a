"""Shared fixtures: process cleanup (only pids we started, p2pd included) and small helpers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmloco.proc_memory import descendants as _descendants  # one /proc walker for all tests

ROOT = Path(__file__).resolve().parents[1]
_SHM_MANAGER = "torch_shm_manager"  # started by torch.multiprocessing for hivemind's shared tensors
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(scope="session", autouse=True)
def kill_leftover_children() -> Iterator[None]:
    """After the session, end any process this test process started (directly or not) that is still alive.

    The test process becomes a child subreaper first, so orphans of SIGKILLed peers (their DHT process, p2pd)
    re-parent to us and are found here instead of escaping to init."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
    yield
    for pid in _descendants(os.getpid()):
        if _SHM_MANAGER in _cmdline(pid):
            # torch's shared-memory manager exits by itself with us; killing it aborts this process at exit (EPIPE)
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return str(pid)


@pytest.fixture
def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_cli(
    args: list[str], env: dict[str, str], *, timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmloco.cli", *args],
        env=env,
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def console_script() -> str:
    """The installed `swarmloco` entry point beside this interpreter: what a user runs, startup cost included."""
    path = Path(sys.executable).parent / "swarmloco"
    assert path.exists(), f"{path} is missing: install the project first (make install, or pip install -e .)"
    return str(path)


def run_swarmloco(
    args: list[str], env: dict[str, str], *, timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Like run_cli, through the real console script."""
    return subprocess.run(
        [console_script(), *args], env=env, cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration starts real processes (peers, p2pd, a coordinator, a browser): marked so,
    `pytest tests/unit` and `pytest -m "not integration"` are the fast tier."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def peer_zygote() -> Iterator[Any]:
    """One fork server for the session's peers (`swarmloco.zygote`): torch and hivemind are imported once, and
    every peer a `swarm` test starts is forked from it in a few milliseconds instead of importing them again."""
    from swarmloco.zygote import Zygote

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("SWARMLOCO_FAULTS", None)
    zygote = Zygote(env)
    try:
        yield zygote
    finally:
        zygote.close()


@pytest.fixture
def net() -> Iterator[Any]:
    """An in-memory network on a virtual clock (`swarmloco.protocol.testing.fake.FakeNetwork`), opened with `with`
    so that the test's thread drives the peers and the clock waits for it (opened without, the clock can run ahead
    of a peer's start). A test file whose peers need the machine's clock defines its own."""
    from swarmloco.protocol.testing.fake import FakeNetwork

    with FakeNetwork() as n:
        yield n


@pytest.fixture
def swarm(request: pytest.FixtureRequest, tmp_path: Path, peer_zygote: Any) -> Iterator[Any]:
    """A fresh permissioned run of real peers (`swarm_harness.Swarm`), forked from the session's fork server;
    every process it started is gone when the test ends, or the test fails. `@pytest.mark.preset("tiny")` on a
    test or module picks its peers' model. Imported here, not at the top: the unit tier never loads hivemind."""
    from swarm_harness import PRESET, Swarm

    marker = request.node.get_closest_marker("preset")
    s = Swarm(tmp_path, spawner=peer_zygote, preset=marker.args[0] if marker else PRESET)
    try:
        yield s
    finally:
        s.close()
        s.assert_nothing_left()

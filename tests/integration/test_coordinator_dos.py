"""The coordinator under a connection flood, against a real in-process server over loopback: 1,000 silent
connections, requests dribbled a byte at a time, one address holding many connections, a full connection table.
Valid reports keep being accepted, nothing answers 5xx, and silent or slow connections are closed on time.

Attack connections come from other loopback addresses (127.0.x.y: the whole 127/8 reaches this host), so the
per-address cap can be exercised apart from the client that sends the valid reports (127.0.0.1)."""

from __future__ import annotations

import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from _coordinator_helpers import ROOT, child_env, hello_body, kill, make_identities, metrics_body, spawn_coordinator
from _log_capture import captured_logs

from swarmloco.coordinator.authority import AuthorityConfig
from swarmloco.coordinator.connections import ConnectionLimits
from swarmloco.coordinator.server import CoordinatorConfig, CoordinatorServer
from swarmloco.coordinator.service import ServiceConfig
from swarmloco.protocol.trust.admission import AdmissionPolicy
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.reports import build_report

pytestmark = pytest.mark.timeout(90)

IDLE_CONNECTIONS = 1000
Factory = Callable[..., CoordinatorServer]


@pytest.fixture(scope="module")
def ident(tmp_path_factory: pytest.TempPathFactory) -> Identity:
    return make_identities(tmp_path_factory.mktemp("ids"), 1)[0]


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Factory]:
    started: list[CoordinatorServer] = []

    def make(**limits: float) -> CoordinatorServer:
        config = CoordinatorConfig(
            db=tmp_path / f"db{len(started)}.sqlite", port=0, dht=False, connections=ConnectionLimits(**limits),
            service=ServiceConfig(run_id="run", authority=AuthorityConfig(policy=AdmissionPolicy(mode="none"))))
        started.append(CoordinatorServer(config).start(timeout=20))
        return started[-1]

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for s in opened:
        s.close()


def connect(port: int, source: str, opened: list[socket.socket]) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    opened.append(s)
    s.bind((source, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def readable(s: socket.socket, timeout: float) -> bool:
    poller = select.poll()  # select.select cannot watch descriptors above 1023
    poller.register(s, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0, int(timeout * 1000))))


def closed_by_server(s: socket.socket, within: float) -> tuple[bool, bytes]:
    """Whether the server closes ``s`` within ``within`` seconds, and what it sent before closing."""
    got, deadline = b"", time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        if not readable(s, left):
            break
        try:
            chunk = s.recv(4096)
        except (ConnectionResetError, BrokenPipeError):
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def drip(streams: dict[socket.socket, bytes], *, every_s: float, for_s: float) -> dict[socket.socket, bytes]:
    """Send each socket its bytes one at a time, ``every_s`` apart, until the server answers (what it said is
    returned) or ``for_s`` runs out (that socket is missing from the result)."""
    answers: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + for_s
    while streams and time.monotonic() < deadline:
        for s, left in list(streams.items()):
            if readable(s, 0):
                answers[s] = closed_by_server(s, within=2)[1]
                del streams[s]
                continue
            try:
                s.sendall(left[:1])
            except (BrokenPipeError, ConnectionResetError):
                answers[s] = b"<reset>"
                del streams[s]
                continue
            streams[s] = left[1:]
        time.sleep(every_s)
    return answers


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def report_request(report: bytes) -> bytes:
    return (b"POST /api/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(report)).encode() + b"\r\n\r\n" + report)


def post_hostile_number(server: CoordinatorServer, ident: Identity, literal: str) -> int:
    """A signed report whose ``memory_bytes`` is the raw JSON ``literal``; returns the HTTP status."""
    text = build_report(ident, "run", "hello", hello_body()).encode().decode()
    text = text.replace(f'"memory_bytes":{hello_body()["memory_bytes"]}', f'"memory_bytes":{literal}')
    assert literal in text
    return requests.post(server.url + "/api/reports", data=text.encode(), timeout=10).status_code


def post_reports(server: CoordinatorServer, ident: Identity, n: int) -> list[int]:
    with requests.Session() as session:
        statuses = [session.post(server.url + "/api/reports", timeout=10,
                                 data=build_report(ident, "run", "hello", hello_body()).encode()).status_code]
        for step in range(n - 1):
            report = build_report(ident, "run", "metrics", metrics_body(step))
            statuses.append(session.post(server.url + "/api/reports", data=report.encode(), timeout=10).status_code)
    return statuses


@pytest.fixture(scope="module", autouse=True)
def room_for_many_sockets() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 3 * IDLE_CONNECTIONS + 512  # both ends of each connection live in this process, plus the server's own
    if soft != resource.RLIM_INFINITY and soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"needs {wanted} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def test_thousand_idle_connections_do_not_block_valid_reports(coordinator: Factory, ident: Identity,
                                                               sockets: list[socket.socket]) -> None:
    idle_s = 6.0
    server = coordinator(idle_timeout_s=idle_s, request_timeout_s=2.0)
    t0 = time.monotonic()
    idle = [connect(server.port, f"127.0.{1 + i // 50}.{1 + i % 50}", sockets) for i in range(IDLE_CONNECTIONS)]
    assert wait_for(lambda: server.connections.open_count >= IDLE_CONNECTIONS, 10), server.connections.open_count
    # meanwhile two senders dribble a request a byte every 0.2 s, and reports carry numbers beyond a float
    report = build_report(ident, "run", "hello", hello_body()).encode()
    drips = {connect(server.port, f"127.0.99.{i + 1}", sockets): report_request(report) for i in range(2)}
    dripped: dict[socket.socket, bytes] = {}
    dripper = threading.Thread(target=lambda: dripped.update(drip(drips, every_s=0.2, for_s=15)), daemon=True)
    dripper.start()
    statuses = post_reports(server, ident, 30)
    assert statuses == [200] * 30, statuses  # the old server answered 503 from 256 silent connections on
    hostile = [post_hostile_number(server, ident, literal) for literal in ("1" + "0" * 400, "-1" + "0" * 400)]
    assert hostile == [400, 400], hostile
    if time.monotonic() - t0 < idle_s - 0.5:  # still inside the idle window (a very busy machine may be slower)
        assert server.connections.open_count >= IDLE_CONNECTIONS
    # every silent connection is closed once the idle timeout has passed, and the drips by their deadline
    for s in idle:
        assert closed_by_server(s, within=idle_s + 15 - (time.monotonic() - t0))[0]
    dripper.join(timeout=20)
    assert [a[:12] for a in dripped.values()] == [b"HTTP/1.1 408"] * 2, dripped
    assert wait_for(lambda: server.connections.open_count == 0, 5), server.connections.open_count
    assert server.connections.totals["idle_closed"] >= IDLE_CONNECTIONS
    assert post_reports(server, ident, 3) == [200] * 3


def test_idle_before_the_first_request_and_between_requests_is_closed(coordinator: Factory,
                                                                      sockets: list[socket.socket]) -> None:
    server = coordinator(idle_timeout_s=0.5)
    silent = connect(server.port, "127.0.0.1", sockets)
    keep_alive = connect(server.port, "127.0.0.1", sockets)
    keep_alive.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    t0 = time.monotonic()
    closed, got = closed_by_server(silent, within=8)
    assert closed and got == b"", got  # before any request: closed without a word
    assert time.monotonic() - t0 < 6
    closed, got = closed_by_server(keep_alive, within=8)
    assert closed and got.startswith(b"HTTP/1.1 200"), got  # answered, then closed once idle


def test_slow_drip_requests_hit_one_deadline_for_the_whole_request(coordinator: Factory, ident: Identity,
                                                                   sockets: list[socket.socket]) -> None:
    # A byte every 0.2 s never leaves the connection idle for the 1 s idle timeout: only a deadline over the
    # whole request stops it.
    server = coordinator(idle_timeout_s=1.0, request_timeout_s=1.5)
    report = build_report(ident, "run", "hello", hello_body()).encode()
    whole = report_request(report)
    head = whole[:len(whole) - len(report)]
    headers_drip = connect(server.port, "127.0.5.1", sockets)
    body_drip = connect(server.port, "127.0.5.2", sockets)
    body_drip.sendall(head)
    t0 = time.monotonic()
    with captured_logs() as logs:
        answers = drip({headers_drip: whole, body_drip: report}, every_s=0.2, for_s=10)
        time.sleep(0.2)  # the endpoint that was reading the dripped body sees the disconnect
    elapsed = time.monotonic() - t0
    assert len(answers) == 2, "a dribbled request was never timed out"
    assert elapsed < 6, elapsed
    for s in (headers_drip, body_drip):
        assert answers[s].startswith(b"HTTP/1.1 408"), answers[s][:200]
    assert server.connections.totals["slow_request"] == 2
    assert not logs.tracebacks(), logs.tracebacks()  # the cut-off endpoint ends quietly
    assert post_reports(server, ident, 2) == [200, 200]


def test_one_address_cannot_hold_more_than_its_share(coordinator: Factory, ident: Identity,
                                                     sockets: list[socket.socket]) -> None:
    server = coordinator(max_per_address=8, idle_timeout_s=30)
    held = [connect(server.port, "127.0.6.1", sockets) for _ in range(8)]
    assert wait_for(lambda: server.connections.open_count == 8, 5)
    extra = connect(server.port, "127.0.6.1", sockets)
    closed, got = closed_by_server(extra, within=5)
    assert closed and got.startswith(b"HTTP/1.1 429"), got
    assert post_reports(server, ident, 2) == [200, 200]  # another address is served
    assert all(not closed_by_server(s, within=0)[0] for s in held)
    assert server.connections.totals["refused_address"] == 1


def test_a_full_table_evicts_the_longest_idle_connection(coordinator: Factory, ident: Identity,
                                                         sockets: list[socket.socket]) -> None:
    server = coordinator(max_connections=16, max_per_address=16, idle_timeout_s=30)
    idle = [connect(server.port, f"127.0.7.{i + 1}", sockets) for i in range(16)]
    assert wait_for(lambda: server.connections.open_count == 16, 5)
    assert post_reports(server, ident, 2) == [200, 200]  # room made by closing the oldest silent connection
    assert closed_by_server(idle[0], within=5)[0]
    assert server.connections.totals["evicted"] >= 1
    # connections in the middle of a request are never evicted: with all of them busy, a newcomer gets 503
    for s in idle[1:]:
        s.close()
    assert wait_for(lambda: server.connections.open_count == 0, 5)
    busy = [connect(server.port, f"127.0.8.{i + 1}", sockets) for i in range(16)]
    for s in busy:
        s.sendall(b"POST /api/reports HTTP/1.1\r\n")
    assert wait_for(lambda: server.connections.open_count == 16, 5)
    time.sleep(0.2)  # let the server see the first bytes of every request
    closed, got = closed_by_server(connect(server.port, "127.0.9.1", sockets), within=5)
    assert closed and got.startswith(b"HTTP/1.1 503"), got
    assert all(not closed_by_server(s, within=0)[0] for s in busy)


def test_the_real_coordinator_process_applies_the_flags(tmp_path: Path, sockets: list[socket.socket]) -> None:
    proc, info = spawn_coordinator(tmp_path / "db.sqlite", tmp_path / "ready.json", "--no-dht", "--admission", "none",
                                   "--idle-timeout", "0.5", "--max-connections-per-address", "2")
    try:
        silent = [connect(info["port"], "127.0.10.1", sockets) for _ in range(2)]
        closed, got = closed_by_server(connect(info["port"], "127.0.10.1", sockets), within=5)
        assert closed and got.startswith(b"HTTP/1.1 429"), got
        assert all(closed_by_server(s, within=8)[0] for s in silent)
        assert requests.get(info["url"] + "/healthz", timeout=10).status_code == 200
    finally:
        kill(proc)
    bad = subprocess.run([sys.executable, "-m", "swarmloco.coordinator", "--db", str(tmp_path / "b.sqlite"), "--no-dht",
                          "--port", "0", "--idle-timeout", "0"], cwd=ROOT, env=child_env(), capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "idle_timeout_s must be in [0.05, 600], got 0.0" in bad.stderr, bad.stderr[-500:]

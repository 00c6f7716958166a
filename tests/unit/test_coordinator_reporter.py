"""Peer reporting client: delivers in the background, never blocks the caller, survives a down or slow coordinator."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _coordinator_helpers import make_identities, round_body, start_server
from _ticket_helpers import admit, certificate

from swarmloco.peer.report_sender import ReportSender, ReportSenderConfig
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.reports import Report

pytestmark = pytest.mark.timeout(60)

FAST = ReportSenderConfig(backoff_initial_s=0.05, backoff_max_s=0.3, heartbeat_interval_s=0, connect_timeout_s=1.0,
                          read_timeout_s=1.0)


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    return make_identities(tmp_path_factory.mktemp("ids"), 2)


def _metrics(reporter: ReportSender, n: int, start: int = 0) -> float:
    """Submit n metrics reports; returns the slowest call's duration."""
    worst = 0.0
    for step in range(start, start + n):
        t = time.perf_counter()
        assert reporter.report_metrics(step=step, train_loss=3.0, tokens_per_s=100.0, tokens_total=step * 10)
        worst = max(worst, time.perf_counter() - t)
    return worst


def test_delivers_everything_in_order(tmp_path: Path, ids: list[Identity]) -> None:
    server = start_server(tmp_path / "db.sqlite", run_id="r")
    ticket = admit(server, ids[0], "r")
    cert = certificate([ids[0]], {ids[0].peer_id: ticket.to_bytes().decode()}, run_id="r", round=1)
    acked: list[tuple[Report, int]] = []
    reporter = ReportSender(server.url, ids[0], "r", config=FAST, on_result=lambda r, s: acked.append((r, s))).start()
    try:
        reporter.hello(version="1", device="cpu", memory_bytes=1, tokens_per_s=5.0)
        _metrics(reporter, 20)
        reporter.report_round(round=1, members=[ids[0].peer_id], tokens=[10], state_hash=cert.statement.new_hash,
                              train_s=1, wait_s=0, average_s=0.1, outcome="committed", eval_loss=float("nan"),
                              certificate=cert.to_bytes().decode())
        assert reporter.close(timeout=10) == 0
        assert all(s == 200 for _, s in acked) and len(acked) == 23  # + bye
        counts = server.store.counts()
        assert counts["reports"] == 23 and counts["metrics"] == 20 and counts["rounds"] == 1
        steps = [m["step"] for m in server.service.metrics(run_id="r", peer_id=None, limit=100, cursor=None,
                                                           descending=False)["items"]]
        assert steps == list(range(20))
        peer = server.service.peers(run_id="r", peer_id=None, limit=5, cursor=None, descending=False)["items"][0]
        assert peer["left_at"] is not None and not peer["online"]
    finally:
        server.stop()


def test_invalid_input_is_dropped_not_raised(tmp_path: Path, ids: list[Identity]) -> None:
    reporter = ReportSender("http://127.0.0.1:9", ids[0], "r", config=FAST)
    assert not reporter.report_round(round=-1, members=[], tokens=[], state_hash=None, train_s=0, wait_s=0,
                                     average_s=0, outcome="bogus")
    assert reporter.stats.dropped == 1 and reporter.stats.pending == 0
    assert reporter.close(timeout=1) == 0


def test_coordinator_down_then_up(tmp_path: Path, ids: list[Identity]) -> None:
    server = start_server(tmp_path / "db.sqlite", run_id="r")
    admit(server, ids[0], "r")  # the ticket is in the database: it still holds after the restart
    port = server.port
    server.stop()  # down before the peer even starts
    reporter = ReportSender(f"http://127.0.0.1:{port}", ids[0], "r", config=FAST).start()
    try:
        worst = _metrics(reporter, 200)
        # a blocking call would take at least the 1 s connect timeout; the margin absorbs a loaded 2-core box
        assert worst < 0.5, f"a report call took {worst:.3f}s while the coordinator was down"
        time.sleep(0.5)
        assert reporter.stats.pending == 200 and reporter.stats.attempts_failed >= 2
        server = start_server(tmp_path / "db.sqlite", run_id="r", port=port)
        assert reporter.flush(timeout=20)
        assert server.store.counts()["metrics"] == 200
        assert reporter.stats.acknowledged == 200
    finally:
        reporter.close(timeout=5)
        server.stop()


class _SlowHandler(http.server.BaseHTTPRequestHandler):
    delay = 3.0

    def do_POST(self) -> None:
        time.sleep(self.delay)
        self.send_response(503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def slow_server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def test_slow_coordinator_never_blocks_and_close_respects_timeout(slow_server: str, ids: list[Identity]) -> None:
    reporter = ReportSender(slow_server, ids[0], "r", config=FAST).start()
    time.sleep(0.1)
    worst = _metrics(reporter, 100)
    assert worst < 0.5, f"a report call took {worst:.3f}s while the coordinator answers after 3 s"
    t = time.monotonic()
    left = reporter.close(timeout=1.5)
    assert time.monotonic() - t < 3.0
    assert left >= 100


def test_bounded_buffer_drops_metrics_first(ids: list[Identity]) -> None:
    config = ReportSenderConfig(buffer_size=10, heartbeat_interval_s=0)
    reporter = ReportSender("http://127.0.0.1:9", ids[0], "r", config=config)  # never started: nothing is sent
    members = [ids[0].peer_id]
    for rnd in range(3):
        assert reporter.report_round(**round_body(rnd, members))
    _metrics(reporter, 50)
    stats = reporter.stats
    assert stats.pending == 10 and stats.dropped == 43
    kinds = [r.kind for r in reporter._queue]
    assert kinds.count("round") == 3
    accepted = [reporter.report_round(**round_body(rnd, members)) for rnd in range(3, 20)]
    assert accepted == [True] * 7 + [False] * 10  # round reports push metrics out, never other round reports
    assert [r.kind for r in reporter._queue] == ["round"] * 10

"""The ingest pipeline behind POST /api/reports: answers as before, batches that arrive together into one commit,
answers only once durable, and stays bounded (503 when full or too slow, and a retry gets the stored answer)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from _coordinator_helpers import make_identities, metrics_body

from swarmloco.coordinator.authority import AuthorityConfig
from swarmloco.coordinator.ingest import IngestConfig
from swarmloco.coordinator.server import CoordinatorConfig, CoordinatorServer
from swarmloco.coordinator.service import ServiceConfig
from swarmloco.coordinator.store import SQLiteStore
from swarmloco.protocol.trust.admission import AdmissionPolicy
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.reports import build_report

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    return make_identities(tmp_path_factory.mktemp("ids"), 2)


def _server(db: Path, ingest: IngestConfig | None = None) -> CoordinatorServer:
    service = ServiceConfig(run_id="run", authority=AuthorityConfig(policy=AdmissionPolicy(mode="none")))
    return CoordinatorServer(CoordinatorConfig(db=db, port=0, dht=False, service=service,
                                               ingest=ingest or IngestConfig())).start(timeout=20)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[CoordinatorServer]:
    srv = _server(tmp_path / "db.sqlite")
    try:
        yield srv
    finally:
        srv.stop()


def _post(server: CoordinatorServer, body: bytes, **kw: Any) -> requests.Response:
    return requests.post(server.url + "/api/reports", data=body, timeout=20, **kw)


def test_answers_are_those_of_the_service(server: CoordinatorServer, ids: list[Identity]) -> None:
    report = build_report(ids[0], "run", "metrics", metrics_body(1))
    first = _post(server, report.encode())
    assert first.status_code == 200 and first.headers["content-type"] == "application/json"
    body = first.json()
    assert body["status"] == "stored" and body["nonce"] == report.nonce and body["kind"] == "metrics"
    again = _post(server, report.encode())  # a retry: the same answer, one row
    assert again.status_code == 200 and again.json() == body
    replay = build_report(ids[0], "run", "metrics", metrics_body(2), nonce=report.nonce)
    assert _post(server, replay.encode()).status_code == 409
    assert _post(server, b"{not json").status_code == 400
    forged = report.encode().replace(report.signature.encode(), b"0" * 128)
    assert _post(server, forged).status_code in (400, 401)
    too_big = _post(server, b"x" * (server.config.service.max_report_bytes + 1))
    assert too_big.status_code == 413 and "larger than" in too_big.json()["error"]
    chunked = _post(server, iter([b"x" * 65536] * 3))  # no Content-Length: counted while read
    assert chunked.status_code == 413
    assert server.store.counts()["reports"] == 1
    # every other route is FastAPI's as before
    assert requests.get(server.url + "/api/reports", timeout=10).status_code == 405
    assert requests.get(server.url + "/healthz", timeout=10).json()["reports"] == 1


def test_reports_that_arrive_together_share_one_commit(tmp_path: Path, ids: list[Identity]) -> None:
    # without verifier threads a report is queued for the writer as it arrives: the test knows when all are
    server = _server(tmp_path / "db.sqlite", IngestConfig(verifiers=0))
    reports = [build_report(ids[i % 2], "run", "metrics", metrics_body(i)) for i in range(20)]
    store, answers = server.store, {}

    def send(i: int) -> None:
        answers[i] = _post(server, reports[i].encode())

    before = store.commits
    store._lock.acquire()  # a commit in progress: the writer waits, verified reports queue behind it
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(reports))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while server.pipeline._pending < len(reports) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not answers  # nothing is answered before its commit
    store._lock.release()
    for t in threads:
        t.join(20)
    assert all(a.status_code == 200 for a in answers.values()) and len(answers) == len(reports)
    assert store.commits - before <= 2  # the writer's first report, then everyone who queued behind it
    server.stop()
    reopened = SQLiteStore(server.config.db)  # durable: on disk, not just in the writer's connection
    assert {n for _, n in reopened.nonces()} == {r.nonce for r in reports}
    reopened.close()


def test_full_pipeline_and_slow_answers_are_503_and_retryable(tmp_path: Path, ids: list[Identity]) -> None:
    server = _server(tmp_path / "db.sqlite", IngestConfig(max_pending=1, answer_timeout_s=0.5))
    held = False
    try:
        first, second = (build_report(ids[0], "run", "metrics", metrics_body(i)) for i in range(2))
        held = server.store._lock.acquire()  # the writer cannot commit
        slow = _post(server, first.encode())
        assert slow.status_code == 503 and "no answer within" in slow.json()["error"]
        assert server.pipeline._pending == 1  # given up on, but still held by the writer: it counts
        busy = _post(server, second.encode())
        assert busy.status_code == 503 and "busy" in busy.json()["error"]
        server.store._lock.release()
        held = False
        deadline = time.monotonic() + 10
        while server.pipeline._pending and time.monotonic() < deadline:  # the writer stores it after all
            time.sleep(0.01)
        retry = _post(server, first.encode())  # stored after its 503: the retry gets the stored answer
        assert retry.status_code == 200 and retry.json()["nonce"] == first.nonce
        assert _post(server, second.encode()).status_code == 200
        assert server.store.counts()["reports"] == 2
    finally:
        if held:
            server.store._lock.release()
        server.stop()


def test_config_is_validated() -> None:
    for bad in ({"verifiers": -1}, {"max_pending": 0}, {"max_batch": 0}, {"answer_timeout_s": 0}):
        with pytest.raises(ValueError):
            IngestConfig(**bad)

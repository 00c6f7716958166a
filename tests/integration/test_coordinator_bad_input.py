"""Hostile input against every endpoint of a real in-process coordinator: each answer is a 4xx (never a 5xx, which
tells a client to retry), with at most one log line and no traceback. Covers numbers beyond a float in every
numeric report field, deep nesting, huge strings and bodies, wrong types, invalid UTF-8 and lone surrogates,
huge or lying Content-Length, and out-of-range listing parameters."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from _coordinator_helpers import hello_body, make_identities, metrics_body, open_authority, round_body
from _log_capture import Captured, captured_logs
from _ticket_helpers import admit

from swarmloco.coordinator.server import CoordinatorConfig, CoordinatorServer
from swarmloco.coordinator.service import ServiceConfig
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.reports import BODY_SCHEMAS, MAX_REPORT_BYTES, build_report
from swarmloco.protocol.trust.ticket_request import build_ticket_request

pytestmark = pytest.mark.timeout(120)

SLOT = "@number@"  # replaced by a raw JSON literal after encoding
HUGE = "1" + "0" * 400
NUMBERS = (HUGE, "-" + HUGE, HUGE + ".5", "1e400", "-1e400", "-1", "1e300", "9007199254740993")
LISTINGS = ("/api/runs", "/api/peers", "/api/rounds", "/api/metrics")


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    return make_identities(tmp_path_factory.mktemp("ids"), 2)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, ids: list[Identity]) -> Iterator[CoordinatorServer]:
    db = tmp_path_factory.mktemp("db") / "db.sqlite"
    srv = CoordinatorServer(CoordinatorConfig(db=db, port=0, dht=False,
                                              service=ServiceConfig(run_id="run", authority=open_authority())))
    srv.start(timeout=20)
    try:
        admit(srv, ids[0], "run")  # a ticket holder: its reports reach the store
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def logs() -> Iterator[Captured]:
    with captured_logs() as handler:
        yield handler


def check(logs: Captured, what: str, status: int, *, ok: tuple[int, ...] = ()) -> None:
    """One hostile request's outcome: a 4xx (or one of ``ok``), at most one log line, no traceback."""
    assert 400 <= status < 500 or status in ok, f"{what}: HTTP {status}"
    assert len(logs.records) <= 1, f"{what}: {[r.getMessage()[:120] for r in logs.records]}"
    assert not logs.tracebacks(), what
    logs.records.clear()


def with_literal(obj: dict[str, Any], literal: str) -> bytes:
    return json.dumps(obj).replace(json.dumps(SLOT), literal).encode()


def raw_exchange(server: CoordinatorServer, data: bytes | tuple[bytes, ...]) -> int:
    """Send ``data`` (parts a moment apart) on a fresh connection; the status of the answer (0 if the server just
    closed)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        for part in (data,) if isinstance(data, bytes) else data:
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.05)
        answer = b""
        while b"\r\n" not in answer:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def bodies(peer: str) -> dict[str, dict[str, Any]]:
    return {"hello": hello_body(), "metrics": metrics_body(3), "round": round_body(4, [peer]),
            "heartbeat": {"round": 3, "tokens_total": 5}}


def test_numbers_beyond_every_field_are_a_4xx(server: CoordinatorServer, ids: list[Identity],
                                              logs: Captured) -> None:
    url = server.url + "/api/reports"
    fields = [(k, n) for k, schema in BODY_SCHEMAS.items() for n, spec in schema.items()
              if spec.kind in ("int", "float", "ints")]
    with requests.Session() as session:
        for kind, name in fields:
            for literal in NUMBERS:
                envelope = build_report(ids[0], "run", kind, bodies(ids[0].peer_id)[kind]).to_json()
                envelope["body"][name] = [SLOT] if BODY_SCHEMAS[kind][name].kind == "ints" else SLOT
                r = session.post(url, data=with_literal(envelope, literal), timeout=10)
                check(logs, f"{kind}.{name}={literal[:12]}", r.status_code)
        for literal in NUMBERS + ("0", "1e11"):
            envelope = build_report(ids[0], "run", "hello", hello_body()).to_json()
            envelope["timestamp"] = SLOT
            check(logs, f"timestamp={literal[:12]}", session.post(url, data=with_literal(envelope, literal),
                                                                  timeout=10).status_code)
            request = build_ticket_request(ids[1], "run").to_json()
            request["timestamp"] = SLOT
            r = session.post(server.url + "/api/tickets", data=with_literal(request, literal), timeout=10)
            check(logs, f"ticket timestamp={literal[:12]}", r.status_code)


def test_malformed_bodies_are_a_4xx(server: CoordinatorServer, ids: list[Identity], logs: Captured) -> None:
    good = build_report(ids[0], "run", "hello", hello_body()).to_json()
    deep = '{"a":' * 20_000 + "1" + "}" * 20_000
    cases: dict[str, bytes] = {
        "empty": b"", "not json": b"hello", "invalid utf-8": b"\xff\xfe\x00{}", "utf-16": '{"a": 1}'.encode("utf-16"),
        "deeply nested object": deep.encode(), "deeply nested array": b"[" * 60_000,
        "nested in a field": json.dumps({**good, "body": {**good["body"], "device": SLOT}}).replace(
            json.dumps(SLOT), "[" * 10_000 + "]" * 10_000).encode(),
        "huge string": json.dumps({**good, "body": {**good["body"], "device": "x" * 100_000}}).encode(),
        "oversized": b" " * (MAX_REPORT_BYTES + 1), "array": b"[]", "null": b"null", "number": b"1" * 30,
        "string": b'"report"', "wrong types": json.dumps({k: [] for k in good}).encode(),
        "NaN": json.dumps({**good, "timestamp": SLOT}).replace(json.dumps(SLOT), "NaN").encode(),
        # lone surrogates pass JSON but SQLite cannot store them: a signed report of a ticket holder
        "lone surrogate": build_report(ids[0], "run", "hello", hello_body(device="\ud800")).encode(),
        "surrogate in a key": json.dumps({**good, "\ud800": 1}).encode(),
    }
    with requests.Session() as session:
        for what, data in cases.items():
            for endpoint in ("/api/reports", "/api/tickets"):
                r = session.post(server.url + endpoint, data=data, timeout=10)
                check(logs, f"{what} -> {endpoint}", r.status_code)
        request = build_ticket_request(ids[1], "run", invite="\ud800").encode()
        check(logs, "ticket with a lone surrogate", session.post(server.url + "/api/tickets", data=request,
                                                                 timeout=10).status_code, ok=(200,))


def test_lying_or_huge_framing_is_a_4xx(server: CoordinatorServer, logs: Captured) -> None:
    head = b"POST /api/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    cases: dict[str, bytes | tuple[bytes, ...]] = {
        "content-length beyond the cap": head + b"Content-Length: 200000\r\n\r\n{}",
        "content-length of 30 digits": head + b"Content-Length: " + b"9" * 30 + b"\r\n\r\n{}",
        "content-length of 5000 digits": head + b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n",
        "negative content-length": head + b"Content-Length: -5\r\n\r\n",
        "two content-lengths": head + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        "chunked past the cap": head + b"Transfer-Encoding: chunked\r\n\r\n"
                                + (b"8000\r\n" + b" " * 0x8000 + b"\r\n") * 5 + b"0\r\n\r\n",
        "bad chunk size": head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
        # more than max_header_bytes buffered without the end of the headers (h11 checks what it buffers)
        "huge header": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000, b"a\r\n\r\n"),
        "garbage request line": b"\x00\xff\xfe GARBAGE\r\n\r\n",
        "huge path": b"GET /" + b"a" * 12_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "bad method on a listing": b"DELETE /api/runs HTTP/1.1\r\nHost: x\r\n\r\n",
    }
    for what, data in cases.items():
        status = raw_exchange(server, data)
        check(logs, what, status or 400)  # closing without an answer is fine too: nothing to retry
    for upgrade in (b"websocket", b"h2c"):  # served as plain HTTP, without a warning per request
        status = raw_exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: "
                              + upgrade + b"\r\n\r\n")
        assert not logs.records, [r.getMessage() for r in logs.records]
        check(logs, upgrade.decode(), status, ok=(200,))


def test_listing_parameters_out_of_range_are_a_4xx(server: CoordinatorServer, logs: Captured) -> None:
    bad = ["cursor=" + "9" * 30, "cursor=9223372036854775808", "cursor=-1", "cursor=1e3", "cursor=" + "9" * 5000,
           "limit=0", "limit=1001", "limit=-5", "limit=" + "9" * 30, "limit=abc", "order=sideways",
           "run_id=" + "x" * 100, "peer_id=" + "x" * 200, "cursor=1&cursor=x"]
    fine = ["cursor=9223372036854775807", "run_id=%ff", "run_id=%00", "peer_id=%ed%a0%80", "%ff=1", "limit=1000"]
    with requests.Session() as session:
        for path in LISTINGS:
            for query in bad:
                r = session.get(f"{server.url}{path}?{query}", timeout=10)
                ignored = path == "/api/runs" and query.startswith(("run_id", "peer_id"))  # not its parameters
                check(logs, f"{path}?{query[:30]}", r.status_code, ok=(200,) if ignored else ())
            for query in fine:
                r = session.get(f"{server.url}{path}?{query}", timeout=10)
                check(logs, f"{path}?{query[:30]}", r.status_code, ok=(200,))
        for path in ("/static/..%2f..%2fetc%2fpasswd", "/static/%00", "/static/" + "a" * 5000, "/%ff",
                     "/api/authority?x=%ff", "/healthz?" + "a=1&" * 1000, "/metrics?x=%00", "/api/revocations/x"):
            r = session.get(server.url + path, timeout=10)
            check(logs, path[:40], r.status_code, ok=(200,))
        assert session.get(server.url + "/healthz", timeout=10).status_code == 200

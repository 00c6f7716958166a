"""HTTP API: ingest, listings, /metrics, /healthz, OpenAPI, and what it rejects: duplicates, forgeries, replays,
schema abuse, pickles. Every peer here holds a ticket (admission `open`), so only the report itself decides."""

from __future__ import annotations

import json
import pickle
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from _coordinator_helpers import hello_body, make_identities, metrics_body, round_body, start_server
from _ticket_helpers import admit_all, certificate, certified_round_body

from swarmloco.coordinator.server import CoordinatorServer
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.reports import build_report, canonical_bytes

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    return make_identities(tmp_path_factory.mktemp("ids"), 3)


@pytest.fixture
def server(tmp_path: Path, ids: list[Identity]) -> Iterator[CoordinatorServer]:
    srv = start_server(tmp_path / "db.sqlite", run_id="run", max_past_s=600, max_future_s=30)
    try:
        srv.tickets = admit_all(srv, ids, "run")  # type: ignore[attr-defined]
        yield srv
    finally:
        srv.stop()


def post(server: CoordinatorServer, data: bytes | str) -> requests.Response:
    return requests.post(server.url + "/api/reports", data=data, timeout=10)


def snapshot(server: CoordinatorServer) -> dict[str, list[tuple[Any, ...]]]:
    store = server.store
    with store._lock:
        return {
            t: [tuple(r) for r in store._conn.execute(f"SELECT * FROM {t} ORDER BY rowid")]
            for t in ("runs", "peers", "reports", "metrics", "rounds", "round_reports")
        }


def test_ingest_and_listings(server: CoordinatorServer, ids: list[Identity]) -> None:
    cert = certificate(ids, server.tickets, run_id="run", round=1)  # type: ignore[attr-defined]
    members = list(cert.statement.members)
    for i in ids:
        assert post(server, build_report(i, "run", "hello", hello_body()).encode()).status_code == 200
        for step in range(3):
            assert post(server, build_report(i, "run", "metrics", metrics_body(step)).encode()).status_code == 200
        body = certified_round_body(round_body(1, members), cert)
        assert post(server, build_report(i, "run", "round", body).encode()).status_code == 200
    assert (
        post(
            server,
            build_report(
                ids[0],
                "run",
                "round",
                round_body(2, members[:2], outcome="discarded", failure_reason="peer left mid all-reduce"),
            ).encode(),
        ).status_code
        == 200
    )

    def get(path, **params):
        return requests.get(server.url + path, params=params, timeout=10).json()
    assert get("/api/runs")["default_run_id"] == "run"
    peers = get("/api/peers", run_id="run")["items"]
    assert len(peers) == 3 and all(p["online"] and p["device"] == "cpu" for p in peers)
    rounds = get("/api/rounds", run_id="run")["items"]
    assert [(r["round"], r["outcome"]) for r in rounds] == [(1, "committed"), (2, "discarded")]
    assert rounds[0]["members"] == members and len(rounds[0]["state_hash"]) == 64 and rounds[0]["certified"]
    assert rounds[1]["failure_reasons"] == ["peer left mid all-reduce"]
    assert len(get("/api/rounds", peer_id=ids[2].peer_id)["items"]) == 1
    page = get("/api/metrics", run_id="run", peer_id=ids[1].peer_id, limit=2)
    assert len(page["items"]) == 2 and page["next_cursor"] is not None
    rest = get("/api/metrics", run_id="run", peer_id=ids[1].peer_id, limit=2, cursor=page["next_cursor"])
    assert [m["step"] for m in page["items"] + rest["items"]] == [0, 1, 2]

    text = requests.get(server.url + "/metrics", timeout=10).text
    assert "swarmloco_peers_online 3.0" in text
    assert 'swarmloco_rounds_total{outcome="committed"} 1.0' in text
    assert 'swarmloco_rounds_total{outcome="discarded"} 1.0' in text
    assert "swarmloco_round_duration_seconds_count 4.0" in text
    assert "swarmloco_tokens_total 1536.0" in text
    assert requests.get(server.url + "/healthz", timeout=10).json()["status"] == "ok"
    schema = requests.get(server.url + "/openapi.json", timeout=10).json()
    assert {"/api/runs", "/api/peers", "/api/rounds", "/api/metrics", "/api/reports", "/api/authority",
            "/api/tickets", "/api/revocations", "/api/checkpoint"} <= set(schema["paths"])
    # the one certified round claims work its credit does not add up to: nothing for the authority to vouch for
    answer = requests.get(server.url + "/api/checkpoint", timeout=10)
    assert answer.status_code == 404 and "no checkpoint yet" in answer.json()["error"]
    html = requests.get(server.url + "/", timeout=10)
    assert html.status_code == 200 and "chart.umd.min.js" in html.text


def test_duplicate_gives_one_row_and_same_answer(server: CoordinatorServer, ids: list[Identity]) -> None:
    report = build_report(ids[0], "run", "metrics", metrics_body(7))
    first = post(server, report.encode())
    state = snapshot(server)
    second = post(server, report.encode())
    assert first.status_code == second.status_code == 200 and first.json() == second.json()
    assert snapshot(server) == state
    # a retry re-signed with a fresh timestamp and the same nonce is the same report
    resigned = build_report(
        ids[0], "run", "metrics", metrics_body(7), nonce=report.nonce, timestamp=report.timestamp + 5
    )
    third = post(server, resigned.encode())
    assert third.status_code == 200 and third.json() == first.json()
    assert snapshot(server) == state


def _forged(ids: list[Identity]) -> bytes:
    obj = build_report(ids[0], "run", "metrics", metrics_body(1)).to_json()
    obj["signature"] = random.Random(1).randbytes(64).hex()
    return json.dumps(obj).encode()


def _changed_after_signing(ids: list[Identity]) -> bytes:
    obj = build_report(ids[0], "run", "round", round_body(3, [ids[0].peer_id])).to_json()
    obj["body"]["tokens"] = [10**9]
    return json.dumps(obj).encode()


def _other_peers_key(ids: list[Identity]) -> bytes:
    obj = build_report(ids[1], "run", "metrics", metrics_body(1)).to_json()
    obj["peer_id"] = ids[0].peer_id
    obj["signature"] = ids[1].sign(canonical_bytes(obj)).hex()
    return json.dumps(obj).encode()


def _timestamp(offset: float) -> Callable[[list[Identity]], bytes]:
    return lambda ids: build_report(ids[0], "run", "metrics", metrics_body(1), timestamp=time.time() + offset).encode()


def _signed_raw(mutate: Callable[[dict[str, Any]], None]) -> Callable[[list[Identity]], bytes]:
    """Apply ``mutate`` and sign properly, so only the schema can refuse it."""

    def make(ids: list[Identity]) -> bytes:
        obj = build_report(ids[0], "run", "metrics", metrics_body(1)).to_json()
        mutate(obj)
        obj["signature"] = ids[0].sign(canonical_bytes(obj)).hex()
        return json.dumps(obj).encode()

    return make


REJECTED: dict[str, tuple[Callable[[list[Identity]], bytes], int]] = {
    "forged signature": (_forged, 401),
    "field changed after signing": (_changed_after_signing, 401),
    "another peer's key": (_other_peers_key, 401),
    "timestamp too old": (_timestamp(-3600), 422),
    "timestamp in the future": (_timestamp(+3600), 422),
    "wrong type": (_signed_raw(lambda o: o["body"].update(step="12")), 400),
    "bool as int": (_signed_raw(lambda o: o["body"].update(step=True)), 400),
    "huge value": (_signed_raw(lambda o: o["body"].update(tokens_total=10**40)), 400),
    "extra body field": (_signed_raw(lambda o: o["body"].update(admin=True)), 400),
    "extra envelope field": (_signed_raw(lambda o: o.update(role="root")), 400),
    "oversized body": (_signed_raw(lambda o: o["body"].update(pad="x" * 140_000)), 413),
    "unknown run id format": (_signed_raw(lambda o: o.update(run_id="a/b")), 400),
    "not json": (lambda ids: b"{{{", 400),
    "empty": (lambda ids: b"", 400),
    "pickle": (lambda ids: pickle.dumps({"peer_id": ids[0].peer_id, "body": {}}), 400),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_rejected_without_state_change(server: CoordinatorServer, ids: list[Identity], case: str) -> None:
    assert post(server, build_report(ids[0], "run", "hello", hello_body()).encode()).status_code == 200
    state = snapshot(server)
    make, status = REJECTED[case]
    resp = post(server, make(ids))
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]
    assert snapshot(server) == state


def test_replayed_nonce_with_other_content(server: CoordinatorServer, ids: list[Identity]) -> None:
    first = build_report(ids[0], "run", "metrics", metrics_body(1))
    assert post(server, first.encode()).status_code == 200
    state = snapshot(server)
    replay = build_report(ids[0], "run", "metrics", metrics_body(2), nonce=first.nonce)
    resp = post(server, replay.encode())
    assert resp.status_code == 409 and "nonce" in resp.json()["error"]
    assert snapshot(server) == state


def test_never_500_on_garbage(server: CoordinatorServer, ids: list[Identity]) -> None:
    rng = random.Random(0)
    good = build_report(ids[0], "run", "round", round_body(1, [i.peer_id for i in ids])).encode()
    for _ in range(150):
        blob = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        resp = post(server, bytes(blob))
        assert resp.status_code < 500, resp.text
    for path in (
        "/api/metrics?limit=-1",
        "/api/rounds?cursor=abc",
        "/api/peers?order=sideways",
        "/api/runs?limit=100000",
        "/api/metrics?run_id=" + "x" * 500,
    ):
        resp = requests.get(server.url + path, timeout=10)
        assert 400 <= resp.status_code < 500 and resp.json()["error"], path
    assert requests.get(server.url + "/api/reports", timeout=10).status_code == 405

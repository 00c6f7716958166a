"""Out-of-range numbers in reports and ticket requests are refused with a ReportError (a 4xx), never an exception
of another type: an integer too large for a float made ``math.isfinite`` raise OverflowError, which the
coordinator answered with 503 and two tracebacks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _coordinator_helpers import hello_body, make_identities, metrics_body, round_body

import swarmloco.coordinator.authority
import swarmloco.coordinator.service
from swarmloco.coordinator.service import CoordinatorService, ServiceConfig
from swarmloco.coordinator.store import SQLiteStore
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.reports import (
    BODY_SCHEMAS,
    ReportError,
    build_report,
    canonical_bytes,
    parse_report,
    validate_body,
)
from swarmloco.protocol.trust.ticket_request import TicketRequestError, build_ticket_request, parse_ticket_request

pytestmark = pytest.mark.timeout(30)

HUGE = 10**400  # beyond the float range: float(HUGE) raises OverflowError
HUGE_LITERAL = "1" + "0" * 400
SLOT = "@number@"  # replaced by a raw JSON literal after encoding
HOSTILE: tuple[Any, ...] = (HUGE, -HUGE, 2**53 + 1, -1, -1.0, float("inf"), float("-inf"), float("nan"), 1e300,
                            True, "1", [1], {"a": 1})


def _base(kind: str, peer: str) -> dict[str, Any]:
    return {"hello": hello_body(), "metrics": metrics_body(3), "round": round_body(4, [peer]),
            "heartbeat": {"round": 3, "tokens_total": 5}}[kind]


def _numeric_fields() -> list[tuple[str, str]]:
    return [(kind, name) for kind, schema in BODY_SCHEMAS.items() for name, spec in schema.items()
            if spec.kind in ("int", "float", "ints")]


@pytest.fixture(scope="module")
def ident(tmp_path_factory: pytest.TempPathFactory) -> Identity:
    return make_identities(tmp_path_factory.mktemp("ids"), 1)[0]


def test_every_numeric_field_is_covered() -> None:
    # a new numeric field joins the parametrisation below by itself; this guards against the schema moving
    assert len(_numeric_fields()) >= 15


@pytest.mark.parametrize("kind,name", _numeric_fields())
@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: repr(v)[:12])
def test_hostile_number_in_a_body_is_a_report_error(ident: Identity, kind: str, name: str, value: Any) -> None:
    body = _base(kind, ident.peer_id)
    body[name] = [value] if BODY_SCHEMAS[kind][name].kind == "ints" else value
    with pytest.raises(ReportError) as err:
        validate_body(kind, body)
    assert err.value.status == 400 and len(str(err.value)) < 300  # a huge int is not spelled out


@pytest.mark.parametrize("kind,name", _numeric_fields())
@pytest.mark.parametrize("literal", [HUGE_LITERAL, "-" + HUGE_LITERAL, HUGE_LITERAL + ".0", "1e400", "-1e400"])
def test_hostile_literal_on_the_wire_is_a_400(ident: Identity, kind: str, name: str, literal: str) -> None:
    report = build_report(ident, "run", kind, _base(kind, ident.peer_id))
    envelope = report.to_json()
    envelope["body"][name] = [SLOT] if BODY_SCHEMAS[kind][name].kind == "ints" else SLOT
    text = json.dumps(envelope).replace(json.dumps(SLOT), literal)
    with pytest.raises(ReportError) as err:
        parse_report(text.encode())
    assert err.value.status == 400


@pytest.mark.parametrize("literal", [HUGE_LITERAL, "-" + HUGE_LITERAL, "1e400", "0", "-5", "100000000000"])
def test_hostile_timestamp_is_a_400(ident: Identity, literal: str) -> None:
    envelope = build_report(ident, "run", "hello", hello_body()).to_json()
    envelope["timestamp"] = SLOT
    with pytest.raises(ReportError) as err:
        parse_report(json.dumps(envelope).replace(json.dumps(SLOT), literal).encode())
    assert err.value.status == 400


@pytest.mark.parametrize("literal", [HUGE_LITERAL, "-" + HUGE_LITERAL, "1e400", "1" + "0" * 21])
def test_hostile_ticket_request_timestamp_is_a_400(ident: Identity, literal: str) -> None:
    request = build_ticket_request(ident, "run").to_json()
    request["timestamp"] = SLOT
    with pytest.raises(TicketRequestError) as err:
        parse_ticket_request(json.dumps(request).replace(json.dumps(SLOT), literal).encode())
    assert err.value.status == 400


def test_in_range_numbers_still_pass(ident: Identity) -> None:
    body = hello_body()
    body["memory_bytes"] = 2**53  # the largest integer a field takes, 16 digits
    body["tokens_per_s"] = 1e12
    report = parse_report(build_report(ident, "run", "hello", body).encode())
    assert report.body["memory_bytes"] == 2**53
    # an int literal in a float field is the wrong canonical type (400), not a crash
    envelope = build_report(ident, "run", "hello", hello_body(tokens_per_s=5.0)).to_json()
    envelope["body"]["tokens_per_s"] = 5
    envelope["signature"] = ident.sign(canonical_bytes(envelope)).hex()
    with pytest.raises(ReportError, match="canonical JSON type"):
        parse_report(json.dumps(envelope).encode())


@pytest.mark.parametrize("error", [OverflowError("int too large"), RecursionError("deep"), TypeError("x"),
                                   KeyError("k"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad")])
def test_a_gap_in_a_parser_is_still_a_400_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture, error: Exception) -> None:
    # whatever the validators miss, bytes from a client that crash a parser are the client's fault: 400, not 503
    service = CoordinatorService(SQLiteStore(tmp_path / "db.sqlite"), ServiceConfig(run_id="run"))

    def choke(*_: Any, **__: Any) -> Any:
        raise error

    monkeypatch.setattr(swarmloco.coordinator.service, "parse_report", choke)
    monkeypatch.setattr(swarmloco.coordinator.authority, "parse_ticket_request", choke)
    for answer in (service.ingest(b"{}", client="10.0.0.1"), service.request_ticket(b"{}", client="10.0.0.1")):
        assert answer.status == 400 and type(error).__name__ in answer.body["error"], answer
    assert [r.exc_info for r in caplog.records] == [None, None]  # one line each, no traceback
    service.store.close()

"""Report schema: signing, canonical bytes, and rejection of malformed input: forged, tampered,
replayed, wrongly typed or oversized reports."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from typing import Any

import pytest
from _coordinator_helpers import hello_body, make_identities, metrics_body, round_body

from swarmloco.protocol.trust.identity import Identity, peer_id_from_public_key
from swarmloco.protocol.trust.reports import (
    MAX_CERTIFICATE_CHARS,
    MAX_MEMBERS,
    MAX_REPORT_BYTES,
    ReportError,
    build_report,
    canonical_bytes,
    content_hash,
    parse_report,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    return make_identities(tmp_path_factory.mktemp("ids"), 2)


def _resign(identity: Identity, obj: dict[str, Any]) -> bytes:
    obj["signature"] = identity.sign(canonical_bytes(obj)).hex()
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    "kind,body",
    [
        ("hello", hello_body()),
        ("heartbeat", {"round": 3, "tokens_total": 10}),
        ("heartbeat", {}),
        ("metrics", metrics_body(5)),
        ("metrics", {**metrics_body(5), "train_loss": None, "eval_loss": 2.0}),
        ("bye", {"reason": "done"}),
        ("round", None),
    ],
)
def test_round_trip(ids: list[Identity], kind: str, body: dict[str, Any] | None) -> None:
    body = body if body is not None else round_body(1, [i.peer_id for i in ids])
    report = build_report(ids[0], "run-1", kind, body)
    parsed = parse_report(report.encode())
    assert parsed == report


def test_content_hash_ignores_timestamp_and_key_order(ids: list[Identity]) -> None:
    a = build_report(ids[0], "r", "metrics", metrics_body(1), nonce="ab" * 16, timestamp=1000.0)
    b = build_report(
        ids[0], "r", "metrics", dict(reversed(list(metrics_body(1).items()))), nonce="ab" * 16, timestamp=2000.0
    )
    assert content_hash(a.to_json()) == content_hash(b.to_json())
    assert a.signature != b.signature
    c = build_report(ids[0], "r", "metrics", metrics_body(2), nonce="ab" * 16)
    assert content_hash(c.to_json()) != content_hash(a.to_json())


def test_tampering_and_foreign_keys_fail_signature(ids: list[Identity]) -> None:
    report = build_report(ids[0], "r", "metrics", metrics_body(1))
    tampered = report.to_json()
    tampered["body"]["train_loss"] = 0.01
    with pytest.raises(ReportError) as e:
        parse_report(json.dumps(tampered))
    assert e.value.status == 401
    claimed = report.to_json()
    claimed["peer_id"] = ids[1].peer_id  # signed by ids[0], claims to be ids[1]
    with pytest.raises(ReportError) as e:
        parse_report(_resign(ids[0], claimed))
    assert e.value.status == 401


def _mut(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        target = obj
        *parents, last = path.split(".")
        for p in parents:
            target = target[p]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value

    return apply


_DELETE = object()
_HUGE = 10**30


@pytest.mark.parametrize(
    "mutate,match",
    [
        (_mut("extra", 1), "unknown keys"),
        (_mut("body.extra", 1), "unknown keys"),
        (_mut("nonce", _DELETE), "missing keys"),
        (_mut("body.step", _DELETE), "required"),
        (_mut("body.step", "5"), "integer"),
        (_mut("body.step", True), "integer"),
        (_mut("body.step", 5.0), "integer"),
        (_mut("body.step", -1), "outside"),
        (_mut("body.step", _HUGE), "outside"),
        (_mut("body.tokens_total", [1]), "integer"),
        (_mut("body.train_loss", "low"), "number"),
        (_mut("body.train_loss", 1e300), "outside"),
        (_mut("body.tokens_per_s", None), "null"),
        (_mut("body", [1, 2]), "object"),
        (_mut("kind", "shell"), "kind"),
        (_mut("run_id", "../etc"), "run_id"),
        (_mut("run_id", "x" * 100), "run_id"),
        (_mut("timestamp", "now"), "timestamp"),
        (_mut("timestamp", -5.0), "timestamp"),
        (_mut("nonce", "NOT-HEX"), "nonce"),
        (_mut("peer_id", "QmNotAnEd25519Key"), "peer_id"),
        (_mut("signature", "00"), "signature"),
    ],
)
def test_schema_abuse_is_rejected(ids: list[Identity], mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    obj = build_report(ids[0], "r", "metrics", metrics_body(1)).to_json()
    mutate(obj)
    with pytest.raises(ReportError, match=match) as e:
        parse_report(json.dumps(obj))  # the signature is checked last: these fail on structure
    assert e.value.status == 400


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda b: b.update(members=b["members"] * 2, tokens=b["tokens"] * 2), "duplicate"),
        (lambda b: b.update(tokens=b["tokens"][:1]), "entries but body.members"),
        (lambda b: b.update(members=[]), "entries"),
        (lambda b: b.update(outcome="won"), "not one of"),
        (lambda b: b.update(state_hash="XYZ"), "hex"),
        (lambda b: b.update(failure_reason="x" * 5000), "at most"),
        (lambda b: b.update(train_s=float("nan")), "finite"),
        (lambda b: b.update(certificate="x" * (MAX_CERTIFICATE_CHARS + 1)), "at most"),
        (lambda b: b.update(certificate={"statement": {}}), "string"),
        (
            lambda b: b.update(
                members=["p" * 40 + str(i) for i in range(MAX_MEMBERS + 1)], tokens=[1] * (MAX_MEMBERS + 1)
            ),
            "entries",
        ),
    ],
)
def test_round_body_rules(ids: list[Identity], change: Callable[[dict[str, Any]], None], match: str) -> None:
    body = round_body(1, [i.peer_id for i in ids])
    change(body)
    with pytest.raises(ReportError, match=match):
        build_report(ids[0], "r", "round", body)


def test_not_json_nan_oversize_and_pickle(ids: list[Identity]) -> None:
    good = build_report(ids[0], "r", "metrics", metrics_body(1)).encode()
    for raw, status in [
        (b"{not json", 400),
        (b"", 400),
        (b"[]", 400),
        (b"null", 400),
        (good.replace(b'"train_loss":3.0', b'"train_loss":NaN'), 400),
        (b"[" * 100_000 + b"]" * 100_000, 413),
        (b" " * (MAX_REPORT_BYTES + 1), 413),
        (pickle.dumps({"peer_id": ids[0].peer_id}), 400),
        (b"\xff\xfe\x00binary", 400),
    ]:
        with pytest.raises(ReportError) as e:
            parse_report(raw)
        assert e.value.status == status, raw[:40]
    deep = b"[" * 5000 + b"]" * 5000
    with pytest.raises(ReportError):
        parse_report(deep)


def test_certificate_round_trips_and_the_largest_round_report_fits(ids: list[Identity]) -> None:
    body = {**round_body(1, [i.peer_id for i in ids]), "certificate": '{"statement":{}}'}
    assert parse_report(build_report(ids[0], "r", "round", body).encode()).body["certificate"] == body["certificate"]
    members = [peer_id_from_public_key(Identity.generate().public_key()) for _ in range(MAX_MEMBERS)]
    worst = {**round_body(1, members), "tokens": [2**53] * MAX_MEMBERS, "failure_reason": "\u00e9" * 1000,
             "certificate": '"' * MAX_CERTIFICATE_CHARS}  # every char escaped once more inside the report
    raw = build_report(ids[0], "r", "round", worst).encode()
    assert len(raw) <= MAX_REPORT_BYTES
    assert parse_report(raw).body["certificate"] == worst["certificate"]

"""Ticket request schema: a peer proves it owns the key its ticket will name; forged, tampered, malformed, oversized
or stale requests are refused with the right status."""
from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
from _coordinator_helpers import make_identities

from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.ticket_request import (
    MAX_INVITE_CHARS,
    MAX_REQUEST_BYTES,
    TicketRequest,
    TicketRequestError,
    build_ticket_request,
    parse_ticket_request,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    return make_identities(tmp_path_factory.mktemp("ids"), 2)


def _resigned(identity: Identity, obj: dict[str, Any]) -> bytes:
    unsigned = TicketRequest(**{**obj, "signature": ""})
    return json.dumps({**obj, "signature": identity.sign(unsigned.signed_bytes()).hex()}).encode()


def test_round_trip_and_signed_bytes(ids: list[Identity]) -> None:
    request = build_ticket_request(ids[0], "run-1", role="observer", invite="sesame", timestamp=1000.5)
    parsed = parse_ticket_request(request.encode())
    assert parsed == request and parsed.peer_id == ids[0].peer_id
    assert request.signed_bytes().startswith(b"swarmloco-ticket-request-v1\n")
    body = json.loads(request.signed_bytes().split(b"\n", 1)[1])
    assert set(body) == {"peer_id", "run_id", "role", "invite", "timestamp", "nonce"}  # everything but the signature
    again = build_ticket_request(ids[0], "run-1", role="observer", invite="sesame", timestamp=1000.5)
    assert again.nonce != request.nonce and again.digest() != request.digest()


def test_forgeries_fail_the_signature(ids: list[Identity]) -> None:
    request = build_ticket_request(ids[0], "run", invite="")
    for change in ({"invite": "stolen-code"}, {"role": "observer"}, {"run_id": "other"}, {"timestamp": 1.0}):
        with pytest.raises(TicketRequestError) as e:
            parse_ticket_request(json.dumps({**request.to_json(), **change}))
        assert e.value.status == 401, change
    # an attacker asks for a ticket naming the victim's peer id, signing with its own key
    with pytest.raises(TicketRequestError) as e:
        parse_ticket_request(_resigned(ids[1], {**request.to_json(), "peer_id": ids[0].peer_id}))
    assert e.value.status == 401


@pytest.mark.parametrize("change,match", [
    ({"extra": 1}, "unknown keys"),
    ({"nonce": None}, "nonce"),
    ({"role": "admin"}, "role"),
    ({"invite": "x" * (MAX_INVITE_CHARS + 1)}, "invite"),
    ({"invite": 5}, "invite"),
    ({"timestamp": "now"}, "timestamp"),
    ({"timestamp": True}, "timestamp"),
    ({"run_id": "../etc"}, "run_id"),
    ({"peer_id": "QmNotAnEd25519Key"}, "peer_id"),
    ({"signature": "00"}, "signature"),
])
def test_schema_abuse_is_400(ids: list[Identity], change: dict[str, Any], match: str) -> None:
    obj = {**build_ticket_request(ids[0], "run").to_json(), **change}
    with pytest.raises(TicketRequestError, match=match) as e:
        parse_ticket_request(json.dumps(obj))
    assert e.value.status == 400


def test_missing_keys_garbage_and_size(ids: list[Identity]) -> None:
    obj = build_ticket_request(ids[0], "run").to_json()
    del obj["invite"]
    cases: list[tuple[bytes, int]] = [
        (json.dumps(obj).encode(), 400), (b"{", 400), (b"[]", 400), (b"", 400),
        (pickle.dumps({"peer_id": ids[0].peer_id}), 400), (b'{"timestamp": NaN}', 400),
        (b" " * (MAX_REQUEST_BYTES + 1), 413),
    ]
    for raw, status in cases:
        with pytest.raises(TicketRequestError) as e:
            parse_ticket_request(raw)
        assert e.value.status == status, raw[:30]
    with pytest.raises(TicketRequestError, match="role"):
        build_ticket_request(ids[0], "run", role="root")  # nothing the authority would refuse gets signed


def test_clock_window(ids: list[Identity]) -> None:
    request = build_ticket_request(ids[0], "run", timestamp=10_000.0)
    assert request.clock_problem(10_000.0) == ""
    assert request.clock_problem(10_000.0 + 299) == "" and request.clock_problem(10_000.0 - 59) == ""
    assert "accepted window" in request.clock_problem(10_000.0 + 301)  # a captured request is replayable briefly
    assert "accepted window" in request.clock_problem(10_000.0 - 61)  # ahead of the authority's clock

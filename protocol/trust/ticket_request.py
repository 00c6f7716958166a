"""A peer's signed request for an admission ticket: the schema shared by the peer's ticket client and the coordinator.

The request is a JSON object::

    {"peer_id": "12D3KooW...", "run_id": "run-1", "role": "trainer", "invite": "", "timestamp": 1733150000.25,
     "nonce": "<32 hex>", "work": "1234567", "signature": "<128 hex>"}

``signature`` is the Ed25519 signature, by the key inlined in ``peer_id``, of a domain tag followed by the request
without ``signature`` as compact JSON with sorted keys: the requester proves it owns the peer id the ticket will
name, so nobody obtains a ticket for somebody else's key (nor spends its invite code). The timestamp bounds how
long a captured request can be replayed; the nonce lets the authority recognise a retry of the same request.
``work`` is the proof of work an ``open`` run asks of a new identity (protocol/trust/puzzle.py: it is bound to the
run id, the peer id and this timestamp). It may be left out, and is then "" and not part of the signed bytes, so a
request without it reads and verifies as before the field existed.

Pure code, no I/O: anything malformed raises :class:`TicketRequestError` whose ``status`` is the HTTP code to answer.
"""
from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any

from swarmloco.protocol.trust.admission import ROLES
from swarmloco.protocol.trust.identity import Identity, verify
from swarmloco.protocol.trust.puzzle import MAX_WORK_CHARS, WORK_RE
from swarmloco.protocol.trust.reports import NONCE_RE, PEER_ID_RE, RUN_ID_RE, SIG_RE, load_bounded_json

__all__ = [
    "MAX_AGE_S",
    "MAX_AHEAD_S",
    "MAX_INVITE_CHARS",
    "MAX_REQUEST_BYTES",
    "TicketRequest",
    "TicketRequestError",
    "build_ticket_request",
    "parse_ticket_request",
]

MAX_REQUEST_BYTES = 2048
MAX_INVITE_CHARS = 256
MAX_AGE_S = 300.0  # a request is made on the spot, never buffered: a short window limits replays of a captured one
MAX_AHEAD_S = 60.0  # tolerated clock skew ahead of the authority
_DOMAIN = b"swarmloco-ticket-request-v1\n"
_REQUIRED = frozenset({"peer_id", "run_id", "role", "invite", "timestamp", "nonce", "signature"})
_KEYS = _REQUIRED | {"work"}  # work is optional: "" when absent


class TicketRequestError(ValueError):
    """A ticket request is malformed or forged; ``status`` is the HTTP code to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, kw_only=True)
class TicketRequest:
    """A structurally valid ticket request (:func:`parse_ticket_request` also checks its signature)."""

    peer_id: str
    run_id: str
    role: str
    invite: str
    timestamp: float
    nonce: str
    signature: str = ""
    work: str = ""

    def signed_bytes(self) -> bytes:
        fields = self.to_json()
        fields.pop("signature")
        return _DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    def to_json(self) -> dict[str, Any]:
        """The request as sent: without ``work`` when it is empty (the format before the field existed)."""
        fields = asdict(self)
        if not fields["work"]:
            fields.pop("work")
        return fields

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    def digest(self) -> str:
        """SHA-256 of everything signed: two requests with the same nonce and digest are the same request."""
        return hashlib.sha256(self.signed_bytes()).hexdigest()

    def clock_problem(self, now: float, *, max_age_s: float = MAX_AGE_S, max_ahead_s: float = MAX_AHEAD_S) -> str:
        """Why the timestamp is outside the window around ``now`` ("" when inside)."""
        skew = self.timestamp - now
        if skew > max_ahead_s or -skew > max_age_s:
            return (f"timestamp {self.timestamp:.3f} is {skew:+.1f}s from the coordinator's clock; accepted window is "
                    f"-{max_age_s:g}s..+{max_ahead_s:g}s (sign a new request now, and check the clock)")
        return ""


def _validate(obj: Any) -> TicketRequest:
    if type(obj) is not dict:
        raise TicketRequestError(f"ticket request must be a JSON object, got {type(obj).__name__}")
    missing = sorted(_REQUIRED - obj.keys())
    if missing:
        raise TicketRequestError(f"ticket request is missing keys: {', '.join(missing)}")
    extra = sorted(str(k)[:40] for k in obj.keys() - _KEYS)
    if extra:
        raise TicketRequestError(f"ticket request has unknown keys: {', '.join(extra[:5])}")
    peer_id, run_id, role, invite = obj["peer_id"], obj["run_id"], obj["role"], obj["invite"]
    ts, nonce, sig, work = obj["timestamp"], obj["nonce"], obj["signature"], obj.get("work", "")
    if type(peer_id) is not str or not PEER_ID_RE.fullmatch(peer_id):
        raise TicketRequestError("peer_id must be a base58 libp2p peer id")
    if type(run_id) is not str or not RUN_ID_RE.fullmatch(run_id):
        raise TicketRequestError("run_id must be 1-64 chars of letters, digits, '.', '_' or '-', starting alphanumeric")
    if type(role) is not str or role not in ROLES:
        raise TicketRequestError(f"role must be one of {', '.join(ROLES)}")
    if type(invite) is not str or len(invite) > MAX_INVITE_CHARS:
        raise TicketRequestError(f"invite must be a string of at most {MAX_INVITE_CHARS} chars")
    if type(ts) not in (int, float) or not math.isfinite(ts) or not 0 < ts < 1e11:
        raise TicketRequestError("timestamp must be a finite number of seconds since the Unix epoch")
    if type(nonce) is not str or not NONCE_RE.fullmatch(nonce):
        raise TicketRequestError("nonce must be 16-64 lowercase hex digits")
    if type(sig) is not str or not SIG_RE.fullmatch(sig):
        raise TicketRequestError("signature must be 128 lowercase hex digits (an Ed25519 signature)")
    if type(work) is not str or not WORK_RE.fullmatch(work):
        raise TicketRequestError(f"work must be at most {MAX_WORK_CHARS} decimal digits (a proof of work)")
    return TicketRequest(peer_id=peer_id, run_id=run_id, role=role, invite=invite, timestamp=ts, nonce=nonce,
                         signature=sig, work=work)


def parse_ticket_request(raw: bytes | str, *, max_bytes: int = MAX_REQUEST_BYTES) -> TicketRequest:
    """Decode, validate and signature-check one request.

    :raises TicketRequestError: with ``status`` 413 (too large), 400 (malformed) or 401 (bad signature)
    """
    obj = load_bounded_json(raw, max_bytes=max_bytes, what="ticket request", error=TicketRequestError)
    request = _validate(obj)
    if not verify(request.peer_id, request.signed_bytes(), bytes.fromhex(request.signature)):
        raise TicketRequestError("signature does not verify against the key in peer_id", status=401)
    return request


def build_ticket_request(identity: Identity, run_id: str, *, role: str = "trainer", invite: str = "",
                         timestamp: float | None = None, nonce: str | None = None, work: str = "") -> TicketRequest:
    """A request signed by ``identity`` (a fresh random nonce and the current time unless given); ``work`` is a
    proof of work solved for this run, peer id and ``timestamp`` (protocol/trust/puzzle.py)."""
    unsigned = TicketRequest(peer_id=identity.peer_id, run_id=run_id, role=role, invite=invite,
                             timestamp=float(time.time() if timestamp is None else timestamp),
                             nonce=secrets.token_hex(16) if nonce is None else nonce, signature="0" * 128, work=work)
    _validate(unsigned.to_json())  # refuse to sign what the authority would refuse to read
    signed = TicketRequest(**{**unsigned.to_json(), "signature": identity.sign(unsigned.signed_bytes()).hex()})
    return signed

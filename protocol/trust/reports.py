"""Signed peer reports: the schema shared by the peer's reporting client and the coordinator.

A report is a JSON object (the *envelope*)::

    {"peer_id": "12D3KooW...", "run_id": "run-1", "kind": "round", "timestamp": 1733150000.25,
     "nonce": "<32 hex>", "body": {...}, "signature": "<128 hex>"}

``signature`` is the Ed25519 signature, by the key inlined in ``peer_id`` (see
:mod:`swarmloco.protocol.trust.identity`), of :func:`canonical_bytes` — a domain tag followed by the envelope without
``signature`` as compact JSON with sorted keys. Both sides are Python and JSON floats round-trip exactly, so the
verifier recomputes the same bytes from the parsed object.

Idempotency and replays: ``(peer_id, nonce)`` identifies a report. :func:`content_hash` covers everything except
``timestamp`` and ``signature``, so a client may re-sign a buffered report with a fresh timestamp (to stay inside
the coordinator's window) and still be recognised as the same report; the same nonce with different content is a
replay and is refused.

Pure code, no I/O: validation rejects wrong types, non-finite or out-of-range numbers, unknown or missing keys and
oversized reports with a :class:`ReportError` whose message says what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.base.text import bounded
from swarmloco.protocol.trust.identity import Identity, verify

__all__ = [
    "DEVICE_KINDS",
    "KINDS",
    "MAX_CERTIFICATE_CHARS",
    "MAX_REPORT_BYTES",
    "NONCE_RE",
    "OUTCOMES",
    "PEER_ID_RE",
    "ROLES",
    "RUN_ID_RE",
    "SIG_RE",
    "Report",
    "ReportError",
    "build_report",
    "canonical_bytes",
    "content_hash",
    "parse_report",
    "validate_body",
    "validate_envelope",
]

MAX_CERTIFICATE_CHARS = 48 * 1024  # a round's commit certificate, inlined in its round report
# Room for the largest round report: 256 members with their tokens, a failure reason, and a certificate whose
# quotes JSON escapes once more inside the report.
MAX_REPORT_BYTES = 128 * 1024
MAX_MEMBERS = 256
_DOMAIN = b"swarmloco-report-v1\n"
_MAX_INT = 2**53  # JSON-safe integers (JavaScript's dashboard reads them too)
_MAX_INT_CHARS = 20  # a JSON integer literal, sign included: room for any 64-bit integer
_MAX_SECONDS = 1e7
_MAX_LOSS = 1e6

OUTCOMES: tuple[str, ...] = tuple(o.value for o in Outcome)
KINDS: tuple[str, ...] = ("hello", "heartbeat", "metrics", "round", "bye")

RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NONCE_RE = re.compile(r"[0-9a-f]{16,64}")
SIG_RE = re.compile(r"[0-9a-f]{128}")
_HASH_RE = re.compile(r"[0-9a-f]{8,128}")
PEER_ID_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{40,64}")  # base58btc alphabet


class ReportError(ValueError):
    """A report is malformed; ``str(error)`` tells the sender what to fix. ``status`` is the HTTP code to use."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, kw_only=True)
class _Field:
    kind: str  # "int" | "float" | "str" | "hex" | "peer_ids" | "ints" | "enum"
    required: bool = True
    nullable: bool = False
    lo: float = 0
    hi: float = _MAX_INT
    max_len: int = 256
    choices: tuple[str, ...] = ()


_SECONDS = _Field(kind="float", hi=_MAX_SECONDS)
_LOSS_OPT = _Field(kind="float", required=False, nullable=True, hi=_MAX_LOSS)
# Accounting (all optional, the peer's own word): `session` names one run of the peer's process, so the coordinator
# can tell a restart; `pending_tokens` is local work not yet merged into the agreed state; `dropped_tokens` counts,
# for the whole session, local work the peer threw away (progress too stale to keep when it adopted a newer state),
# and `resyncs` how often it adopted a newer state.
_SESSION = _Field(kind="hex", required=False, max_len=64)
_TOKENS_OPT = _Field(kind="int", required=False, hi=2**48)
_BYTES_OPT = _Field(kind="int", required=False, hi=2**48)
DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda", "mps", "xpu", "other")
ROLES: tuple[str, ...] = ("leader", "member")

BODY_SCHEMAS: dict[str, dict[str, _Field]] = {
    "hello": {
        "version": _Field(kind="str", max_len=64),
        "device": _Field(kind="str", max_len=128),
        "memory_bytes": _Field(kind="int"),
        "tokens_per_s": _Field(kind="float", hi=1e12),
        "device_kind": _Field(kind="enum", required=False, choices=DEVICE_KINDS),
        "session": _SESSION,
        "pending_tokens": _TOKENS_OPT,  # local progress this process resumed with
    },
    "heartbeat": {
        "round": _Field(kind="int", required=False, nullable=True),
        "tokens_total": _Field(kind="int", required=False, nullable=True),
    },
    "metrics": {
        "step": _Field(kind="int"),
        "train_loss": _Field(kind="float", nullable=True, hi=_MAX_LOSS),
        "eval_loss": _LOSS_OPT,
        "tokens_per_s": _Field(kind="float", hi=1e12),
        "tokens_total": _Field(kind="int"),
        "session": _SESSION,
        "pending_tokens": _TOKENS_OPT,
        "dropped_tokens": _TOKENS_OPT,
        "resyncs": _Field(kind="int", required=False, hi=2**32),  # this session's adoptions of a newer state
    },
    "round": {
        "round": _Field(kind="int"),
        "members": _Field(kind="peer_ids"),
        "tokens": _Field(kind="ints"),
        "state_hash": _Field(kind="hex", nullable=True),
        "train_s": _SECONDS,
        "wait_s": _SECONDS,
        "average_s": _SECONDS,
        "outcome": _Field(kind="enum", choices=OUTCOMES),
        "failure_reason": _Field(kind="str", required=False, nullable=True, max_len=1000),
        "eval_loss": _LOSS_OPT,
        # Certificate.to_bytes() as text: the coordinator credits a committed round only with a valid one
        "certificate": _Field(kind="str", required=False, nullable=True, max_len=MAX_CERTIFICATE_CHARS),
        "session": _SESSION,
        "pending_tokens": _TOKENS_OPT,
        "dropped_tokens": _TOKENS_OPT,
        "resyncs": _Field(kind="int", required=False, hi=2**32),  # this session's adoptions of a newer state
        "role": _Field(kind="enum", required=False, choices=ROLES),  # this peer led the round, or was a member
        "bytes_sent": _BYTES_OPT,  # this round's averaging traffic
        "bytes_received": _BYTES_OPT,
    },
    "bye": {
        "reason": _Field(kind="str", required=False, nullable=True, max_len=200),
    },
}

_ENVELOPE_KEYS = frozenset({"peer_id", "run_id", "kind", "timestamp", "nonce", "body", "signature"})


def _number_within(value: int | float, lo: float, hi: float) -> bool:
    """``lo <= value <= hi`` and finite, for an int of any size too: ``math.isfinite`` and ``float`` raise
    OverflowError on an int beyond the float range, while comparing an int with a float is exact."""
    if type(value) is float and not math.isfinite(value):
        return False
    return lo <= value <= hi


def _show(value: Any) -> str:
    """A short rendering of a hostile value for an error message (a huge int is not spelled out)."""
    if type(value) is int and abs(value) >= 10**18:
        return f"<{value.bit_length()}-bit integer>"
    return repr(value)[:40]


def _check_value(where: str, spec: _Field, value: Any) -> Any:
    if value is None:
        if spec.nullable:
            return None
        raise ReportError(f"{where} must not be null")
    if spec.kind == "int":
        if type(value) is not int:  # bool is an int subclass: refuse it explicitly
            raise ReportError(f"{where} must be an integer, got {type(value).__name__}")
        if not spec.lo <= value <= spec.hi:
            raise ReportError(f"{where}={_show(value)} is outside [{spec.lo:g}, {spec.hi:g}]")
        return value
    if spec.kind == "float":
        if type(value) not in (int, float):
            raise ReportError(f"{where} must be a number, got {type(value).__name__}")
        if not _number_within(value, spec.lo, spec.hi):
            raise ReportError(f"{where}={_show(value)} is not finite or outside [{spec.lo:g}, {spec.hi:g}]")
        return float(value)  # in range, so an int converts without overflow
    if spec.kind in ("str", "hex", "enum"):
        if type(value) is not str:
            raise ReportError(f"{where} must be a string, got {type(value).__name__}")
        if len(value) > spec.max_len:
            raise ReportError(f"{where} is {len(value)} chars long, at most {spec.max_len} allowed")
        if spec.kind == "hex" and not _HASH_RE.fullmatch(value):
            raise ReportError(f"{where} must be 8-128 lowercase hex digits")
        if spec.kind == "enum" and value not in spec.choices:
            raise ReportError(f"{where}={value[:40]!r} is not one of {', '.join(spec.choices)}")
        return value
    if spec.kind in ("peer_ids", "ints"):
        if type(value) is not list:
            raise ReportError(f"{where} must be a list, got {type(value).__name__}")
        if not 0 < len(value) <= MAX_MEMBERS:
            raise ReportError(f"{where} has {len(value)} entries, expected 1..{MAX_MEMBERS}")
        if spec.kind == "ints":
            return [_check_value(f"{where}[{i}]", _Field(kind="int"), v) for i, v in enumerate(value)]
        for i, v in enumerate(value):
            if type(v) is not str or not PEER_ID_RE.fullmatch(v):
                raise ReportError(f"{where}[{i}] is not a base58 peer id")
        if len(set(value)) != len(value):
            raise ReportError(f"{where} contains duplicate peer ids")
        return list(value)
    raise AssertionError(f"unknown field kind {spec.kind}")  # pragma: no cover - schema bug


def validate_body(kind: str, body: Any) -> dict[str, Any]:
    """Validate a report body of ``kind``; returns a normalised copy (ints stay ints, numbers become floats)."""
    schema = BODY_SCHEMAS.get(kind)
    if schema is None:
        raise ReportError(f"kind must be one of {', '.join(KINDS)}")
    if type(body) is not dict:
        raise ReportError(f"body must be an object, got {type(body).__name__}")
    extra = sorted(str(k)[:40] for k in body if k not in schema)
    if extra:
        raise ReportError(f"body of a {kind} report has unknown keys: {', '.join(extra[:5])}")
    out: dict[str, Any] = {}
    for name, spec in schema.items():
        if name not in body:
            if spec.required:
                raise ReportError(f"body.{name} is required in a {kind} report")
            continue
        out[name] = _check_value(f"body.{name}", spec, body[name])
    if kind == "round" and len(out["members"]) != len(out["tokens"]):
        raise ReportError(
            f"body.tokens has {len(out['tokens'])} entries but body.members has {len(out['members'])}"
        )
    return out


@dataclass(frozen=True, kw_only=True)
class Report:
    """A structurally valid report (the signature is checked separately by :func:`parse_report`)."""

    peer_id: str
    run_id: str
    kind: str
    timestamp: float
    nonce: str
    body: dict[str, Any]
    signature: str

    def to_json(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "run_id": self.run_id,
            "kind": self.kind,
            "timestamp": self.timestamp,
            "nonce": self.nonce,
            "body": self.body,
            "signature": self.signature,
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()


def _unsigned(envelope: Mapping[str, Any]) -> dict[str, Any]:
    return {k: envelope[k] for k in _ENVELOPE_KEYS if k != "signature"}


def canonical_bytes(envelope: Mapping[str, Any]) -> bytes:
    """The exact bytes that are signed: domain tag + sorted compact JSON of the envelope minus ``signature``."""
    return _DOMAIN + json.dumps(
        _unsigned(envelope), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def content_hash(envelope: Mapping[str, Any]) -> str:
    """SHA-256 over everything that identifies a report's content (not ``timestamp`` nor ``signature``)."""
    content = {k: envelope[k] for k in ("peer_id", "run_id", "kind", "nonce", "body")}
    blob = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def validate_envelope(obj: Any) -> Report:
    """Check the envelope's structure and the body's schema. Does not check the signature."""
    if type(obj) is not dict:
        raise ReportError(f"report must be a JSON object, got {type(obj).__name__}")
    missing = sorted(_ENVELOPE_KEYS - obj.keys())
    if missing:
        raise ReportError(f"report is missing keys: {', '.join(missing)}")
    extra = sorted(str(k)[:40] for k in obj.keys() - _ENVELOPE_KEYS)
    if extra:
        raise ReportError(f"report has unknown keys: {', '.join(extra[:5])}")
    peer_id, run_id, kind, ts, nonce, sig = (
        obj["peer_id"], obj["run_id"], obj["kind"], obj["timestamp"], obj["nonce"], obj["signature"]
    )
    if type(peer_id) is not str or not PEER_ID_RE.fullmatch(peer_id):
        raise ReportError("peer_id must be a base58 libp2p peer id")
    if type(run_id) is not str or not RUN_ID_RE.fullmatch(run_id):
        raise ReportError("run_id must be 1-64 chars of letters, digits, '.', '_' or '-', starting alphanumeric")
    if type(kind) is not str or kind not in KINDS:
        raise ReportError(f"kind must be one of {', '.join(KINDS)}")
    # NaN and infinities fail the comparison too; an int of any size compares exactly (no float conversion)
    if type(ts) not in (int, float) or not 0 < ts < 1e11:
        raise ReportError("timestamp must be a finite number of seconds since the Unix epoch")
    if type(nonce) is not str or not NONCE_RE.fullmatch(nonce):
        raise ReportError("nonce must be 16-64 lowercase hex digits")
    if type(sig) is not str or not SIG_RE.fullmatch(sig):
        raise ReportError("signature must be 128 lowercase hex digits (an Ed25519 signature)")
    body = validate_body(kind, obj["body"])
    if body != obj["body"] or any(type(body[k]) is not type(obj["body"][k]) for k in body):
        # numbers were normalised (e.g. int -> float): the signed bytes would differ, so insist on the exact form
        raise ReportError("body numbers must use their canonical JSON type (floats for float fields)")
    return Report(peer_id=peer_id, run_id=run_id, kind=kind, timestamp=float(ts), nonce=nonce, body=body, signature=sig)


def load_bounded_json(raw: bytes | str, *, max_bytes: int, what: str, error: type[ReportError] | Any) -> Any:
    """`raw` as JSON, refusing oversized input (413), NaN/Infinity and anything unparseable (400) with `error`, an
    exception class taking (message, status)."""
    if len(raw) > max_bytes:
        raise error(f"{what} is {len(raw)} bytes, at most {max_bytes} allowed", 413)

    def _no_constants(name: str) -> Any:
        raise error(f"non-finite number {name} is not allowed", 400)

    def _bounded_int(text: str) -> int:
        # No field takes an integer beyond 2**53; refusing long literals here keeps every later check (and
        # float conversion) on numbers a float can hold.
        if len(text) > _MAX_INT_CHARS:
            raise error(f"integer {text[:20]}... ({len(text)} characters) is outside the range of every field "
                        f"(at most {_MAX_INT_CHARS} characters)", 400)
        return int(text)

    try:
        return json.loads(raw, parse_constant=_no_constants, parse_int=_bounded_int)
    except error:
        raise
    except (ValueError, RecursionError) as e:
        raise error(f"{what} is not valid JSON: {bounded(str(e), 200)}", 400) from None


def parse_report(raw: bytes | str, *, max_bytes: int = MAX_REPORT_BYTES) -> Report:
    """Decode, validate and signature-check one report.

    :raises ReportError: with ``status`` 413 (too large), 400 (malformed) or 401 (bad signature)
    """
    obj = load_bounded_json(raw, max_bytes=max_bytes, what="report", error=ReportError)
    report = validate_envelope(obj)
    if not verify(report.peer_id, canonical_bytes(obj), bytes.fromhex(report.signature)):
        raise ReportError("signature does not verify against the key in peer_id", status=401)
    return report


def build_report(
    identity: Identity,
    run_id: str,
    kind: str,
    body: Mapping[str, Any],
    *,
    nonce: str | None = None,
    timestamp: float | None = None,
) -> Report:
    """Validate ``body`` and produce a signed report (a fresh random nonce unless one is given)."""
    clean = validate_body(kind, dict(body))
    envelope: dict[str, Any] = {
        "peer_id": identity.peer_id,
        "run_id": run_id,
        "kind": kind,
        "timestamp": float(time.time() if timestamp is None else timestamp),
        "nonce": nonce if nonce is not None else secrets.token_hex(16),
        "body": clean,
        "signature": "0" * 128,
    }
    validate_envelope(envelope)  # checks run_id / nonce formats before signing
    envelope["signature"] = identity.sign(canonical_bytes(envelope)).hex()
    return Report(**envelope)

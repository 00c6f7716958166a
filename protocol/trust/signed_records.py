"""Signed DHT records: a peer's record is accepted only under its own subkey, signed by it, with its ticket and a
bounded expiry; the run authority's revocation list and checkpoint only under the authority's subkey.

Every DHT node of the run runs `RunValidator` (hivemind calls it on every store it is asked to keep and on every
value a lookup returns), and every reader checks the envelope again with `open_record` before trusting a record,
since a stock hivemind node in the path validates nothing.

Envelope stored as the DHT value: {"record": PeerRecord fields, "ticket": str, "expires": float, "sig": hex}, where
`sig` signs the DHT key, the subkey, the record, the ticket and the expiry: a record cannot be moved to another
peer's subkey, replayed with a longer life, or changed in transit.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import OrderedDict
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarmloco.protocol.base.records import MAX_RECORD_TTL_S, PeerRecord, checkpoint_key, peers_key, revocations_key
from swarmloco.protocol.base.text import short_id
from swarmloco.protocol.trust.admission import Gate, Revocations
from swarmloco.protocol.trust.checkpoints import MAX_CHECKPOINT_TTL_S, Checkpoint
from swarmloco.protocol.trust.identity import Identity, verify

logger = logging.getLogger(__name__)
_DOMAIN = b"swarmloco-record-v1\n"
EXPIRY_SKEW_S = 30.0
MAX_REVOCATION_TTL_S = 300.0  # a revocation list is kept this long past its signing (the authority re-signs it)
# hivemind validates one stored record again on every node it reaches and in every lookup that returns it, so a node
# sees the same bytes many times a minute. A record found valid is trusted, bytes for bytes, for this long: its
# signature and expiry do not change, and a ticket that lapses meanwhile is caught by every reader (`open_record`).
VALID_FOR_S = 30.0
VALID_KEPT = 2048  # records remembered as valid at most (least recently seen dropped first)


class RecordError(ValueError):
    pass


def _signed_bytes(key_id: bytes, subkey: str, record: dict[str, Any], ticket: str, expires: float) -> bytes:
    body = json.dumps({"record": record, "ticket": ticket, "expires": expires}, sort_keys=True, separators=(",", ":"))
    return _DOMAIN + key_id + b"\n" + subkey.encode() + b"\n" + body.encode()


def key_id(key: str) -> bytes:
    """The DHT's id of a key (what validators see as `record.key`)."""
    return DHTID.generate(source=key).to_bytes()


def seal(identity: Identity, run_id: str, record: PeerRecord, ticket: str, expires: float) -> dict[str, Any]:
    value = record.to_value()
    sig = identity.sign(_signed_bytes(key_id(peers_key(run_id)), identity.peer_id, value, ticket, expires))
    return {"record": value, "ticket": ticket, "expires": expires, "sig": sig.hex()}


def open_record(envelope: Any, *, run_id: str, subkey: str, gate: Gate, expiration: float | None = None) -> PeerRecord:
    """The verified record of peer `subkey`; raises RecordError for anything forged, malformed or unadmitted."""
    if not isinstance(envelope, dict) or set(envelope) != {"record", "ticket", "expires", "sig"}:
        raise RecordError("not a signed record envelope")
    record, ticket, expires, sig = envelope["record"], envelope["ticket"], envelope["expires"], envelope["sig"]
    if not (isinstance(ticket, str) and isinstance(sig, str) and isinstance(expires, (int, float))
            and math.isfinite(expires)):
        raise RecordError("envelope fields have the wrong types")
    # The DHT drops a record at its stored expiry, which must be the signed one. A NaN expiry compares as neither
    # earlier nor later than anything: hivemind would keep it forever and the difference below would pass, so a
    # stranger could replay a departed peer's old record for good. Hence finite, and the signed expiry not past.
    if expiration is not None and not (math.isfinite(expiration) and abs(float(expiration) - float(expires)) <= 1e-3):
        raise RecordError("stored expiry differs from the signed one")
    now = get_dht_time()
    if float(expires) > now + MAX_RECORD_TTL_S + EXPIRY_SKEW_S:
        raise RecordError(f"expiry more than {MAX_RECORD_TTL_S:.0f}s ahead")
    if float(expires) < now - EXPIRY_SKEW_S:
        raise RecordError("the record expired")
    parsed = PeerRecord.parse(record)
    if parsed is None:
        raise RecordError("malformed record")
    try:
        raw = bytes.fromhex(sig)
    except ValueError:
        raise RecordError("signature is not hex") from None
    if not verify(subkey, _signed_bytes(key_id(peers_key(run_id)), subkey, record, ticket, float(expires)), raw):
        raise RecordError("record is not signed by the peer whose subkey it is under")
    refused = gate.check(ticket, subkey)
    if refused:
        raise RecordError(f"record's peer is not admitted: {refused}")
    return parsed


class RunValidator(RecordValidatorBase):
    """Validates this run's keys on every DHT node of the run; other keys are refused (we store nothing else)."""

    def __init__(self, run_id: str, authority: str | None) -> None:
        self.run_id, self.authority = run_id, authority
        self._peers = key_id(peers_key(run_id))
        self._revoked = key_id(revocations_key(run_id))
        self._checkpoint = key_id(checkpoint_key(run_id))
        self._valid: OrderedDict[tuple[bytes, bytes, bytes, float], float] = OrderedDict()  # -> trusted until
        self._lock = threading.Lock()  # hivemind may validate from more than one thread

    def validate(self, record: DHTRecord) -> bool:
        seen = (bytes(record.key), bytes(record.subkey), bytes(record.value), float(record.expiration_time))
        now = time.monotonic()
        with self._lock:
            until = self._valid.get(seen)
            if until is not None and until > now:
                self._valid.move_to_end(seen)
                return True
        if not self._validate(record):
            return False
        with self._lock:
            self._valid[seen] = now + VALID_FOR_S
            self._valid.move_to_end(seen)
            while len(self._valid) > VALID_KEPT:
                self._valid.popitem(last=False)
        return True

    def _validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey) if record.subkey else None
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # undecodable bytes from a stranger are simply invalid
            return False
        if not isinstance(subkey, str) or len(subkey) > 128:
            return False
        # (NaN would pass every comparison below: refused first)
        if not math.isfinite(record.expiration_time) or \
                record.expiration_time > get_dht_time() + MAX_RECORD_TTL_S + EXPIRY_SKEW_S:
            return False
        if record.key == self._peers:
            try:
                # Revocations are honoured by readers; a DHT node checks signature, ticket and expiry.
                open_record(value, run_id=self.run_id, subkey=subkey, gate=Gate(self.run_id, self.authority),
                            expiration=record.expiration_time)
            except RecordError as exc:
                logger.debug("refusing a record under …%s: %s", short_id(subkey), exc)
                return False
            return True
        if record.key == self._revoked:
            if self.authority is None or subkey != self.authority:
                return False
            try:
                rev = Revocations.parse(value, run_id=self.run_id, authority=self.authority)
            except ValueError:
                return False
            # The expiry is not signed: bound it by the signing time, so nobody stores an old list with a longer
            # life than the authority's newer one.
            return record.expiration_time <= rev.issued_at + MAX_REVOCATION_TTL_S + EXPIRY_SKEW_S
        if record.key == self._checkpoint:
            if self.authority is None or subkey != self.authority:
                return False
            try:
                cp = Checkpoint.parse(value, run_id=self.run_id, authority=self.authority)
            except ValueError:
                return False
            return record.expiration_time <= cp.issued_at + MAX_CHECKPOINT_TTL_S + EXPIRY_SKEW_S
        return False

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, RunValidator) and (other.run_id, other.authority) == (self.run_id, self.authority)

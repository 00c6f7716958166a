"""Signed DHT records: what every DHT node of the run stores, and what every reader accepts."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarmloco.protocol.base.records import MAX_RECORD_TTL_S, PeerRecord, checkpoint_key, peers_key, revocations_key
from swarmloco.protocol.trust.admission import Gate, Revocations, Ticket
from swarmloco.protocol.trust.checkpoints import MAX_CHECKPOINT_TTL_S, Checkpoint
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.signed_records import (
    RecordError,
    RunValidator,
    key_id,
    open_record,
    seal,
)

RUN = "run-1"
AUTHORITY = Identity(path=Path("<memory>"), private_key=Identity.generate())
VICTIM = Identity(path=Path("<memory>"), private_key=Identity.generate())
ATTACKER = Identity(path=Path("<memory>"), private_key=Identity.generate())


def _ticket(who: Identity) -> str:
    return Ticket.issue(AUTHORITY, run_id=RUN, peer_id=who.peer_id).to_bytes().decode()


def _record(**changes: object) -> PeerRecord:
    base = PeerRecord.announce(fingerprint="fp", config_json="{}", round=3, state_hash="a" * 64, work=30)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def _dht_record(subkey: str, envelope: dict[str, object], expiration: float) -> DHTRecord:
    return DHTRecord(key_id(peers_key(RUN)), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(envelope),
                     expiration)


def test_a_peers_own_signed_record_is_stored_and_read() -> None:
    expires = get_dht_time() + 20
    record = _record()
    envelope = seal(VICTIM, RUN, record, _ticket(VICTIM), expires)
    validator = RunValidator(RUN, AUTHORITY.peer_id)
    assert validator.validate(_dht_record(VICTIM.peer_id, envelope, expires))
    read = open_record(envelope, run_id=RUN, subkey=VICTIM.peer_id, gate=Gate(RUN, AUTHORITY.peer_id),
                       expiration=expires)
    assert read == record


def test_record_overwrite_under_another_peers_subkey_is_refused() -> None:
    """The attack: store a forged round under the victim's subkey with a long life. Every DHT node of the run
    refuses it, and a reader that got it from a node that does not validate refuses it too."""
    validator = RunValidator(RUN, AUTHORITY.peer_id)
    gate = Gate(RUN, AUTHORITY.peer_id)
    expires = get_dht_time() + 20
    forged = seal(ATTACKER, RUN, _record(round=1001, work=10**9), _ticket(ATTACKER), expires)
    assert not validator.validate(_dht_record(VICTIM.peer_id, forged, expires))
    with pytest.raises(RecordError, match="not signed by the peer"):
        open_record(forged, run_id=RUN, subkey=VICTIM.peer_id, gate=gate)
    # a genuine record of the victim, replayed with a longer life or altered, is refused as well
    genuine = seal(VICTIM, RUN, _record(), _ticket(VICTIM), expires)
    assert not validator.validate(_dht_record(VICTIM.peer_id, genuine, expires + 3000))
    altered = {**genuine, "record": {**genuine["record"], "round": 1001}}
    assert not validator.validate(_dht_record(VICTIM.peer_id, altered, expires))
    # a validly signed record that asks to live an hour is refused: a silent peer drops out within minutes
    far = get_dht_time() + 3600
    assert not validator.validate(_dht_record(VICTIM.peer_id, seal(VICTIM, RUN, _record(), _ticket(VICTIM), far), far))
    assert MAX_RECORD_TTL_S < 3600


def test_a_departed_peers_record_replayed_with_a_nan_expiry_is_refused() -> None:
    """The attack: read a peer's genuine record off the DHT and, once it has left, store it again with a NaN expiry.
    NaN is neither before nor after any time, so a hivemind node keeps it for good (and its expiry heap stops
    dropping what lies behind it), and "the stored expiry equals the signed one" used to pass. Every node refuses it
    now, and so does every reader, who also refuses a genuine record whose signed expiry has passed however a node
    kept it."""
    expires = get_dht_time() + 20
    envelope = seal(VICTIM, RUN, _record(), _ticket(VICTIM), expires)
    validator = RunValidator(RUN, AUTHORITY.peer_id)
    gate = Gate(RUN, AUTHORITY.peer_id)
    assert validator.validate(_dht_record(VICTIM.peer_id, envelope, expires))  # the control: as its peer stored it
    for bad in (float("nan"), float("inf")):
        assert not validator.validate(_dht_record(VICTIM.peer_id, envelope, bad))
        with pytest.raises(RecordError, match="stored expiry"):
            open_record(envelope, run_id=RUN, subkey=VICTIM.peer_id, gate=gate, expiration=bad)
    past = get_dht_time() - 600
    stale = seal(VICTIM, RUN, _record(), _ticket(VICTIM), past)
    for stored in (past, None):
        with pytest.raises(RecordError, match="expired"):
            open_record(stale, run_id=RUN, subkey=VICTIM.peer_id, gate=gate, expiration=stored)


def test_records_without_a_valid_ticket_are_refused_unless_the_swarm_is_private() -> None:
    expires = get_dht_time() + 20
    stranger = seal(ATTACKER, RUN, _record(), "", expires)
    assert not RunValidator(RUN, AUTHORITY.peer_id).validate(_dht_record(ATTACKER.peer_id, stranger, expires))
    assert RunValidator(RUN, None).validate(_dht_record(ATTACKER.peer_id, stranger, expires))
    revoked = Gate(RUN, AUTHORITY.peer_id)
    revoked.update_revocations(Revocations.issue(AUTHORITY, run_id=RUN, serial=1, peer_ids=[VICTIM.peer_id]).to_value())
    with pytest.raises(RecordError, match="revoked"):
        open_record(seal(VICTIM, RUN, _record(), _ticket(VICTIM), expires), run_id=RUN, subkey=VICTIM.peer_id,
                    gate=revoked)


def test_only_the_authority_publishes_revocations_and_nothing_else_is_stored() -> None:
    validator = RunValidator(RUN, AUTHORITY.peer_id)
    expires = get_dht_time() + 60
    value = Revocations.issue(AUTHORITY, run_id=RUN, serial=1, peer_ids=[VICTIM.peer_id]).to_value()

    def rec(key: str, subkey: str, v: object) -> DHTRecord:
        return DHTRecord(key_id(key), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(v), expires)

    assert validator.validate(rec(revocations_key(RUN), AUTHORITY.peer_id, value))
    fake = Revocations.issue(ATTACKER, run_id=RUN, serial=2, peer_ids=[]).to_value()
    assert not validator.validate(rec(revocations_key(RUN), ATTACKER.peer_id, fake))
    posing = {**fake, "authority": AUTHORITY.peer_id}
    assert not validator.validate(rec(revocations_key(RUN), AUTHORITY.peer_id, posing))
    assert not validator.validate(rec("some/other/key", ATTACKER.peer_id, {"x": 1}))
    assert not validator.validate(DHTRecord(key_id(peers_key(RUN)), b"\xc1", b"\xc1", expires))


def test_an_old_revocation_list_cannot_be_stored_with_a_longer_life() -> None:
    """The list's DHT expiry is not signed; a node keeps a list only a few minutes past its signing time, so a
    stranger cannot store last hour's list (with fewer revoked peers) to outlive the authority's newer one."""
    validator = RunValidator(RUN, AUTHORITY.peer_id)
    old = Revocations.issue(AUTHORITY, run_id=RUN, serial=1, peer_ids=[], now=get_dht_time() - 3600).to_value()
    fresh = Revocations.issue(AUTHORITY, run_id=RUN, serial=2, peer_ids=[VICTIM.peer_id]).to_value()

    def rec(value: object, expires: float) -> DHTRecord:
        return DHTRecord(key_id(revocations_key(RUN)), MSGPackSerializer.dumps(AUTHORITY.peer_id),
                         MSGPackSerializer.dumps(value), expires)

    assert not validator.validate(rec(old, get_dht_time() + 300))
    assert validator.validate(rec(fresh, get_dht_time() + 120))


def test_only_the_authority_publishes_a_checkpoint_and_not_for_longer_than_it_lives() -> None:
    validator = RunValidator(RUN, AUTHORITY.peer_id)

    def rec(subkey: str, value: object, expires: float) -> DHTRecord:
        return DHTRecord(key_id(checkpoint_key(RUN)), MSGPackSerializer.dumps(subkey),
                         MSGPackSerializer.dumps(value), expires)

    now = get_dht_time()
    value = Checkpoint.issue(AUTHORITY, run_id=RUN, round=7, state_hash="c" * 64, work=700,
                             seniors={VICTIM.peer_id: (700, 7)}, now=now).to_value()
    assert validator.validate(rec(AUTHORITY.peer_id, value, now + 300))
    assert not validator.validate(rec(AUTHORITY.peer_id, value, now + MAX_CHECKPOINT_TTL_S + 120))
    fake = Checkpoint.issue(ATTACKER, run_id=RUN, round=9, state_hash="f" * 64, work=10**12,
                            seniors={ATTACKER.peer_id: (10**12, 99)}, now=now).to_value()
    assert not validator.validate(rec(ATTACKER.peer_id, fake, now + 300))
    assert not validator.validate(rec(AUTHORITY.peer_id, {**fake, "authority": AUTHORITY.peer_id}, now + 300))
    assert not RunValidator(RUN, None).validate(rec(AUTHORITY.peer_id, value, now + 300))  # a private swarm


def test_a_record_seen_again_is_not_verified_again_and_a_forgery_never_rides_on_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """hivemind hands a node the same stored bytes many times a minute: the signature of bytes found valid is not
    checked again while they are remembered. Anything that differs by a byte (the forged round under the victim's
    subkey, the genuine record with a longer life) is verified in full and refused, however often it comes; after
    VALID_FOR_S the remembered record is verified again; memory stays bounded."""
    from swarmloco.protocol.trust import signed_records

    calls: list[str] = []
    real_verify = signed_records.verify

    def counted(peer_id: str, data: bytes, sig: bytes) -> bool:
        calls.append(peer_id)
        return real_verify(peer_id, data, sig)

    monkeypatch.setattr(signed_records, "verify", counted)
    now = [1000.0]
    monkeypatch.setattr(signed_records.time, "monotonic", lambda: now[0])
    validator = RunValidator(RUN, AUTHORITY.peer_id)
    expires = get_dht_time() + 20
    genuine = _dht_record(VICTIM.peer_id, seal(VICTIM, RUN, _record(), _ticket(VICTIM), expires), expires)
    assert all(validator.validate(genuine) for _ in range(5)) and len(calls) == 1
    forged = seal(ATTACKER, RUN, _record(round=1001), _ticket(ATTACKER), expires)
    longer = _dht_record(VICTIM.peer_id, seal(VICTIM, RUN, _record(), _ticket(VICTIM), expires), expires + 3000)
    for _ in range(3):
        assert not validator.validate(_dht_record(VICTIM.peer_id, forged, expires))
        assert not validator.validate(longer)
    assert len(calls) == 1 + 3
    now[0] += signed_records.VALID_FOR_S + 1
    assert validator.validate(genuine) and len(calls) == 5
    monkeypatch.setattr(signed_records, "VALID_KEPT", 3)
    for round_number in range(6):
        record = seal(VICTIM, RUN, _record(round=round_number), _ticket(VICTIM), expires)
        assert validator.validate(_dht_record(VICTIM.peer_id, record, expires))
    assert len(validator._valid) == 3

"""Tickets, revocation lists, admission policies and commit certificates: everything a peer checks offline."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from swarmloco.protocol.trust.admission import (
    AdmissionError,
    AdmissionPolicy,
    Gate,
    Revocations,
    Ticket,
    load_allowlist,
)
from swarmloco.protocol.trust.certificates import Certificate, Statement, need, supports
from swarmloco.protocol.trust.identity import Identity

RUN = "run-1"


def _identity() -> Identity:
    return Identity(path=Path("<memory>"), private_key=Identity.generate())


AUTHORITY, PEER, OTHER = _identity(), _identity(), _identity()


def _gate(**kw: object) -> Gate:
    return Gate(RUN, AUTHORITY.peer_id, **kw)  # type: ignore[arg-type]


def test_a_ticket_admits_exactly_its_peer_to_its_run_until_it_expires() -> None:
    ticket = Ticket.issue(AUTHORITY, run_id=RUN, peer_id=PEER.peer_id, lifetime_s=600, now=1000.0)
    raw = ticket.to_bytes()
    assert Ticket.from_bytes(raw) == ticket
    assert _gate(clock=lambda: 1100.0).check(raw, PEER.peer_id) == ""
    assert "belongs to" in _gate(clock=lambda: 1100.0).check(raw, OTHER.peer_id)  # stolen ticket
    assert "expired" in _gate(clock=lambda: 1000.0 + 600 + 61).check(raw, PEER.peer_id)
    assert "not valid yet" in _gate(clock=lambda: 900.0).check(raw, PEER.peer_id)
    assert "for run" in Gate("run-2", AUTHORITY.peer_id, clock=lambda: 1100.0).check(raw, PEER.peer_id)
    assert "signed by" in Gate(RUN, OTHER.peer_id, clock=lambda: 1100.0).check(raw, PEER.peer_id)
    observer = Ticket.issue(AUTHORITY, run_id=RUN, peer_id=PEER.peer_id, role="observer", now=1000.0)
    assert "role" in _gate(clock=lambda: 1100.0).check(observer, PEER.peer_id, role="trainer")
    assert _gate(clock=lambda: 1000.0 + 86400).check(raw, PEER.peer_id, grace_s=86400) == ""


def test_a_forged_or_altered_ticket_is_refused() -> None:
    ticket = Ticket.issue(AUTHORITY, run_id=RUN, peer_id=PEER.peer_id, now=1000.0)
    gate = _gate(clock=lambda: 1100.0)
    longer = replace(ticket, expires_at=ticket.expires_at + 86400)  # extends its own ticket
    assert "signature is invalid" in gate.check(longer, PEER.peer_id)
    self_signed = Ticket.issue(PEER, run_id=RUN, peer_id=PEER.peer_id, now=1000.0)  # claims to be the authority
    assert "signature is invalid" in gate.check(replace(self_signed, authority=AUTHORITY.peer_id), PEER.peer_id)
    for junk in (b"", b"{", b"[]", b'{"run_id": 1}', b"x" * 5000):
        assert gate.check(junk, PEER.peer_id)
    assert gate.check(None, PEER.peer_id) == "no ticket"
    assert Gate(RUN, None).check(None, PEER.peer_id) == ""  # a private swarm checks nothing


def test_revocations_replace_older_lists_and_refuse_the_revoked() -> None:
    gate = _gate()
    ticket = Ticket.issue(AUTHORITY, run_id=RUN, peer_id=PEER.peer_id)
    first = Revocations.issue(AUTHORITY, run_id=RUN, serial=1, peer_ids=[PEER.peer_id])
    assert gate.update_revocations(first.to_value())
    assert gate.check(ticket, PEER.peer_id) == "peer is revoked by the run's authority"
    assert not gate.update_revocations(first.to_value())  # the same list again changes nothing
    older = Revocations.issue(AUTHORITY, run_id=RUN, serial=0, peer_ids=[])
    assert not gate.update_revocations(older.to_value()) and PEER.peer_id in gate.revoked  # no rollback
    forged = Revocations.issue(OTHER, run_id=RUN, serial=9, peer_ids=[])  # a stranger "un-revokes"
    assert not gate.update_revocations({**forged.to_value(), "authority": AUTHORITY.peer_id})
    tampered = {**Revocations.issue(AUTHORITY, run_id=RUN, serial=5, peer_ids=[PEER.peer_id]).to_value(),
                "peer_ids": []}
    assert not gate.update_revocations(tampered) and PEER.peer_id in gate.revoked
    lifted = Revocations.issue(AUTHORITY, run_id=RUN, serial=2, peer_ids=[])
    assert gate.update_revocations(lifted.to_value()) and gate.check(ticket, PEER.peer_id) == ""


def test_admission_policies(tmp_path: Path) -> None:
    assert AdmissionPolicy(mode="open").refusal(PEER.peer_id) == ""
    invite = AdmissionPolicy(mode="invite", invite_codes=frozenset({"s3cret"}))
    assert invite.refusal(PEER.peer_id, "s3cret") == "" and "invite" in invite.refusal(PEER.peer_id, "guess")
    assert "invite" in invite.refusal(PEER.peer_id, "ünïcode")
    allow = tmp_path / "allow.txt"
    allow.write_text(f"# lab machines\n{PEER.peer_id}  # gpu-1\n\n")
    policy = AdmissionPolicy(mode="allowlist", allowlist=load_allowlist(allow))
    assert policy.refusal(PEER.peer_id) == "" and "allowlist" in policy.refusal(OTHER.peer_id)
    assert "no tickets" in AdmissionPolicy(mode="none").refusal(PEER.peer_id)
    for bad in (dict(mode="closed"), dict(mode="invite"), dict(mode="allowlist"), dict(ticket_s=1)):
        with pytest.raises(AdmissionError):
            AdmissionPolicy(**bad)  # type: ignore[arg-type]
    allow.write_text("not-a-peer-id\n")
    with pytest.raises(AdmissionError, match="allow.txt:1"):
        load_allowlist(allow)


def _statement(members: list[Identity], swarm: int) -> Statement:
    ids = sorted(m.peer_id for m in members)
    return Statement(run_id=RUN, round=4, prev_hash="a" * 64, new_hash="b" * 64, members=tuple(ids),
                     weights=tuple(100 for _ in ids), swarm=swarm, work=1000 + 100 * len(ids))


def _certificate(signers: list[Identity], members: list[Identity], swarm: int) -> Certificate:
    s = _statement(members, swarm)
    tickets = {m.peer_id: Ticket.issue(AUTHORITY, run_id=RUN, peer_id=m.peer_id).to_bytes().decode() for m in signers}
    return Certificate(s, {m.peer_id: Certificate.sign(m, s) for m in signers}, tickets)


def test_a_certificate_needs_a_majority_of_admitted_member_signatures() -> None:
    members = [_identity() for _ in range(3)]
    gate = _gate()
    good = _certificate(members, members, swarm=4)
    assert good.problem(run_id=RUN, gate=gate, quorum=2) == ""
    assert Certificate.from_bytes(good.to_bytes()) == good
    two = _certificate(members[:2], members, swarm=4)  # 2 of a swarm of 4 is no majority
    assert "2 valid signature(s), 3 needed" in two.problem(run_id=RUN, gate=gate, quorum=2)
    assert two.problem(run_id=RUN, gate=gate, quorum=2) and not _certificate(
        members[:2], members, swarm=3).problem(run_id=RUN, gate=gate, quorum=2)
    sybil = _identity()  # a key with no ticket signs as a "member"
    forged = _certificate(members[:2], [*members, sybil], swarm=4)
    forged = Certificate(forged.statement, {**forged.signatures, sybil.peer_id: Certificate.sign(sybil,
                                                                                                 forged.statement)},
                         forged.tickets)
    assert "not admitted" in forged.problem(run_id=RUN, gate=gate, quorum=2)
    # a signature that does not count is skipped, not fatal: extra junk beside three valid ones still proves it
    junk = Certificate(good.statement, {**good.signatures, OTHER.peer_id: "00" * 64}, good.tickets)
    assert junk.problem(run_id=RUN, gate=gate, quorum=2) == ""
    swapped = dict(list(good.signatures.items())[:2]) | {OTHER.peer_id: Certificate.sign(OTHER, good.statement)}
    outsider = Certificate(good.statement, swapped, good.tickets)
    assert "not a member" in outsider.problem(run_id=RUN, gate=gate, quorum=2)
    hostile = Certificate(good.statement, {"\ud800": "zz"}, {"\ud800": "\ud800"})  # lone surrogates
    assert "valid signature(s)" in hostile.problem(run_id=RUN, gate=gate, quorum=2)
    assert _gate().check("\ud800", PEER.peer_id)
    altered = Certificate(replace(good.statement, new_hash="c" * 64), good.signatures, good.tickets)
    assert "invalid" in altered.problem(run_id=RUN, gate=gate, quorum=2)
    assert "for run" in good.problem(run_id="run-2", gate=Gate("run-2", AUTHORITY.peer_id), quorum=2)
    revoked = _gate()
    revoked.update_revocations(Revocations.issue(AUTHORITY, run_id=RUN, serial=1,
                                                 peer_ids=[members[0].peer_id]).to_value())
    assert "revoked" in good.problem(run_id=RUN, gate=revoked, quorum=2)


def test_statement_bounds_and_the_majority_rules() -> None:
    members = [_identity() for _ in range(2)]
    s = _statement(members, swarm=2)
    assert s.problem() == ""
    assert replace(s, swarm=1).problem()  # fewer peers than members
    assert replace(s, work=10).problem()  # work below this round's weights
    assert replace(s, members=tuple(reversed(s.members))).problem()  # not sorted
    assert replace(s, round=0).problem() and replace(s, prev_hash="x").problem()
    assert [need(n, 2) for n in (1, 2, 3, 4, 5, 8)] == [2, 2, 2, 3, 3, 5]
    assert supports(replace(s, swarm=4), 8) and not supports(replace(s, swarm=3), 8)
    for junk in (b"", b"{}", b"[1]", b'{"statement": {}, "signatures": {}, "tickets": {}}', b"{" * 600_000):
        with pytest.raises(ValueError):
            Certificate.from_bytes(junk)


def test_a_member_signs_only_a_statement_that_extends_its_state_with_plausible_weights() -> None:
    from swarmloco.protocol.trust.certificates import Head, refusal_to_sign

    leader, me, other = (_identity().peer_id for _ in range(3))
    group = [leader, me, other]
    members = tuple(sorted(group))
    weights = {leader: 100, me: 90, other: 300}
    prev = Head(3, "a" * 64, 1000)
    s = Statement(run_id=RUN, round=4, prev_hash="a" * 64, new_hash="b" * 64, members=members,
                  weights=tuple(weights[m] for m in members), swarm=3, work=1000 + 490)

    def refusal(statement: Statement, **kw: object) -> str:
        args: dict[str, object] = dict(round_number=3, swarm=3, group_members=group, me=me, my_tokens=90)
        return refusal_to_sign(statement, prev, **{**args, **kw})  # type: ignore[arg-type]

    assert refusal(s) == ""
    assert "another state" in refusal(replace(s, prev_hash="c" * 64))
    assert "work" in refusal(replace(s, work=10**12))
    assert "swarm" in refusal(s, swarm=4)
    assert "outside our group" in refusal(s, group_members=[leader, me])
    assert "our weight" in refusal(s, my_tokens=10)  # the leader gave us more weight than we claimed
    # (a leader that inflates its own weight is caught earlier: every member re-derives the weights from the
    # contributors' signed claims, tests/unit/test_signed_claims.py)


def test_the_leader_order_seed_needs_the_members_signatures() -> None:
    """The next round's leader order is drawn from the certified hash and the members' signatures: a leader that
    tries averages offline cannot compute it, and junk it adds to the certificate does not change it."""
    from swarmloco.protocol.trust.certificates import Head

    members = [_identity() for _ in range(3)]
    cert = _certificate(members, members, swarm=3)
    head = Head.of(cert)
    assert head.seed != head.state_hash and Head(0, "a" * 64).seed == "a" * 64
    padded = Certificate(cert.statement, {**cert.signatures, OTHER.peer_id: "00" * 64, "x": "zz"}, cert.tickets)
    assert Head.of(padded).seed == head.seed
    fewer = Certificate(cert.statement, dict(list(cert.signatures.items())[:2]), cert.tickets)
    assert Head.of(fewer).seed != head.seed

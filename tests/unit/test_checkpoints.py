"""Authority checkpoints: the signed value, seniority, and what a peer holding one refuses. Sybils (admitted, free
identities) sign valid certificates for a fabricated state ahead of the honest chain, or for a heavier chain beside
it: with a checkpoint naming the honest peers' seniority, no honest peer adopts either, and a peer that adopted a
heavier chain before the checkpoint arrived goes back to the checkpointed one. Each case has its control: without
the checkpoint, the same certificate is adopted."""
from __future__ import annotations

from pathlib import Path

import pytest
from _fake_rounds import admitted_round_one, announce, averager_for, serve_state, ticketed

from swarmloco.protocol.chain.forks import Behind
from swarmloco.protocol.chain.state_sync import ServedState
from swarmloco.protocol.round.averager import Averager
from swarmloco.protocol.testing.fake import FakeNetwork, FakeTransport
from swarmloco.protocol.trust.admission import Gate, Ticket
from swarmloco.protocol.trust.certificates import Certificate, Head, Statement
from swarmloco.protocol.trust.checkpoints import (
    MAX_SENIORS,
    PROBATION_ROUNDS,
    Checkpoint,
    CheckpointError,
    supports_by_seniority,
)
from swarmloco.protocol.trust.identity import Identity

pytestmark = pytest.mark.timeout(60)
AUTHORITY = Identity(path=Path("<memory>"), private_key=Identity.generate())
RUN = "fake-run"


def _key() -> Identity:
    return Identity(path=Path("<memory>"), private_key=Identity.generate())


def _checkpoint(round_number: int = 3, state_hash: str = "c" * 64, *, seniors: dict[str, tuple[int, int]],
                now: float = 1000.0, run_id: str = RUN) -> Checkpoint:
    return Checkpoint.issue(AUTHORITY, run_id=run_id, round=round_number, state_hash=state_hash, work=300,
                            seniors=seniors, now=now)


# --- the signed value ----------------------------------------------------------------------------------------------
def test_a_checkpoint_round_trips_and_any_change_breaks_its_signature() -> None:
    cp = _checkpoint(seniors={"a": (100, 3), "b": (50, 1)})
    assert Checkpoint.parse(cp.to_value(), run_id=RUN, authority=AUTHORITY.peer_id) == cp
    for field, value in [("round", 4), ("state_hash", "d" * 64), ("work", 10**12), ("seniors", [["a", 10**9, 9]])]:
        with pytest.raises(CheckpointError, match="signature"):
            Checkpoint.parse({**cp.to_value(), field: value}, run_id=RUN, authority=AUTHORITY.peer_id)
    with pytest.raises(CheckpointError, match="another run"):
        Checkpoint.parse(cp.to_value(), run_id="other", authority=AUTHORITY.peer_id)
    with pytest.raises(CheckpointError, match="another run or authority"):
        Checkpoint.parse(cp.to_value(), run_id=RUN, authority=_key().peer_id)
    forged = Checkpoint.issue(_key(), run_id=RUN, round=3, state_hash="c" * 64, work=1, seniors={})
    with pytest.raises(CheckpointError):
        Checkpoint.parse(forged.to_value(), run_id=RUN, authority=AUTHORITY.peer_id)
    for bad in ({**cp.to_value(), "seniors": [["a", -1, 3]]}, {**cp.to_value(), "round": 0}, [1, 2], {"round": 1}):
        with pytest.raises(CheckpointError):
            Checkpoint.parse(bad, run_id=RUN, authority=AUTHORITY.peer_id)


def test_a_checkpoint_lists_at_most_the_heaviest_seniors() -> None:
    cp = _checkpoint(seniors={f"p{i:04d}": (i + 1, 5) for i in range(MAX_SENIORS + 50)})
    assert len(cp.seniors) == MAX_SENIORS and cp.seniority("p0000") == 0  # the lightest fell off


def test_seniority_needs_probation_and_no_one_history_outweighs_the_rest() -> None:
    cp = _checkpoint(seniors={"new": (10**6, PROBATION_ROUNDS - 1), "a": (100, 3), "b": (100, 4), "c": (120, 5),
                              "old": (10**9, 900)})
    assert cp.seniority("new") == 0 and cp.seniority("stranger") == 0
    assert cp.seniority("a") == 100 and cp.seniority("old") == 4 * 100  # capped at 4 × the median senior
    assert cp.weight(["a", "b", "a", "new"]) == 200


def test_sybils_weigh_nothing_however_many() -> None:
    cp = _checkpoint(seniors={"a": (100, 3), "b": (100, 3), "c": (100, 3)})
    sybils = [f"sybil-{i}" for i in range(10)]
    assert supports_by_seniority(cp, sybils, ["a", "b", "c", *sybils]) is False
    assert supports_by_seniority(cp, ["a", "b"], ["a", "b", "c", *sybils]) is True
    assert supports_by_seniority(cp, ["a"], ["a", "b", "c"]) is True  # a third suffices ...
    wide = _checkpoint(seniors={p: (100, 3) for p in "abcdef"})
    assert supports_by_seniority(wide, ["a"], list("abcdef")) is False  # ... a sixth does not
    assert supports_by_seniority(None, sybils, sybils) is None  # no checkpoint: the count rule decides
    assert supports_by_seniority(cp, sybils, sybils) is None  # nobody seen is senior: likewise


def test_the_gate_keeps_the_newest_valid_checkpoint() -> None:
    gate = Gate(RUN, AUTHORITY.peer_id)
    older, newer = _checkpoint(2, now=1000.0, seniors={}), _checkpoint(3, now=1100.0, seniors={})
    assert gate.update_checkpoint(newer.to_value()) and gate.checkpoint == newer
    assert not gate.update_checkpoint(older.to_value()) and gate.checkpoint == newer
    assert not gate.update_checkpoint({**newer.to_value(), "issued_at": 5000.0})  # re-dated: signature breaks
    assert not Gate(RUN, None).update_checkpoint(newer.to_value())  # a private swarm has no authority


# --- what a peer holding a checkpoint refuses ---------------------------------------------------------------------
def _sybils_serve(net: FakeNetwork, *, k: int, round_number: int, prev_hash: str, new_hash: str,
                  work: int, posing_as: tuple[str, ...] = ()) -> FakeTransport:
    """k admitted sybils sign a valid certificate among themselves (a swarm of k); one of them serves it.
    `posing_as`: peers also named as members, with junk in place of their signatures."""
    server_t = ticketed(net.peer(), AUTHORITY)
    signers = [server_t.credentials.identity, *(_key() for _ in range(k - 1))]
    members = tuple(sorted([s.peer_id for s in signers] + list(posing_as)))
    statement = Statement(run_id=server_t.run_id, round=round_number, prev_hash=prev_hash, new_hash=new_hash,
                          members=members, weights=tuple(10**6 for _ in members), swarm=len(members), work=work)
    tickets = {s.peer_id: Ticket.issue(AUTHORITY, run_id=server_t.run_id, peer_id=s.peer_id).to_bytes().decode()
               for s in signers}
    signatures = {s.peer_id: Certificate.sign(s, statement) for s in signers} | {p: "ab" * 64 for p in posing_as}
    cert = Certificate(statement, signatures, tickets)
    bad = averager_for(server_t, quorum=2, gate=Gate(server_t.run_id, AUTHORITY.peer_id))
    serve_state(bad).publish(ServedState(round=round_number, state_hash=new_hash, blob=b"\x00" * 64,
                                         certificate=cert.to_bytes()))
    announce(server_t, round_number, new_hash, work=work, ready=False)
    return server_t


def _target(a: Averager) -> Behind | None:
    records = a.transport.call(a.transport.fetch_records(timeout=1), timeout=5)
    return a.transport.call(a.chain.target(records), timeout=10)


def _hand_out(honest: list[Averager], cp: Checkpoint) -> None:
    for a in honest:
        assert a.gate.update_checkpoint(cp.to_value())


@pytest.mark.parametrize("k", [3, 10])
@pytest.mark.parametrize("checkpointed", [True, False])
def test_sybils_certifying_a_state_ahead_are_not_followed(net: FakeNetwork, k: int, checkpointed: bool) -> None:
    honest, _ = admitted_round_one(net, AUTHORITY, ready=False)
    head = honest[0].head
    if checkpointed:  # the honest peers' work of three rounds, vouched for by the authority
        cp = Checkpoint.issue(AUTHORITY, run_id=head.certificate.statement.run_id, round=head.round,
                              state_hash=head.state_hash, work=head.work,
                              seniors={a.transport.peer_id: (300, 3) for a in honest})
        _hand_out(honest, cp)
    # the fabricated state extends the honest head, with far more work than the honest chain
    _sybils_serve(net, k=k, round_number=head.round + 5, prev_hash=head.state_hash, new_hash="f" * 64,
                  work=10**12)
    targets = [_target(a) for a in honest]
    if checkpointed:
        assert targets == [None] * 3
    else:  # the control: a valid certificate of k admitted signers is followed by fork choice
        assert all(isinstance(t, Behind) and t.state_hash == "f" * 64 for t in targets), targets


def test_junk_signatures_under_seniors_ids_weigh_nothing(net: FakeNetwork) -> None:
    """Ten sybils name the three seniors as co-signers, with junk for their signatures: the certificate is still
    valid (junk signatures are skipped, ten valid ones remain), but only valid signatures carry seniority."""
    honest, _ = admitted_round_one(net, AUTHORITY, ready=False)
    head = honest[0].head
    _hand_out(honest, Checkpoint.issue(AUTHORITY, run_id=head.certificate.statement.run_id, round=head.round,
                                       state_hash=head.state_hash, work=head.work,
                                       seniors={a.transport.peer_id: (300, 3) for a in honest}))
    _sybils_serve(net, k=10, round_number=head.round + 5, prev_hash=head.state_hash, new_hash="f" * 64,
                  work=10**12, posing_as=tuple(a.transport.peer_id for a in honest))
    assert [_target(a) for a in honest] == [None] * 3


@pytest.mark.parametrize("checkpointed", [True, False])
def test_a_heavier_chain_beside_the_checkpoint_loses_to_it(net: FakeNetwork, checkpointed: bool) -> None:
    honest, _ = admitted_round_one(net, AUTHORITY, ready=False)
    head = honest[0].head
    if checkpointed:
        _hand_out(honest, Checkpoint.issue(AUTHORITY, run_id=head.certificate.statement.run_id, round=head.round,
                                           state_hash=head.state_hash, work=head.work, seniors={}))
    # round 1 again, from θ_0 like the honest one, another state, 10^6 times the work: no senior anywhere, so only
    # the checkpoint itself stands in its way
    _sybils_serve(net, k=5, round_number=1, prev_hash=head.certificate.statement.prev_hash, new_hash="f" * 64,
                  work=10**12)
    targets = [_target(a) for a in honest]
    if checkpointed:
        assert targets == [None] * 3
    else:
        assert all(isinstance(t, Behind) and t.state_hash == "f" * 64 for t in targets), targets


def test_a_peer_on_a_heavier_chain_goes_back_to_the_checkpointed_state(net: FakeNetwork) -> None:
    honest, _ = admitted_round_one(net, AUTHORITY, ready=False)
    head = honest[0].head
    straggler = honest[2]
    # it adopted a fabricated round 1 with more work before the checkpoint arrived
    fake = Statement(run_id=head.certificate.statement.run_id, round=1, prev_hash=head.certificate.statement.prev_hash,
                     new_hash="f" * 64, members=("x",), weights=(10**6,), swarm=1, work=10**12)
    straggler.set_state(Head(1, "f" * 64, 10**12, Certificate(fake)))
    assert _target(straggler) is None  # fork choice alone keeps it there: its chain is the heavier
    straggler.gate.update_checkpoint(Checkpoint.issue(
        AUTHORITY, run_id=fake.run_id, round=head.round, state_hash=head.state_hash, work=head.work,
        seniors={a.transport.peer_id: (300, 3) for a in honest}).to_value())
    target = _target(straggler)
    assert isinstance(target, Behind) and (target.round, target.state_hash) == (head.round, head.state_hash)

"""The coordinator's checkpoints: the heaviest certified chain it can vouch for, each member's seniority along it,
and what it refuses to vouch for: a heavier chain that only identities nobody credited signed, and a chain whose
work does not add up. A restarted coordinator goes on from its stored checkpoint."""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from _coordinator_helpers import make_identities, round_body
from _ticket_helpers import ServiceEnv, certified_round_body

from swarmloco.coordinator.checkpoints import CheckpointConfig
from swarmloco.protocol.trust.certificates import Certificate, Statement
from swarmloco.protocol.trust.checkpoints import MAX_SENIORS, Checkpoint
from swarmloco.protocol.trust.identity import Identity

GENESIS = "0" * 64


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    return make_identities(tmp_path_factory.mktemp("ids"), 7)


@pytest.fixture
def authority(tmp_path: Path) -> Identity:
    return make_identities(tmp_path / "authority", 1)[0]


@pytest.fixture
def env(tmp_path: Path, authority: Identity) -> Iterator[ServiceEnv]:
    e = ServiceEnv(tmp_path / "db.sqlite", identity=authority, checkpoints=CheckpointConfig(every_s=60))
    yield e
    e.close()


def _state(tag: str, r: int) -> str:
    return hashlib.sha256(f"{tag}{r}".encode()).hexdigest()


def _chain(env: ServiceEnv, signers: Sequence[Identity], tickets: dict[str, str], *, tag: str, rounds: range,
           prev: str, work: int, weight: int = 100, lie_about_work: bool = False,
           posing_as: Sequence[Identity] = ()) -> tuple[str, int]:
    """Certify and report rounds `rounds` signed by `signers`, each extending the last; returns the last state and
    the chain's work. `posing_as`: also named as members, with junk in place of their signatures."""
    members = tuple(sorted(s.peer_id for s in [*signers, *posing_as]))
    for r in rounds:
        work += weight * len(members)
        s = Statement(run_id="run", round=r, prev_hash=prev, new_hash=_state(tag, r), members=members,
                      weights=tuple(weight for _ in members), swarm=len(members),
                      work=work * (10 if lie_about_work else 1), credit=tuple(weight for _ in members))
        cert = Certificate(s, {i.peer_id: Certificate.sign(i, s) for i in signers} | {i.peer_id: "ab" * 64
                                                                                      for i in posing_as},
                           {i.peer_id: tickets[i.peer_id] for i in signers})
        for reporter in signers:
            status, answer = env.report(reporter, "round", certified_round_body(round_body(r, [reporter.peer_id]),
                                                                                 cert))
            assert status == 200 and answer["credited"] is True, answer
        prev = s.new_hash
    return prev, work


def _checkpoint(env: ServiceEnv, authority: Identity) -> Checkpoint | None:
    env.clock.now += 61  # one checkpoint period later
    value = env.service.checkpoint(refresh=True)
    return None if value is None else Checkpoint.parse(value, run_id="run", authority=authority.peer_id)


def test_nothing_to_vouch_for_before_a_certified_round(env: ServiceEnv, authority: Identity) -> None:
    assert _checkpoint(env, authority) is None


def test_the_heaviest_chain_from_round_1_is_checkpointed_with_each_members_seniority(
        env: ServiceEnv, authority: Identity, ids: list[Identity]) -> None:
    honest = ids[:3]
    tickets = env.admit(*honest)
    head, work = _chain(env, honest, tickets, tag="h", rounds=range(1, 5), prev=GENESIS, work=0)
    cp = _checkpoint(env, authority)
    assert cp is not None and (cp.round, cp.state_hash, cp.work) == (4, head, work)
    assert {p: (t, r) for p, t, r in cp.seniors} == {i.peer_id: (400, 4) for i in honest}


def test_a_heavier_chain_signed_by_unseasoned_identities_is_not_vouched_for(
        env: ServiceEnv, authority: Identity, ids: list[Identity]) -> None:
    honest, sybils = ids[:3], ids[3:7]
    tickets = env.admit(*honest, *sybils)
    head, work = _chain(env, honest, tickets, tag="h", rounds=range(1, 4), prev=GENESIS, work=0)
    first = _checkpoint(env, authority)
    assert first is not None and first.round == 3
    # four admitted identities extend the checkpointed state with 100× the weights: heavier, and certified; they
    # name the seniors as co-signers too, with junk for their signatures (skipped: four valid ones suffice)
    _chain(env, sybils, tickets, tag="s", rounds=range(4, 7), prev=head, work=work, weight=10_000,
           posing_as=honest)
    cp = _checkpoint(env, authority)
    assert cp is not None and (cp.round, cp.state_hash) == (3, head)  # re-signed, not moved
    assert all(cp.seniority(s.peer_id) == 0 for s in sybils)
    # they also certify the honest peers' next state itself, with more work: the honest certificate of it stands
    _chain(env, sybils, tickets, tag="h", rounds=range(4, 5), prev=head, work=work, weight=10_000)
    # the honest peers go on from the checkpoint: that chain is vouched for
    head2, _ = _chain(env, honest, tickets, tag="h", rounds=range(4, 6), prev=head, work=work)
    cp = _checkpoint(env, authority)
    assert cp is not None and (cp.round, cp.state_hash) == (5, head2)
    assert all(cp.seniority(s.peer_id) == 0 for s in sybils) and cp.seniority(honest[0].peer_id) == 500


def test_a_chain_whose_work_does_not_add_up_is_not_vouched_for(env: ServiceEnv, authority: Identity,
                                                               ids: list[Identity]) -> None:
    tickets = env.admit(*ids[:3])
    _chain(env, ids[:3], tickets, tag="x", rounds=range(1, 3), prev=GENESIS, work=0, lie_about_work=True)
    assert _checkpoint(env, authority) is None


def test_a_restarted_coordinator_goes_on_from_its_stored_checkpoint(tmp_path: Path, authority: Identity,
                                                                    ids: list[Identity]) -> None:
    honest = ids[:3]
    first = ServiceEnv(tmp_path / "db.sqlite", identity=authority, checkpoints=CheckpointConfig(every_s=60))
    tickets = first.admit(*honest)
    head, work = _chain(first, honest, tickets, tag="h", rounds=range(1, 4), prev=GENESIS, work=0)
    assert _checkpoint(first, authority) is not None
    first.close()
    again = ServiceEnv(tmp_path / "db.sqlite", identity=authority, checkpoints=CheckpointConfig(every_s=60))
    try:
        assert again.service.checkpoints is not None and again.service.checkpoints.latest is not None
        again.clock.now = first.clock.now + 1  # (each test service starts its own clock at the real time)
        _chain(again, honest, tickets, tag="h", rounds=range(4, 5), prev=head, work=work)
        cp = _checkpoint(again, authority)
        assert cp is not None and cp.round == 4
        assert {p: (t, r) for p, t, r in cp.seniors} == {i.peer_id: (400, 4) for i in honest}  # carried forward
    finally:
        again.close()


def test_a_new_honest_peer_reaches_full_weight_after_its_probation(env: ServiceEnv, authority: Identity,
                                                                   ids: list[Identity]) -> None:
    """A peer that joins at round 3 weighs nothing in the checkpoint after round 4 (two credited rounds), and its
    full credited work once a third round credited it: probation is PROBATION_ROUNDS rounds and one checkpoint."""
    founders, newcomer = ids[:3], ids[3]
    tickets = env.admit(*founders, newcomer)
    head, work = _chain(env, founders, tickets, tag="h", rounds=range(1, 3), prev=GENESIS, work=0)
    head, work = _chain(env, [*founders, newcomer], tickets, tag="h", rounds=range(3, 5), prev=head, work=work)
    cp = _checkpoint(env, authority)
    assert cp is not None and cp.round == 4 and cp.seniority(newcomer.peer_id) == 0
    assert cp.seniority(founders[0].peer_id) == 400
    _chain(env, [*founders, newcomer], tickets, tag="h", rounds=range(5, 6), prev=head, work=work)
    cp = _checkpoint(env, authority)
    assert cp is not None and cp.round == 5 and cp.seniority(newcomer.peer_id) == 300
    shown = env.peer(newcomer)  # /api/peers: what the newest checkpoint vouches for, and what it weighs
    assert (shown["vouched_tokens"], shown["seniority"], shown["credited_tokens"]) == (300, 300, 300)


@pytest.mark.parametrize("named", [True, False])
def test_founders_keep_strangers_from_winning_the_first_checkpoint(tmp_path: Path, authority: Identity,
                                                                   ids: list[Identity], named: bool) -> None:
    """Four admitted strangers report a chain of their own from round 1, heavier than the honest one, before the
    first checkpoint. With the operator's peers named as founders, the first checkpoint vouches for the chain they
    signed, and they are senior from their first credited round; the control, without founders, vouches for the
    strangers' chain."""
    honest, sybils = ids[:3], ids[3:7]
    founders = frozenset(i.peer_id for i in honest) if named else frozenset()
    env = ServiceEnv(tmp_path / "db.sqlite", identity=authority,
                     checkpoints=CheckpointConfig(every_s=60, founders=founders))
    try:
        tickets = env.admit(*honest, *sybils)
        fake, _ = _chain(env, sybils, tickets, tag="s", rounds=range(1, 4), prev=GENESIS, work=0, weight=10_000)
        head, _ = _chain(env, honest, tickets, tag="h", rounds=range(1, 3), prev=GENESIS, work=0)
        cp = _checkpoint(env, authority)
        assert cp is not None
        if named:
            assert (cp.round, cp.state_hash) == (2, head)
            assert cp.seniority(honest[0].peer_id) == 200 and cp.seniority(sybils[0].peer_id) == 0
        else:
            assert (cp.round, cp.state_hash) == (3, fake)
    finally:
        env.close()


def test_a_founders_list_is_bounded() -> None:
    with pytest.raises(ValueError, match="founders"):
        CheckpointConfig(founders=frozenset(f"p{i}" for i in range(MAX_SENIORS + 1)))

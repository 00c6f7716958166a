"""Certified rounds on the in-memory transport: one result per round, leaders nobody picks, re-syncs only to
certified states, forged certificates refused, and a partition whose two chains become one when it heals."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from _fake_rounds import (
    H0,
    Applied,
    announce,
    averager_for,
    by_rank,
    peers,
    publish,
    round_from_heads,
    run,
    serve_state,
    view_0_only_leader,
)

from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.base.records import MAX_VIEW
from swarmloco.protocol.chain.forks import Behind
from swarmloco.protocol.chain.state_sync import ServedState, state_handler
from swarmloco.protocol.round.averager import Averager
from swarmloco.protocol.round.groups import Group, RoundAborted
from swarmloco.protocol.round.schedule import view_leader
from swarmloco.protocol.testing.fake import FakeNetwork, FakeTransport
from swarmloco.protocol.trust.admission import Gate, Ticket
from swarmloco.protocol.trust.certificates import Certificate, Head, Statement
from swarmloco.protocol.trust.checkpoints import Checkpoint
from swarmloco.protocol.trust.identity import Identity

pytestmark = pytest.mark.timeout(60)
AUTHORITY = Identity(path=Path("<memory>"), private_key=Identity.generate())


def _admitted(net: FakeNetwork, n: int, *, quorum: int, **cfg: object) -> list[Averager]:
    """Peers of a permissioned run: each holds a ticket from AUTHORITY and checks everyone else's."""
    out = []
    for _ in range(n):
        transport = _ticketed(net.peer())
        averager = averager_for(transport, quorum=quorum, gate=Gate(transport.run_id, AUTHORITY.peer_id), **cfg)
        announce(transport)
        out.append(averager)
    return out


def _ticketed(transport: FakeTransport) -> FakeTransport:
    ticket = Ticket.issue(AUTHORITY, run_id=transport.run_id, peer_id=transport.peer_id)
    transport.credentials.ticket = ticket.to_bytes()
    return transport


def test_four_peers_at_quorum_two_commit_round_one_once(net: FakeNetwork) -> None:
    """Before, two pairs could each commit round 1 with different hashes and one pair's work was thrown away.
    A certificate needs a majority of the active swarm (3 of 4), so round 1 has one result."""
    averagers = peers(net, 4, quorum=2)
    futures = [a.find_group(0, H0) for a in averagers]
    groups = []
    for f in futures:
        try:
            groups.append(f.result(timeout=10))
        except RoundAborted:
            groups.append(None)
    applied = [Applied() for _ in averagers]
    with net.pool(4) as pool:
        runs = [pool.submit(run, a, g, i, applied[i]) for i, (a, g) in enumerate(zip(averagers, groups, strict=True))
                if isinstance(g, Group)]
        results = [r.result(timeout=20) for r in runs]
    committed = [r for r in results if r.outcome == Outcome.COMMITTED]
    assert len(committed) >= 3
    assert len({r.certificate.statement for r in committed if r.certificate is not None}) == 1
    assert len(committed[0].certificate.signatures) >= 3  # type: ignore[union-attr]


def test_a_peer_claiming_a_far_later_view_is_not_followed(net: FakeNetwork) -> None:
    """A ready peer whose record says it is in the last possible view: the honest peers do not jump there (a record
    can end a view early only past its half, and by one view), so the view-0 group of the honest peers closes
    around the view's leader and the claimer, ranked behind them in the first views, is never asked."""
    honest = peers(net, 3, quorum=3)
    ids = [a.transport.peer_id for a in honest]
    claimer = net.peer()
    while any(view_leader(H0, v, [*ids, claimer.peer_id]) == claimer.peer_id for v in range(3)):
        claimer = net.peer()
    asked: list[str] = []

    async def lure(caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.append(caller)

    net.call(claimer.add_handler(honest[0].matchmaker.handler_name, lure), timeout=5)  # type: ignore[union-attr]
    announce(claimer, view=MAX_VIEW)
    results, _ = _round_of(honest)
    honest_ids = {a.transport.peer_id for a in honest}
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3
    assert len({r.leader for r in results}) == 1 and {r.leader for r in results} <= honest_ids
    assert not asked


def _round_of(averagers: list[Averager], offset: int = 0) -> tuple[list, list[Applied]]:  # type: ignore[type-arg]
    return round_from_heads(averagers, offset=offset)


def _one_round_and_a_joiner(net: FakeNetwork) -> tuple[list[Averager], list, Averager]:  # type: ignore[type-arg]
    """Three admitted peers certify round 1 and serve it; a fourth, still at θ_0, is admitted beside them."""
    swarm = _admitted(net, 3, quorum=3)
    servers = [serve_state(a) for a in swarm]
    results, _ = _round_of(swarm)
    for a, s in zip(swarm, servers, strict=True):
        publish(a, s, ready=False)
    (joiner,) = _admitted(net, 1, quorum=2)
    return swarm, results, joiner


def test_a_peer_behind_adopts_the_certified_state_of_the_swarm(net: FakeNetwork) -> None:
    swarm, results, joiner = _one_round_and_a_joiner(net)
    assert all(r.outcome == Outcome.COMMITTED for r in results)
    found = joiner.find_group(0, H0).result(timeout=10)
    assert isinstance(found, Behind), found
    assert (found.round, found.state_hash) == (1, results[0].state_hash)
    assert found.certificate is not None and found.certificate.statement == results[0].certificate.statement  # type: ignore[union-attr]
    assert sorted(found.donors) == sorted(a.transport.peer_id for a in swarm)


def test_a_refused_state_is_never_a_target_and_its_claimants_are_distrusted(net: FakeNetwork) -> None:
    """A certified state that failed the peer's own checks after download (peer/adoption.py) is not offered again,
    and the peers that claimed it no longer count toward the swarm a group needs a majority of."""
    _, results, joiner = _one_round_and_a_joiner(net)
    records = _records_seen_by(joiner)
    found = joiner.transport.call(joiner.chain.target(records), timeout=10)
    assert isinstance(found, Behind) and found.state_hash == results[0].state_hash

    async def refuse() -> None:
        joiner.chain.refuse(found.round, found.state_hash, found.donors)

    joiner.transport.call(refuse(), timeout=5)
    assert joiner.transport.call(joiner.chain.target(records), timeout=10) is None
    assert not set(found.donors) & set(joiner.chain.credible(records))


def test_a_download_follows_a_donor_only_to_a_valid_state_ahead_of_its_target(net: FakeNetwork) -> None:
    """A donor that moved on since the target was chosen offers its newer state's certificate with its manifest
    (protocol/chain/state_transfer.py). The joiner's chain takes it instead of the target only as it would take a
    claim: valid, ahead of the target by the fork choice, not refused, not before the authority's checkpoint."""
    _, results, joiner = _one_round_and_a_joiner(net)
    chain, cert = joiner.chain, results[0].certificate
    assert joiner.transport.call(chain.target(_records_seen_by(joiner)), timeout=10) is not None

    async def follows(certificate: Certificate, target: Behind) -> bool:
        return chain.follows(certificate, target)

    def follow(certificate: Certificate, target: Behind | None = None) -> bool:
        target = target or Behind(round=0, state_hash=H0, donors=[])
        return joiner.transport.call(follows(certificate, target), timeout=5)

    s = cert.statement
    assert follow(cert)
    assert not follow(cert, Behind(round=s.round, state_hash=s.new_hash, donors=[], work=s.work))  # not ahead
    assert not follow(Certificate(s, {}, cert.tickets))  # unsigned
    me = joiner.transport.credentials.identity
    assert not follow(_forge(joiner.transport, signers=[me], swarm=1, run_id=joiner.transport.run_id))

    cp = Checkpoint.issue(AUTHORITY, run_id=joiner.transport.run_id, round=5, state_hash="c" * 64, work=10**6,
                          seniors={})
    assert chain.gate.update_checkpoint(cp.to_value())
    assert not follow(cert)  # before the authority's checkpoint: no peer may adopt it
    chain.gate.checkpoint = None

    async def refuse() -> None:
        chain.refuse(s.round, s.new_hash, [])

    assert follow(cert)
    joiner.transport.call(refuse(), timeout=5)
    assert not follow(cert)


def _forge(attacker: FakeTransport, *, signers: list[Identity], swarm: int, run_id: str) -> Certificate:
    members = tuple(sorted(s.peer_id for s in signers))
    statement = Statement(run_id=run_id, round=1001, prev_hash="e" * 64, new_hash="f" * 64, members=members,
                          weights=tuple(10**9 for _ in members), swarm=swarm, work=10**12)
    tickets = {attacker.peer_id: attacker.credentials.ticket.decode()}
    return Certificate(statement, {s.peer_id: Certificate.sign(s, statement) for s in signers}, tickets)


@pytest.mark.parametrize("forgery", ["no certificate", "self-signed", "sybil co-signer", "altered"])
def test_round_inflation_is_not_followed(net: FakeNetwork, forgery: str) -> None:
    """An admitted peer says it holds round 1001 with enormous work, and serves a state for it. Honest peers never
    treat it as the swarm's state: they keep averaging among themselves from θ_0."""
    honest = _admitted(net, 3, quorum=3)
    attacker = _ticketed(net.peer())
    me = attacker.credentials.identity
    sybil = Identity(path=Path("<memory>"), private_key=Identity.generate())  # a key the authority never admitted
    cert = {
        "no certificate": None,
        "self-signed": _forge(attacker, signers=[me], swarm=1, run_id=attacker.run_id),
        "sybil co-signer": _forge(attacker, signers=[me, sybil], swarm=2, run_id=attacker.run_id),
        "altered": None,
    }[forgery]
    if forgery == "altered":  # a genuine-looking certificate whose statement was changed after signing
        signed = _forge(attacker, signers=[me], swarm=1, run_id=attacker.run_id)
        other = Statement(**{**signed.statement.__dict__, "new_hash": "d" * 64})
        cert = Certificate(other, signed.signatures, signed.tickets)
    bad = averager_for(attacker, quorum=2, gate=Gate(attacker.run_id, AUTHORITY.peer_id))
    server = serve_state(bad)
    head_hash = cert.statement.new_hash if cert is not None else "f" * 64
    server.publish(ServedState(round=1001, state_hash=head_hash, blob=b"\x00" * 64,
                               certificate=cert.to_bytes() if cert is not None else b""))
    announce(attacker, 1001, head_hash, work=10**12, ready=False)
    results, _ = _round_of(honest)
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3
    assert all(a.head.round == 1 and a.head.certificate is not None for a in honest)
    claim = {attacker.peer_id: _record_of(attacker)}
    assert all(a.transport.call(a.chain.target(claim), timeout=10) is None for a in honest)


def _record_of(transport: FakeTransport):  # type: ignore[no-untyped-def]
    return transport.net.records[transport.peer_id]


def test_two_certified_chains_of_a_partition_become_one_when_it_heals(net: FakeNetwork) -> None:
    """A 2+2 partition: each side sees a swarm of two and certifies its own rounds. Once the halves see each other,
    every peer applies the same fork choice (more certified work wins): the lighter side re-syncs to the heavier
    chain and the heavier side stays."""
    averagers = _admitted(net, 4, quorum=2)
    servers = [serve_state(a) for a in averagers]
    ids = [a.transport.peer_id for a in averagers]
    heavy, light = averagers[:2], averagers[2:]
    net.partition(set(ids[:2]), set(ids[2:]))
    for side, rounds in ((heavy, 2), (light, 1)):
        for n in range(rounds):
            results, _ = _round_of(side, offset=10 * n + (20 if side is light else 0))
            assert [r.outcome for r in results] == [Outcome.COMMITTED] * 2, results
            for a in side:
                publish(a, servers[averagers.index(a)], ready=False)
    assert heavy[0].head.work > light[0].head.work and heavy[0].head.state_hash != light[0].head.state_hash
    net.heal()
    for a in light:
        target = a.transport.call(a.chain.target(_records_seen_by(a)), timeout=10)
        assert isinstance(target, Behind) and (target.round, target.state_hash) == (2, heavy[0].head.state_hash)
        assert sorted(target.donors) == sorted(ids[:2])
    for a in heavy:
        assert a.transport.call(a.chain.target(_records_seen_by(a)), timeout=10) is None


def _records_seen_by(a: Averager):  # type: ignore[no-untyped-def]
    return a.transport.call(a.transport.fetch_records(timeout=1), timeout=5)


def test_a_leader_that_understates_the_swarm_is_not_followed(net: FakeNetwork) -> None:
    """A group must be a majority of the swarm its members see; a member that sees more active peers than the
    leader claims does not take part (else two such groups could both certify a round)."""
    averagers = by_rank(peers(net, 2, quorum=2))
    extra = [net.peer() for _ in range(3)]
    member = averagers[1]
    net.partition({averagers[0].transport.peer_id, member.transport.peer_id},
                  {member.transport.peer_id, *(t.peer_id for t in extra), averagers[0].transport.peer_id})
    net.visible[averagers[0].transport.peer_id] = {member.transport.peer_id}  # the leader sees a swarm of 2
    for t in extra:
        announce(t, ready=False)  # the member sees 5 active peers: 2 is no majority of them
    lead = averagers[0].find_group(0, H0)
    with pytest.raises(RoundAborted):
        member.find_group(0, H0).result(timeout=10)
    lead.cancel()
    assert member.head == Head(0, H0)


def test_a_leader_that_holds_its_members_costs_one_view(net: FakeNetwork) -> None:
    """The leader of view 0 accepts every join and never closes. Its view ends for every peer at the same time, the
    members it held leave it, and the three honest peers commit around the next view's leader in the same attempt:
    the staller cost one view, and nobody had to judge it alone."""
    honest = peers(net, 3, quorum=3, round_timeout_s=15)
    ids = [a.transport.peer_id for a in honest]
    staller = view_0_only_leader(net, ids)
    held: list[str] = []

    async def hold(caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
        from swarmloco.protocol.base.wire import read_frame, write_frame

        await read_frame(reader, pb.JoinRequest, max_payload=0, timeout=1)
        held.append(caller)
        await write_frame(writer, pb.JoinReply(status=pb.JoinReply.ACCEPTED), timeout=1)
        await asyncio.sleep(60)

    net.call(staller.add_handler(honest[0].matchmaker.handler_name, hold), timeout=5)  # type: ignore[union-attr]
    announce(staller)
    for a in honest:
        announce(a.transport)  # type: ignore[arg-type]
    results, _ = _round_of(honest)
    assert held
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3, [r.reason for r in results]
    assert {r.leader for r in results} == {view_leader(H0, 1, [*ids, staller.peer_id])}
    assert {a.matchmaker.views.current for a in honest} == {1}  # type: ignore[union-attr]


def test_liars_claiming_far_ahead_rounds_do_not_raise_the_majority(net: FakeNetwork) -> None:
    """Three admitted peers claim rounds they cannot certify. Counted as active, they would put a majority of six
    out of the three honest peers' reach; once refused, they are not counted."""
    honest = _admitted(net, 3, quorum=3)
    for i in range(3):
        liar = _ticketed(net.peer())
        serve_state(averager_for(liar, quorum=2, gate=Gate(liar.run_id, AUTHORITY.peer_id)))
        announce(liar, 1000 + i, f"{i}" * 64, work=10**12, ready=False)
    results, _ = _round_of(honest)
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3
    assert {r.certificate.statement.swarm for r in results} == {3}  # type: ignore[union-attr]


def test_claimants_too_slow_to_back_their_claims_do_not_raise_the_majority(net: FakeNetwork) -> None:
    """Three admitted peers claim far-ahead rounds and hang on every certificate request. A claimant that times out
    is not a proven liar, but until its claim is backed it must not count toward the swarm a group needs a majority
    of: counted, the three would hold the honest peers below a majority of six for as long as they keep hanging."""
    honest = _admitted(net, 3, quorum=3)

    async def hang(caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    for i in range(3):
        liar = _ticketed(net.peer())
        net.call(liar.add_handler(state_handler(liar.run_id), hang), timeout=5)
        announce(liar, 1000 + i, f"{i}" * 64, work=10**12, ready=False)
    results, _ = _round_of(honest)
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3
    assert {r.certificate.statement.swarm for r in results} == {3}  # type: ignore[union-attr]


def test_silent_claimants_never_delay_forming_a_group(net: FakeNetwork) -> None:
    """Three admitted peers claim a newer state and never answer a certificate request. Their claims are checked in
    the background: the honest peers form their group and commit while every one of those requests is still
    waiting for its answer (a look that waited on them would have sat out a 10 s control timeout first)."""
    honest = _admitted(net, 3, quorum=3, control_timeout_s=10, round_timeout_s=30)
    asked: list[str] = []
    given_up: list[str] = []

    async def silent(caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.append(caller)
        while await reader.read(1 << 12):  # the asker gives up by closing its end
            pass
        given_up.append(caller)

    for i in range(3):
        claimant = _ticketed(net.peer())
        net.call(claimant.add_handler(state_handler(claimant.run_id), silent), timeout=5)
        announce(claimant, 1000 + i, f"{i}" * 64, work=10**12, ready=False)
    results, _ = _round_of(honest)
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3, [r.reason for r in results]
    assert asked, "the claims were never checked"
    assert not given_up, f"{len(given_up)} certificate request(s) timed out before the group committed"


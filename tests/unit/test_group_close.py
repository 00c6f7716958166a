"""Who leads a view and when its leader stops waiting and closes its group, on the in-memory transport's virtual
clock: a peer that says "ready" before the others are done training does not thereby lead the view they are ready
in; the grace never waits for a peer that follows another leader, nor long for a ready one that does not join; and
a group that has enough members closes before the leader's attempt at the round runs out, whatever the grace still
hoped for."""
from __future__ import annotations

import pytest
from _fake_rounds import H0, Applied, announce, averager_for, by_rank, peers, run, whole_round

from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.base.records import MAX_VIEW
from swarmloco.protocol.round.averager import Averager, RoundResult
from swarmloco.protocol.round.groups import Group, RoundAborted
from swarmloco.protocol.round.schedule import view_leader
from swarmloco.protocol.testing.fake import FakeNetwork
from swarmloco.protocol.testing.faults import FaultInjector
from swarmloco.protocol.trust.certificates import Head


@pytest.mark.parametrize(("view", "bound"), [(MAX_VIEW, 4.0), (0, 2.5)], ids=["another view", "our view"])
def test_a_ready_peer_that_never_joins_holds_the_grace_briefly_or_not_at_all(net: FakeNetwork, view: int,
                                                                             bound: float) -> None:
    """A stranger ready at our state that joins nobody. In another view (here the last) it follows another leader
    and is not waited for: the group closes after the short grace. In our view it is waited for as long as a peer
    that waits for a group takes to join (four polls here). Waited for like a peer about to join, it cost every
    round the longest grace (8 s here)."""
    honest = by_rank(peers(net, 3, quorum=2, grace_min_s=0.2, grace_max_s=8, round_timeout_s=60, view_s=30))
    ids = [a.transport.peer_id for a in honest]
    stranger = net.peer()
    while view_leader(H0, 0, [*ids, stranger.peer_id]) == stranger.peer_id:  # not this test: it never leads
        stranger = net.peer()
    announce(stranger, view=view)
    started = net.clock.monotonic()
    results, _ = whole_round(honest)
    took = net.clock.monotonic() - started
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3, [r.reason for r in results]
    assert took < bound, took


def test_a_group_with_enough_members_closes_before_the_attempt_runs_out(net: FakeNetwork) -> None:
    """A peer whose record says it is about to be ready, and never is: the grace would wait for it up to
    grace_max (10 s), past the leader's attempt at the round (3 s), and the round would be given up with a
    majority in hand. The leader closes before its attempt ends instead."""
    honest = by_rank(peers(net, 2, quorum=2, grace_min_s=0.2, grace_max_s=10, round_timeout_s=3, view_s=100))
    late = net.peer()
    announce(late, ready=False, eta=net.clock.time() + 2.0)
    results, _ = whole_round(honest)
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 2, [r.reason for r in results]
    assert {len(r.members) for r in results} == {2}
    assert all(a.head.round == 1 and a.head.state_hash != H0 for a in honest)


def test_a_peer_ready_at_once_does_not_lead_the_view_the_others_become_ready_in(net: FakeNetwork) -> None:
    """A holder (`lead=hold`: accepts members, never closes) says "ready" the moment the state appears; the three
    honest peers train 5.5 s. Were the views counted from the first readiness, they would run while the holder is
    alone: view 1's candidates were then fixed at 5 s with the holder alone among them, it led the view and held them
    to its end (the round committed after 12 s). The views start once enough peers for a group are ready (5.5 s), so
    view 0 is drawn among all four, here to an honest peer (this holder does not win its draw), and the round
    commits at once, the holder contributing as a member."""
    cfg = dict(quorum=3, grace_min_s=0.5, grace_max_s=2, round_timeout_s=30, view_s=4)
    honest = peers(net, 3, **cfg)  # type: ignore[arg-type]
    ids = [a.transport.peer_id for a in honest]
    transport = net.peer()
    while view_leader(H0, 0, [*ids, transport.peer_id]) == transport.peer_id:
        transport = net.peer()
    holder = averager_for(transport, hooks=FaultInjector.parse("lead=hold@*"), **cfg)  # type: ignore[arg-type]
    announce(transport)
    for a in honest:
        announce(a.transport, ready=False, eta=net.clock.time() + 5.5)  # training
    done, results = _with_holder(net, honest, holder, Head(0, H0), honest_after=5.5)
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3, [r.reason for r in results]
    assert {r.leader for r in results} == {view_leader(H0, 0, [*ids, transport.peer_id])}
    assert max(done) < 7.5, done  # ready at 5.5 s


def test_a_peer_that_did_not_sign_the_states_certificate_leads_none_of_its_views(net: FakeNetwork) -> None:
    """Three peers certify θ_1; a holder arrives at θ_1, ready at once, ranked first of the four in view 0. A peer
    that took no part in the round that made the state leads none of its views while a signer is a candidate: an
    honest signer leads view 0 and the round commits at once (led by the holder, it lasted to the view's end)."""
    cfg = dict(quorum=3, grace_min_s=0.5, grace_max_s=2, round_timeout_s=30, view_s=4)
    honest = peers(net, 3, **cfg)  # type: ignore[arg-type]
    first, _ = whole_round(honest)
    assert [r.outcome for r in first] == [Outcome.COMMITTED] * 3, [r.reason for r in first]
    head = honest[0].head
    ids = [a.transport.peer_id for a in honest]
    assert head.signers == set(ids)
    for a in honest:
        announce(a.transport, head.round, head.state_hash)
    transport = net.peer()
    while view_leader(head.seed, 0, [*ids, transport.peer_id]) != transport.peer_id:
        transport = net.peer()
    holder = averager_for(transport, hooks=FaultInjector.parse("lead=hold@*"), **cfg)  # type: ignore[arg-type]
    holder.set_state(head)
    announce(transport, head.round, head.state_hash)
    done, results = _with_holder(net, honest, holder, head)
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3, [r.reason for r in results]
    assert {r.leader for r in results} == {view_leader(head.seed, 0, ids)}
    assert max(done) < 2, done


def _with_holder(net: FakeNetwork, honest: list[Averager], holder: Averager, head: Head, *,
                 honest_after: float = 0.0) -> tuple[list[float], list[RoundResult]]:
    """Every peer looks for a group at `head` and runs the round, each on its own thread: the holder at once, the
    honest peers `honest_after` seconds later. Returns when each honest peer's round ended (from the holder's
    start) and their results. The holder's own round, if it joined a group at all, commits like theirs."""
    averagers, applied = [*honest, holder], [Applied() for _ in range(len(honest) + 1)]
    started = net.clock.monotonic()

    def one(i: int) -> tuple[float, RoundResult | None]:
        if averagers[i] is not holder:
            net.sleep(honest_after)
        try:
            found = averagers[i].find_group(head.round, head.state_hash).result(timeout=40)
        except RoundAborted:  # the holder, where the group closed before it joined: its own views then expire
            return net.clock.monotonic() - started, None
        assert isinstance(found, Group), found
        return net.clock.monotonic() - started, run(averagers[i], found, i, applied[i])

    with net.pool(len(averagers)) as pool:
        holding = pool.submit(one, len(honest))  # ready first
        out = list(pool.map(one, range(len(honest))))
        held = holding.result()[1]
    assert held is None or held.outcome is Outcome.COMMITTED, held.reason
    assert all(r is not None for _, r in out), "an honest peer found no group"
    return [t for t, _ in out], [r for _, r in out if r is not None]

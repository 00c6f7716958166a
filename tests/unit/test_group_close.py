"""When a view's leader stops waiting and closes its group, on the in-memory transport's virtual clock: the grace
never waits for a peer that follows another leader, and a group that has enough members closes before the
leader's attempt at the round runs out, whatever the grace still hoped for."""
from __future__ import annotations

from _fake_rounds import H0, announce, by_rank, peers, whole_round

from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.base.records import MAX_VIEW
from swarmloco.protocol.round.schedule import view_leader
from swarmloco.protocol.testing.fake import FakeNetwork


def test_a_ready_peer_in_another_view_does_not_hold_the_grace(net: FakeNetwork) -> None:
    """A stranger ready at our state that says it is in a far view, and joins nobody: the group closes after the
    short grace. Waited for like a ready peer of our view, it cost every round the longest grace (8 s here)."""
    honest = by_rank(peers(net, 3, quorum=2, grace_min_s=0.2, grace_max_s=8, round_timeout_s=60, view_s=30))
    ids = [a.transport.peer_id for a in honest]
    stranger = net.peer()
    while view_leader(H0, 0, [*ids, stranger.peer_id]) == stranger.peer_id:  # not this test: it never leads
        stranger = net.peer()
    announce(stranger, view=MAX_VIEW)
    started = net.clock.monotonic()
    results, _ = whole_round(honest)
    took = net.clock.monotonic() - started
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3, [r.reason for r in results]
    assert took < 4, took


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

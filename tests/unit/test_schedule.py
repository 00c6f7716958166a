"""The view schedule as a pure function: the same records and the same time give every peer the same leader."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Collection

from _records import H1, rec

from swarmloco.protocol.base.records import MAX_VIEW
from swarmloco.protocol.round.config import RoundConfig
from swarmloco.protocol.round.schedule import (
    DOUBLINGS,
    Action,
    Decision,
    Views,
    ViewSchedule,
    decide,
    view_leader,
    view_rank,
)

SCHEDULE = ViewSchedule(base_s=2.0)
PEERS = [f"peer-{i}" for i in range(4)]
T0 = 1_000.0  # wall time the first peer became ready


def _views(ready_at: float = T0, anchor: float | None = None, **kw: int) -> Views:
    return Views(round=3, state_hash=H1, ready_at=ready_at, anchor=ready_at if anchor is None else anchor, **kw)


def _here(me: str, **fields: object) -> dict:
    return {p: rec(ready=True, eta=T0, **fields) for p in PEERS if p != me}


def test_view_lengths_double_up_to_a_cap_and_tile_the_time() -> None:
    assert [SCHEDULE.length(v) for v in range(6)] == [2, 4, 8, 16, 16, 16]
    assert SCHEDULE.cap_s == 2.0 * 2**DOUBLINGS
    for v in range(12):
        assert SCHEDULE.start(v + 1) == SCHEDULE.start(v) + SCHEDULE.length(v)
        assert SCHEDULE.at(SCHEDULE.start(v)) == v and SCHEDULE.at(SCHEDULE.start(v + 1) - 1e-6) == v
    assert SCHEDULE.at(-5.0) == 0
    assert SCHEDULE.at(1e12) == MAX_VIEW  # a far-past anchor is bounded, not an overflow
    base = ViewSchedule.of(RoundConfig(grace_max_s=3, control_timeout_s=2)).base_s
    assert base >= 3 + 2 * 2  # a view fits a join, the grace window and the close
    assert ViewSchedule.of(RoundConfig(grace_max_s=3, control_timeout_s=10, round_timeout_s=15)).base_s == 5
    assert ViewSchedule.of(RoundConfig(view_s=7.5)).base_s == 7.5


def test_every_peer_computes_the_same_leader_and_roles() -> None:
    for now in (T0 + 0.1, T0 + 3.0, T0 + 40.0):
        decisions = {me: decide(me=me, views=_views(), here=_here(me), seed=H1, schedule=SCHEDULE, now=now)
                     for me in PEERS}
        leaders = {d.leader for d in decisions.values()}
        assert len(leaders) == 1 and leaders <= set(PEERS)
        (leader,) = leaders
        assert decisions[leader].action is Action.LEAD
        assert all(d.action is Action.JOIN for p, d in decisions.items() if p != leader)
        assert len({(d.view, d.ends_at) for d in decisions.values()}) == 1


def test_each_view_draws_a_new_leader_so_a_stalled_one_costs_one_view() -> None:
    leaders = [view_leader(H1, v, PEERS) for v in range(40)]
    assert set(leaders) == set(PEERS)  # nobody leads every view, and everybody leads some
    # the longest run of views one peer leads in a row is short: a staller never holds the round for long
    assert max(len(list(run)) for _, run in itertools.groupby(leaders)) <= 4
    other_seed = [view_leader("2" * 64, v, PEERS) for v in range(40)]
    assert other_seed != leaders  # the order comes from the certified seed


def test_a_late_reader_adopts_the_earliest_readiness_and_agrees() -> None:
    early = _views()
    late = _views(ready_at=T0 + 5.0)  # ready 5 s later; it has not yet read the earliest record
    now = T0 + 9.0
    me = PEERS[0]
    assert decide(me=me, views=late, here={}, seed=H1, schedule=SCHEDULE, now=now).view == 1
    late.see({PEERS[1]: T0, PEERS[2]: T0 + 1.0}, me=me, now=now, lookback_s=60)
    assert late.anchor == T0
    here = _here(me)
    assert decide(me=me, views=late, here=here, seed=H1, schedule=SCHEDULE, now=now).view == \
        decide(me=me, views=early, here=here, seed=H1, schedule=SCHEDULE, now=now).view == 2


def test_a_lone_backdated_readiness_does_not_move_every_peer_to_the_long_views() -> None:
    """A record saying its peer was ready long before anyone else. Where a group needs two peers, the anchor is when
    two were first ready: the liar moves it no earlier than the earliest honest readiness (our own here), so the
    swarm is not put in the long views at once; a day back is not believed at all. Where one peer is enough for a
    group, the earliest readiness is the anchor, within the lookback."""
    me, liar, other = PEERS[:3]

    def two(peers: Collection[str]) -> bool:
        return len(peers) >= 2

    views = _views(anchor=float("inf"))
    views.see({}, me=me, now=T0 + 60.0, lookback_s=30.0, enough=two)
    assert views.anchor == float("inf")  # alone: no group could close, no view's time runs
    alone = decide(me=me, views=views, here={}, seed=H1, schedule=SCHEDULE, now=T0 + 100.0, enough=two)
    assert (alone.view, alone.ends_at) == (0, T0 + 100.0 + SCHEDULE.length(0))
    views.see({other: T0 + 3.0}, me=me, now=T0 + 60.0, lookback_s=30.0, enough=two)
    assert views.anchor == T0 + 3.0
    views.see({liar: T0 - 20.0, other: T0 + 3.0}, me=me, now=T0 + 60.0, lookback_s=30.0, enough=two)
    assert views.anchor == T0
    here = {liar: rec(ready=True, eta=T0 - 20.0), other: rec(ready=True, eta=T0 + 3.0)}
    assert decide(me=me, views=views, here=here, seed=H1, schedule=SCHEDULE, now=T0 + 1.0, enough=two).view == 0

    single = _views()
    # a stranger says it was ready a day ago: ignored
    single.see({liar: T0 - 86_400.0}, me=me, now=T0 + 60.0, lookback_s=30.0)
    assert single.anchor == T0
    single.see({liar: T0 - 20.0}, me=me, now=T0 + 60.0, lookback_s=30.0)
    assert single.anchor == T0 - 20.0
    single.see({liar: T0 + 50.0}, me=me, now=T0 + 60.0, lookback_s=30.0)  # the anchor only moves earlier
    assert single.anchor == T0 - 20.0


def test_an_advertised_later_view_ends_ours_only_past_its_half_and_by_one() -> None:
    me = PEERS[0]
    here = _here(me, view=MAX_VIEW)  # strangers say they are far ahead
    at = lambda t: decide(me=me, views=_views(), here=here, seed=H1, schedule=SCHEDULE, now=t).view  # noqa: E731
    assert at(T0 + 0.5) == 0  # view 0 (2 s long) has not reached its half: stays
    assert at(T0 + 1.0) == 1  # past its half: one view on, never to the advertised one
    views = _views()
    seen = [decide(me=me, views=views, here=here, seed=H1, schedule=SCHEDULE, now=T0 + 0.01 * i).view
            for i in range(200)]  # two seconds of polls
    assert max(seen) == 1  # the pull of a far-ahead record is one view per half view, not one per poll


def test_a_later_view_moves_us_on_only_when_half_the_ready_weight_is_there() -> None:
    """One peer of four advertising the farthest view (a staller pulling the swarm into the long views it then
    holds) moves nobody. Half of the ready peers or more in a later view does: those left in ours are no majority,
    so our view cannot gather a group."""
    me = PEERS[0]
    here = _here(me)
    here[PEERS[1]] = rec(ready=True, eta=T0, view=MAX_VIEW)

    def at(t: float, weight=lambda peer: 1) -> int:  # noqa: ANN001
        return decide(me=me, views=_views(), here=here, seed=H1, schedule=SCHEDULE, now=t, weight=weight).view

    assert [at(T0 + t) for t in (1.5, 5.0, 13.0)] == [0, 1, 2]  # one of four ahead: the schedule alone
    assert at(T0 + 1.5, weight=lambda peer: 2 if peer == PEERS[1] else 1) == 0  # weighed: 2 of 5 ahead
    assert at(T0 + 1.5, weight=lambda peer: 3 if peer == PEERS[1] else 1) == 1  # weighed: 3 of 6
    here[PEERS[2]] = rec(ready=True, eta=T0, view=1)
    assert at(T0 + 0.5) == 0 and at(T0 + 1.5) == 1  # two of four, past the half of view 0
    here[PEERS[2]] = rec(ready=False, eta=T0, view=1)  # busy peers are not counted: one of three ready
    assert at(T0 + 1.5) == 0
    here[PEERS[3]] = rec(ready=False, eta=T0)  # one of two ready: the two of us could not be a majority apart
    assert at(T0 + 1.5) == 1


def test_views_never_go_back_and_a_failed_group_moves_us_on() -> None:
    me = PEERS[0]
    views = _views(floor=3)
    d = decide(me=me, views=views, here=_here(me), seed=H1, schedule=SCHEDULE, now=T0 + 0.1)
    assert d.view == 3 and d.leader == view_leader(H1, 3, PEERS)
    assert d.ends_at == T0 + SCHEDULE.start(3) + SCHEDULE.length(3)
    views.floor = 0
    assert decide(me=me, views=views, here=_here(me), seed=H1, schedule=SCHEDULE, now=T0 + 0.2).view == 3


def test_only_peers_ready_by_the_views_cutoff_can_lead_it() -> None:
    me = PEERS[0]
    assert SCHEDULE.window_s == 0.5
    here = {p: rec(ready=False, eta=T0 - 5.0) for p in PEERS[1:]}  # busy: in an exchange, or still training
    d = decide(me=me, views=_views(), here=here, seed=H1, schedule=SCHEDULE, now=T0 + 0.1)
    assert (d.action, d.leader) == (Action.LEAD, me)  # alone: we lead, nobody waits on the busy peers
    here[PEERS[1]] = rec(ready=True, eta=T0 + 0.4)  # within the window: a fair draw between the two
    d = decide(me=me, views=_views(), here=here, seed=H1, schedule=SCHEDULE, now=T0 + 0.45)
    assert d.leader == view_leader(H1, 0, [me, PEERS[1]])
    here[PEERS[2]] = rec(ready=True, eta=T0 + 0.9)  # past the cutoff: it joins, it never displaces the leader
    late = decide(me=PEERS[2], views=_views(ready_at=T0 + 0.9, anchor=T0),
                  here={p: r for p, r in {**here, me: rec(ready=True, eta=T0)}.items() if p != PEERS[2]},
                  seed=H1, schedule=SCHEDULE, now=T0 + 1.0)
    assert late.action is Action.JOIN and late.leader == view_leader(H1, 0, [me, PEERS[1]])
    # view 1 began at T0 + 2 with all three ready: the hash decides among them
    d = decide(me=me, views=_views(), here=here, seed=H1, schedule=SCHEDULE, now=T0 + 2.1)
    assert d.view == 1 and d.leader == view_leader(H1, 1, [me, PEERS[1], PEERS[2]])


def test_a_view_nobody_was_ready_for_goes_to_the_first_peer_ready_in_it() -> None:
    """Every peer was busy (an exchange that failed) when view 2 began at T0 + 6: the first to be ready again
    leads it, and the next ones to be ready past the window join it, whatever their rank."""
    me, other = PEERS[0], PEERS[1]
    first = decide(me=me, views=_views(ready_at=T0 + 8.0, anchor=T0), here={other: rec(ready=True, eta=T0 + 7.0)},
                   seed=H1, schedule=SCHEDULE, now=T0 + 8.1)
    assert first.view == 2 and (first.action, first.leader) == (Action.JOIN, other)
    alone = decide(me=me, views=_views(ready_at=T0 + 8.0, anchor=T0), here={}, seed=H1, schedule=SCHEDULE,
                   now=T0 + 8.1)
    assert (alone.action, alone.leader) == (Action.LEAD, me)


def test_a_record_that_pushes_its_eta_later_cannot_slip_out_of_a_views_candidates() -> None:
    """A ready peer re-announcing with a later eta every poll (nothing honest does that: an honest eta changes only
    when the peer is ready again after being busy). Were the latest eta taken, it would be a candidate for whoever
    reads its record early in the view and not for whoever reads it late, and the peers would follow different
    leaders. Its readiness counts from the earliest eta seen, until its record shows it busy."""
    me, mover = sorted(PEERS[:2], key=lambda p: view_rank(H1, 0, p), reverse=True)  # the mover would lead
    views = _views()
    early = decide(me=me, views=views, here={mover: rec(ready=True, eta=T0 + 0.1)}, seed=H1, schedule=SCHEDULE,
                   now=T0 + 0.2)
    assert (early.action, early.leader) == (Action.JOIN, mover)
    later = decide(me=me, views=views, here={mover: rec(ready=True, eta=T0 + 1.4)}, seed=H1, schedule=SCHEDULE,
                   now=T0 + 1.5)
    assert (later.view, later.leader) == (0, mover)  # still a candidate: one leader all view long
    # busy, then ready again past the cutoff: a newcomer to the view, it joins instead of displacing the leader
    decide(me=me, views=views, here={mover: rec(ready=False, eta=T0 + 1.4)}, seed=H1, schedule=SCHEDULE, now=T0 + 1.6)
    again = decide(me=me, views=views, here={mover: rec(ready=True, eta=T0 + 1.7)}, seed=H1, schedule=SCHEDULE,
                   now=T0 + 1.8)
    assert (again.action, again.leader) == (Action.LEAD, me)


def test_a_peer_ready_before_the_others_could_form_a_group_is_one_candidate_among_them() -> None:
    """The staller says "ready" at T0, the moment the state appears; the three honest peers train and are ready at
    T0 + 3, in view 1 (which began at T0 + 2). Counted from the first readiness, view 1's cutoff (T0 + 2.5) left the
    staller its only candidate, as it would every view that begins while the others train. No group of 3 of 4
    could close before the honest peers were ready, so the cutoff counts from the moment the ready peers were
    enough: all four are drawn from, and every honest peer computes the same leader."""
    staller, honest = PEERS[0], PEERS[1:]
    etas = {staller: T0, **{p: T0 + 3.0 for p in honest}}

    def enough(group: Collection[str]) -> bool:
        return len(set(group)) >= 3

    def look(me: str, now: float = T0 + 3.6, **kw: Callable[[Collection[str]], bool]) -> Decision:
        here = {p: rec(ready=True, eta=eta) for p, eta in etas.items() if p != me and eta <= now}
        return decide(me=me, views=_views(ready_at=etas[me], anchor=T0), here=here, seed=H1, schedule=SCHEDULE,
                      now=now, **kw)

    assert look(honest[0]).leader == staller  # counted from the first readiness (the default `enough`)
    decisions = [look(me, enough=enough) for me in honest]
    assert {(d.view, d.leader) for d in decisions} == {(1, view_leader(H1, 1, PEERS))}
    # while the ready peers are not enough, the candidates stay open: whoever is ready is drawn from
    etas.update({honest[1]: T0 + 3.5, honest[2]: T0 + 3.5})
    assert look(honest[0], now=T0 + 3.1, enough=enough).leader == view_leader(H1, 1, [staller, honest[0]])
    assert look(honest[0], enough=enough).leader == view_leader(H1, 1, PEERS)  # enough at T0 + 3.5: all four


def test_a_readiness_stated_for_the_far_future_ends_no_view_late() -> None:
    """The attack: sybils, needed for a group (three of four here), say they became ready a billion seconds from
    now. Believed, the moment enough peers were ready, and with it every view's end, moved that far ahead: a member
    waiting for its leader's group would wait for a view that never ends. Readiness more than READY_AHEAD_S ahead is
    none yet: the honest peer alone is not enough, no view's time runs, and each look waits one view's length."""
    me, *sybils = PEERS
    now = T0 + 10.0

    def three(peers: Collection[str]) -> bool:
        return len(set(peers)) >= 3

    views = _views(ready_at=T0, anchor=float("inf"))
    ready = {p: now + 1e9 for p in sybils}
    views.see(ready, me=me, now=now, lookback_s=30.0, enough=three)
    assert views.anchor == float("inf")
    here = {p: rec(ready=True, eta=eta) for p, eta in ready.items()}
    decision = decide(me=me, views=views, here=here, seed=H1, schedule=SCHEDULE, now=now, enough=three)
    assert decision.ends_at <= now + SCHEDULE.length(0), decision
    assert decision.leader == me  # the only peer ready yet
    near = {p: now + 5.0 for p in sybils}  # within the clock skew allowed: believed
    views.see(near, me=me, now=now, lookback_s=30.0, enough=three)
    assert views.anchor == now + 5.0

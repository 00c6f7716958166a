"""Group sizes and leaders weighed by seniority. Admitted identities that never did verified work publish records at
the honest state: counted as heads they raise the majority out of the honest peers' reach and lead views they let
expire. With an authority checkpoint naming the honest peers' seniority they weigh nothing, and the honest peers
keep committing. Each attack has its control: without the checkpoint the same sybils stop the round."""
from __future__ import annotations

from pathlib import Path

import pytest
from _fake_rounds import admitted_round_one, announce, round_from_heads, ticketed
from _records import H1, rec

from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.round.groups import RoundAborted
from swarmloco.protocol.round.schedule import Views, ViewSchedule, decide, view_leader
from swarmloco.protocol.round.weights import Weights
from swarmloco.protocol.testing.fake import FakeNetwork
from swarmloco.protocol.trust.checkpoints import PROBATION_ROUNDS, Checkpoint
from swarmloco.protocol.trust.identity import Identity

pytestmark = pytest.mark.timeout(90)
AUTHORITY = Identity(path=Path("<memory>"), private_key=Identity.generate())
RUN = "fake-run"
SENIORS = ("a", "b", "c")
SYBILS = tuple(f"sybil-{i}" for i in range(7))


def _checkpoint(seniors: dict[str, tuple[int, int]], *, round_number: int = 1, state_hash: str = "c" * 64,
                run_id: str = RUN) -> Checkpoint:
    return Checkpoint.issue(AUTHORITY, run_id=run_id, round=round_number, state_hash=state_hash, work=900,
                            seniors=seniors)


WEIGHED = Weights(_checkpoint({p: (100, PROBATION_ROUNDS) for p in SENIORS}), quorum=2)
COUNTED = Weights(None, quorum=2)


# --- the rule ------------------------------------------------------------------------------------------------------
def test_sybils_raise_the_counted_majority_but_weigh_nothing() -> None:
    active = {*SENIORS, *SYBILS}
    assert not COUNTED.enough(SENIORS, active)  # 3 of 10: the control, stopped by heads
    assert COUNTED.swarm(SENIORS, active) == 10
    assert WEIGHED.enough(SENIORS, active) and WEIGHED.enough(("a", "b"), active)
    assert WEIGHED.swarm(("a", "b"), active) == 3  # the group and the seniors outside it
    assert not WEIGHED.enough(SYBILS, active)  # seven heads, no seniority
    assert not WEIGHED.enough(("a", *SYBILS[:4]), active)  # a third of the seniority, however many heads


def test_two_disjoint_groups_cannot_both_close_under_one_checkpoint() -> None:
    heavy = Weights(_checkpoint({"a": (400, 5), "b": (100, 5), "c": (100, 5), "d": (100, 5)}), quorum=1)
    active = {"a", "b", "c", "d", *SYBILS}
    groups = [("a",), ("a", "b"), ("b", "c", "d"), ("c", "d", *SYBILS), ("a", *SYBILS[:2]), ("b", "c")]
    closing = [g for g in groups if heavy.enough(g, active)]
    for g in closing:
        for h in closing:
            assert g == h or set(g) & set(h), (g, h)
    assert ("b", "c", "d") not in closing  # three heads against one heavier senior: a weighed minority


def test_probationers_count_when_they_take_part_and_the_declared_swarm_binds() -> None:
    new = ("new-1", "new-2", "new-3")
    active = {*SENIORS, *new}
    assert WEIGHED.enough(("a", "b", *new), active)
    assert not WEIGHED.enough(("a", *new), active)  # heads enough, seniority not
    # a leader that declared a larger swarm than we see is held to it
    assert not WEIGHED.enough(("a", "b"), active, declared=5)
    # nobody active is senior (they left): heads count again, so the swarm is never stuck on absent seniors
    assert WEIGHED.enough(new[:2], set(new)) and not WEIGHED.enough(new[:1], set(new))
    assert "seniority" in WEIGHED.short_of(active) and "majority of 6" in COUNTED.short_of(active)


def test_only_seniors_lead_views_and_move_peers_to_later_ones() -> None:
    schedule, t0 = ViewSchedule(base_s=2.0), 1_000.0
    everyone = (*SENIORS, *SYBILS)
    for v in range(6):
        views = Views(round=3, state_hash=H1, ready_at=t0, anchor=t0)
        here = {p: rec(ready=True, eta=t0) for p in everyone if p != "a"}
        now = t0 + schedule.start(v) + 0.1
        counted = decide(me="a", views=views, here=here, seed=H1, schedule=schedule, now=now)
        assert counted.leader == view_leader(H1, v, everyone)  # the control: sybils in the draw
        views = Views(round=3, state_hash=H1, ready_at=t0, anchor=t0)
        weighed = decide(me="a", views=views, here=here, seed=H1, schedule=schedule, now=now,
                         eligible=WEIGHED.eligible)
        assert weighed.leader == view_leader(H1, v, SENIORS)
    # a sybil advertising a later view moves nobody on
    views = Views(round=3, state_hash=H1, ready_at=t0, anchor=t0)
    here = {p: rec(ready=True, eta=t0, view=0 if p in SENIORS else 3) for p in everyone if p != "a"}
    late = t0 + schedule.length(0) * 0.9
    assert decide(me="a", views=views, here=here, seed=H1, schedule=schedule, now=late,
                  eligible=WEIGHED.eligible).view == 0
    views = Views(round=3, state_hash=H1, ready_at=t0, anchor=t0)
    assert decide(me="a", views=views, here=here, seed=H1, schedule=schedule, now=late).view == 1


# --- real rounds on the in-memory transport ------------------------------------------------------------------------
@pytest.mark.parametrize("checkpointed", [True, False])
def test_idle_sybils_at_the_honest_state_cannot_stop_the_round(net: FakeNetwork, checkpointed: bool) -> None:
    """Seven admitted identities publish ready records at the honest head and answer no join: counted, they make
    the three honest peers need a group of six, and lead most views."""
    honest, _ = admitted_round_one(net, AUTHORITY, ready=True)
    head = honest[0].head
    for _ in SYBILS:
        announce(ticketed(net.peer(), AUTHORITY), head.round, head.state_hash, work=head.work, ready=True)
    if checkpointed:
        cp = _checkpoint({a.transport.peer_id: (300, PROBATION_ROUNDS) for a in honest}, round_number=head.round,
                         state_hash=head.state_hash, run_id=head.certificate.statement.run_id)
        for a in honest:
            assert a.gate.update_checkpoint(cp.to_value())
        results, _ = round_from_heads(honest, offset=1)
        assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3, [r.reason for r in results]
        assert {(a.head.round, a.head.state_hash) for a in honest} == {(head.round + 1, honest[0].head.state_hash)}
        assert honest[0].head.certificate.statement.swarm == 3  # the sybils were never counted
    else:
        with pytest.raises(RoundAborted, match="a majority of 10 active peers"):
            round_from_heads(honest, offset=1)

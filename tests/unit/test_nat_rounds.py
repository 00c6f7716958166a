"""A peer behind NAT takes part in rounds: nobody can dial it, so it never leads a view (nobody could join it) and it
opens each of its shard pipes itself. The in-memory transport refuses every stream opened to such a peer."""
from __future__ import annotations

import contextlib
from collections.abc import Collection
from types import SimpleNamespace

import pytest
from _fake_rounds import H0, announce, averager_for, whole_round
from _records import rec

from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.round import plans
from swarmloco.protocol.round.groups import RoundAborted
from swarmloco.protocol.round.matchmaking import Matchmaker
from swarmloco.protocol.round.plans import Endpoint, Plan
from swarmloco.protocol.round.schedule import view_leader
from swarmloco.protocol.testing.fake import FakeNetwork, FakeTransport


def _swarm_with_nat_peer(net: FakeNetwork) -> tuple[list, FakeTransport]:  # type: ignore[type-arg]
    """Two public peers and one behind NAT that, were it dialable, would lead view 0 of θ_0, and whose id sorts
    last (so in the plan both others come before it: by the old rule, both would dial it)."""
    public = [net.peer(), net.peer()]
    ids = [t.peer_id for t in public]
    nat = net.peer(reachable=False)
    while view_leader(H0, 0, [*ids, nat.peer_id]) != nat.peer_id or nat.peer_id < max(ids):
        net.unreachable.discard(nat.peer_id)
        nat = net.peer(reachable=False)
    averagers = [averager_for(t, quorum=3) for t in [*public, nat]]
    for t in [*public, nat]:
        announce(t)
    return averagers, nat


def test_a_peer_behind_nat_is_a_member_of_the_first_view_and_dials_its_pipes(net: FakeNetwork) -> None:
    averagers, nat = _swarm_with_nat_peer(net)
    results, _ = whole_round(averagers)
    assert net.records[nat.peer_id].reachable is False  # the transport stamps it into the record others read
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3, [r.reason for r in results]
    assert {r.leader for r in results} != {nat.peer_id} and results[-1].role == "member"
    assert all(nat.peer_id in r.members and r.pipes == 2 for r in results), results
    assert len({r.state_hash for r in results}) == 1
    assert all(a.matchmaker.views.current == 0 for a in averagers)  # type: ignore[union-attr]  # no view lost


def test_without_the_leader_rule_the_nat_peer_leads_a_view_nobody_can_join(net: FakeNetwork,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: with every ready peer eligible, the NAT'd peer leads view 0 and the others cannot reach it."""
    monkeypatch.setattr(Matchmaker, "_eligible", lambda self, here, weights: weights.eligible)
    averagers, _ = _swarm_with_nat_peer(net)
    for found in [a.find_group(0, H0) for a in averagers]:
        with contextlib.suppress(RoundAborted):
            found.result(timeout=10)
    assert all(a.matchmaker.views.current >= 1 for a in averagers[:2])  # type: ignore[union-attr]


def test_without_the_dial_rule_nobody_reaches_the_nat_peer(net: FakeNetwork, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: if the earlier member always dialled, both others would dial the NAT'd peer, and fail."""
    monkeypatch.setattr(plans.Plan, "dials", lambda self, a, b: a < b)
    averagers, _ = _swarm_with_nat_peer(net)
    results, _ = whole_round(averagers)
    assert all(r.outcome == Outcome.DISCARDED for r in results)
    assert any("no shard connection" in r.reason for r in results), [r.reason for r in results]


def test_who_dials_whom() -> None:
    def plan(*behind_nat: bool) -> Plan:
        return Plan(round=0, members=tuple("abc"[: len(behind_nat)]), weights=(1,) * len(behind_nat),
                    bounds=(0,) * (len(behind_nat) + 1), endpoints=tuple(Endpoint((), "t", b) for b in behind_nat),
                    codec="fp32", numel=0, prev_hash=H0, swarm=len(behind_nat), work=0)

    assert plan(False, False).dials(0, 1) and not plan(False, False).dials(1, 0)  # the earlier one
    assert plan(False, True).dials(1, 0) and not plan(False, True).dials(0, 1)  # the one behind NAT dials out
    assert plan(True, False).dials(0, 1)
    assert plan(True, True).dials(0, 1) and not plan(True, True).dials(1, 0)  # both behind NAT: the earlier tries
    p = plan(False, True, False)
    assert [[p.dials(a, b) for b in range(3) if b != a] for a in range(3)] == [[False, True], [True, True],
                                                                               [False, False]]


def test_being_dialable_never_outranks_seniority() -> None:
    """The NAT rule narrows the leaders `weights` allows; it never widens them: where the only senior candidate is
    behind NAT, it still leads rather than a dialable probationer (who may be one of a stranger's free identities).
    The signers of the state's certificate are preferred among what is left, never over it."""

    class Seniors:
        @staticmethod
        def eligible(peers: Collection[str]) -> Collection[str]:
            return [p for p in peers if p.startswith("senior")] or peers

    me = SimpleNamespace(transport=SimpleNamespace(reachable=True, peer_id="me"), proven=frozenset())
    here = {"senior-nat": rec(reachable=False), "senior-pub": rec(), "sybil": rec(), "sybil-nat": rec(reachable=False)}
    eligible = Matchmaker._eligible(me, here, Seniors())  # type: ignore[arg-type]
    assert list(eligible(["senior-nat", "sybil", "senior-pub"])) == ["senior-pub"]
    assert list(eligible(["senior-nat", "sybil"])) == ["senior-nat"]
    assert list(eligible(["sybil-nat", "sybil", "me"])) == ["sybil", "me"]
    assert list(eligible(["sybil-nat"])) == ["sybil-nat"]  # nobody dialable: someone must lead
    me.proven = frozenset({"sybil", "senior-nat"})  # they signed our state's certificate
    eligible = Matchmaker._eligible(me, here, Seniors())  # type: ignore[arg-type]
    assert list(eligible(["sybil-nat", "sybil", "me"])) == ["sybil"]
    assert list(eligible(["senior-nat", "senior-pub"])) == ["senior-pub"]  # dialable first, then proven
    assert list(eligible(["sybil-nat", "me"])) == ["me"]  # no signer among the candidates: all of them

"""Backup reducers as pure functions: whom a re-plan leaves out, and the plan every member derives for the second
pass (`swarmloco.protocol.round.recovery`)."""
from __future__ import annotations

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.round.plans import Endpoint, Plan, plan_problem
from swarmloco.protocol.round.recovery import left_out, replan
from swarmloco.protocol.trust.payloads import plan_digest

PEERS = ("a", "b", "c", "d", "e")


def _plan() -> Plan:
    claims = tuple(pb.ContributionClaim(tokens=100 * (i + 1), bandwidth=float(10 + i)) for i in range(5))
    return Plan(round=7, members=PEERS, weights=(100, 200, 300, 400, 500), bounds=(0, 256, 512, 768, 896, 1000),
                endpoints=tuple(Endpoint((f"127.0.0.1:{9000 + i}",), f"t{i}") for i in range(5)), codec="fp32",
                numel=1000, prev_hash="0" * 64, swarm=5, work=2500, excluded={"z": "late"}, claims=claims,
                signature=b"sig")


def _report(*lost: str) -> pb.ShardReport:
    return pb.ShardReport(round=7, refused=list(lost), refused_reasons=["gone"] * len(lost), results=True)


def test_nothing_lost_leaves_nobody_out() -> None:
    reports = {p: _report() for p in PEERS[1:]}
    assert left_out(leader="a", reducers=PEERS, lost_at_leader={}, reports=reports) == {}


def test_a_shard_the_leader_lacks_takes_its_reducer_out_and_everyone_who_lacks_it_stays() -> None:
    reports = {p: _report("c") for p in ("b", "d", "e")} | {"c": _report()}
    out = left_out(leader="a", reducers=PEERS, lost_at_leader={"c": "no result"}, reports=reports)
    assert list(out) == ["c"] and "did not reach the leader" in out["c"]


def test_a_word_against_a_shard_that_reached_the_leader_takes_out_only_the_one_who_says_it() -> None:
    reports = {"b": _report(), "c": _report(), "d": _report("b", "c", "e"), "e": _report()}
    out = left_out(leader="a", reducers=PEERS, lost_at_leader={}, reports=reports)
    assert list(out) == ["d"] and "reached the leader" in out["d"]


def test_a_reducer_with_no_report_is_out() -> None:
    reports = {"b": _report(), "c": None, "d": _report(), "e": _report()}
    assert list(left_out(leader="a", reducers=PEERS, lost_at_leader={}, reports=reports)) == ["c"]


def test_the_re_plan_is_the_same_for_everyone_and_passes_every_members_checks() -> None:
    plan = _plan()
    again = replan(plan, ("e", "a", "c"))  # any order in, plan order out
    assert again == replan(_plan(), ("a", "c", "e"))
    assert plan_digest(again.to_pb()) == plan_digest(replan(_plan(), ("c", "e", "a")).to_pb())
    assert again.members == ("a", "c", "e") and again.weights == (100, 300, 500)
    assert again.work == 2500 - 200 - 400 and again.excluded == {} and not again.signature
    assert [c.tokens for c in again.claims] == [100, 300, 500]
    assert again.endpoints == (plan.endpoints[0], plan.endpoints[2], plan.endpoints[4])
    for me in again.members:
        assert plan_problem(again, round_number=7, codec="fp32", numel=1000, me=me, group=PEERS, max_group=8) == ""
    assert plan_digest(again.to_pb()) != plan_digest(plan.to_pb())  # no first-pass frame counts in the second

"""The plan of a sharded round as pure rules: shard bounds, bandwidth shares, and what a member refuses."""
from __future__ import annotations

from dataclasses import replace

import pytest

from swarmloco.protocol.round.plans import (
    BANDWIDTH_CLAMP,
    SHARD_ALIGN,
    Endpoint,
    Plan,
    bandwidth_shares,
    plan_problem,
    shard_bounds,
)

MEMBERS = ("a", "b", "c", "d")


def _plan(**changes: object) -> Plan:
    numel = 10_000
    plan = Plan(round=3, members=MEMBERS, weights=(10, 20, 30, 40),
                bounds=shard_bounds(numel, bandwidth_shares([0.0] * 4)),
                endpoints=tuple(Endpoint(("127.0.0.1:1",), f"t{i}") for i in range(4)), codec="int8", numel=numel,
                prev_hash="p" * 64, swarm=4, work=100)
    return replace(plan, **changes)  # type: ignore[arg-type]


def _problem(plan: Plan, me: str = "b") -> str:
    return plan_problem(plan, round_number=3, codec="int8", numel=10_000, me=me, group=list(MEMBERS), max_group=64)


@pytest.mark.parametrize("numel", [0, 1, 127, 128, 129, 1000, 10_000, 25_000_001])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 32])
def test_shard_bounds_cut_the_whole_vector_into_aligned_consecutive_shards(numel: int, n: int) -> None:
    bounds = shard_bounds(numel, [1 / n] * n)
    assert len(bounds) == n + 1 and bounds[0] == 0 and bounds[-1] == numel
    assert all(bounds[i] <= bounds[i + 1] for i in range(n))
    assert all(b % SHARD_ALIGN == 0 or b == numel for b in bounds[1:-1])
    if numel >= 100 * SHARD_ALIGN * n:  # large vectors: equal shares give shards within one block of equal
        assert max(bounds[i + 1] - bounds[i] for i in range(n)) - numel / n <= SHARD_ALIGN


def test_bandwidth_sizes_shards_but_a_boast_is_clamped() -> None:
    shares = bandwidth_shares([100.0, 100.0, 200.0, 0.0])  # 0: unknown, taken as the median
    assert shares[2] == pytest.approx(2 * shares[0]) and shares[3] == pytest.approx(shares[0])
    assert sum(shares) == pytest.approx(1.0)
    boasted = bandwidth_shares([1e18, 100.0, 100.0, 100.0])
    assert boasted[0] == pytest.approx(BANDWIDTH_CLAMP * boasted[1])
    starved = bandwidth_shares([1e-9, 100.0, 100.0, 100.0])
    assert starved[0] == pytest.approx(starved[1] / BANDWIDTH_CLAMP)
    assert bandwidth_shares([float("nan"), float("inf"), -5.0]) == pytest.approx([1 / 3] * 3)


def test_claims_near_floats_largest_value_do_not_overflow_the_shares() -> None:
    """The attack: in a group of two, the larger claim is the median, so its 4× clamp is no bound; two claims of
    1.5e308 summed to inf and every share to 0, a plan of empty shards but the last (or a replan giving one
    reducer the whole vector). Claims are capped first."""
    for claims in ([1.5e308, 1.5e308], [1.5e308, 100.0], [1.7e308, 1.7e308, 1.7e308, 1.0]):
        shares = bandwidth_shares(claims)
        assert all(0 < s < 1 for s in shares) and sum(shares) == pytest.approx(1.0), (claims, shares)
        bounds = shard_bounds(10_000, shares)
        assert all(b - a > 0 for a, b in zip(bounds, bounds[1:], strict=False)), bounds


def test_a_member_accepts_a_well_formed_plan() -> None:
    assert _problem(_plan()) == ""


@pytest.mark.parametrize(("changes", "why"), [
    ({"round": 4}, "plan is for round 4"),
    ({"codec": "fp32"}, "fp32"),
    ({"members": ("b", "a", "c", "d")}, "sorted order"),
    ({"members": ("a", "b", "c", "x")}, "distinct members of our group"),
    ({"members": ("a", "a", "b", "c")}, "distinct members"),
    ({"weights": (1, 2, 3)}, "do not match"),
    ({"weights": (0, 2, 3, 4)}, "weight below 1"),
    ({"bounds": (0, 10, 20, 30, 9_999)}, "consecutive pieces"),
    ({"bounds": (0, 10, 20, 10_000)}, "do not match"),
    ({"bounds": (0, 50, 20, 30, 10_000)}, "consecutive pieces"),
    ({"bounds": (0, 9_000, 9_500, 9_800, 10_000)}, "gives one reducer 9000"),
    ({"endpoints": (Endpoint((), ""),) * 4}, "malformed endpoint"),
    ({"endpoints": (Endpoint(("x" * 500,), "t"),) * 4}, "malformed endpoint"),
])
def test_a_member_refuses_a_plan_it_must_not_act_on(changes: dict[str, object], why: str) -> None:
    assert why in _problem(_plan(**changes))


def test_an_excluded_member_learns_why() -> None:
    plan = _plan(members=("a", "c", "d"), weights=(1, 1, 1), bounds=shard_bounds(10_000, [1 / 3] * 3),
                 endpoints=_plan().endpoints[:3], excluded={"b": "staleness 5 > 2"})
    assert _problem(plan) == "our contribution was excluded: staleness 5 > 2"


def test_a_plan_survives_the_wire() -> None:
    plan = _plan(excluded={"e": "no contribution"})
    assert Plan.from_pb(plan.to_pb()) == plan


def test_the_most_lopsided_plan_the_clamp_allows_is_accepted() -> None:
    for n in (2, 3, 4, 8):
        members = MEMBERS[:n] if n <= 4 else tuple(f"m{i}" for i in range(n))
        bounds = shard_bounds(10_000, bandwidth_shares([1e18] + [1.0] * (n - 1)))
        plan = _plan(members=members, weights=(1,) * n, bounds=bounds, endpoints=(Endpoint((), "t"),) * n)
        assert plan_problem(plan, round_number=3, codec="int8", numel=10_000, me=members[1], group=list(members),
                            max_group=64) == ""

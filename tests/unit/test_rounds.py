"""The pure rules of a round: leader and target choice, the grace window, contribution checks, weights, deadlines."""
from __future__ import annotations

import pytest
import torch
from _records import H1, H2, rec

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.records import PROTOCOL_VERSION
from swarmloco.protocol.chain.forks import active_past_genesis, better_claims, outranks
from swarmloco.protocol.round.config import MAX_TOKENS, Deadlines, LocalModel, RoundConfig
from swarmloco.protocol.round.groups import admit
from swarmloco.protocol.round.rules import (
    active_count,
    check_contribution,
    compatible,
    grace_over,
    group_forming,
    token_weights,
    weighted_average,
)


def test_better_claims_rank_by_certified_work_then_round_then_hash() -> None:
    g = "9" * 64  # θ_0
    mine = dict(round_number=3, state_hash=H1, work=300, genesis_hash=g)
    assert better_claims({}, **mine) == []
    assert better_claims({"a": rec(round=3, state_hash=H1, work=300)}, **mine) == []  # our own state
    claims = better_claims({"a": rec(round=5, state_hash=H2, work=500), "b": rec(round=4, work=400),
                            "c": rec(round=5, state_hash=H2, work=500)}, **mine)
    assert [(c.round, c.state_hash, c.donors) for c in claims] == [(5, H2, ("a", "c")), (4, H1, ("b",))]
    # more certified work beats a higher round number (a chain of many tiny rounds does not win a fork)
    forked = better_claims({"a": rec(round=9, state_hash=H2, work=350), "b": rec(round=4, work=600)}, **mine)
    assert [c.round for c in forked] == [4, 9]
    # same work and round: the smaller hash wins on every peer, so exactly one side of a tie moves
    assert better_claims({"a": rec(round=3, state_hash=H2, work=300)}, **mine) == []
    assert [c.state_hash for c in better_claims({"a": rec(round=3, state_hash=H1, work=300)},
                                                 **{**mine, "state_hash": H2})] == [H1]
    # θ_0 is computed, never fetched: a round-0 record with another hash is no claim at all
    at_genesis = dict(round_number=0, state_hash=g, work=0, genesis_hash=g)
    assert better_claims({"a": rec(round=0, state_hash=H2)}, **at_genesis) == []


def test_outranks_is_a_strict_total_order() -> None:
    keys = [(0, 0, H1), (5, 1, H2), (5, 1, H1), (5, 2, H2), (7, 0, H1)]
    for x in keys:
        assert not outranks(x, x)
        for y in keys:
            if x != y:
                assert outranks(x, y) != outranks(y, x)


def test_active_counts_the_swarm_a_group_must_be_a_majority_of() -> None:
    records = {"a": rec(round=5), "b": rec(round=4), "c": rec(round=1), "d": rec(round=0)}
    assert active_count(records, 5) == 3  # us, a, and b (one round behind: catching up); not the joiners
    assert active_count(records, 0) == 5  # at θ_0 everyone is at the start
    assert active_past_genesis(records) == 4


def test_compatible_and_group_forming() -> None:
    records = {"a": rec(), "b": rec(fingerprint="other"), "c": rec(version=PROTOCOL_VERSION + 1)}
    assert list(compatible(records, "fp")) == ["a"]
    assert not group_forming({"a": rec()}, 3, H1)
    assert group_forming({"a": rec(ready=True)}, 3, H1)
    assert not group_forming({"a": rec(ready=True)}, 4, H1) and not group_forming({"a": rec(ready=True)}, 3, H2)


def test_grace_window_waits_for_expected_peers_within_bounds() -> None:
    cfg = RoundConfig(grace_min_s=0.5, grace_max_s=10)
    assert not grace_over(waited=0.1, etas=[], cfg=cfg)  # nobody expected, but the minimum is not over
    assert grace_over(waited=0.6, etas=[], cfg=cfg)
    assert not grace_over(waited=0.6, etas=[None], cfg=cfg)  # a ready peer that has not joined yet
    assert not grace_over(waited=2.0, etas=[5.0], cfg=cfg)  # expected before the window ends
    assert grace_over(waited=2.0, etas=[9.0], cfg=cfg)  # expected after the window: do not wait
    assert grace_over(waited=10.0, etas=[None, 0.0], cfg=cfg)  # never past grace_max


def test_contribution_checks_name_the_problem() -> None:
    ok = dict(codec="int8", numel=10, tokens=5, staleness=0, expect_codec="int8", expect_numel=10, max_staleness=2)
    assert check_contribution(**ok) == ""
    assert "codec 'fp32'" in check_contribution(**{**ok, "codec": "fp32"})
    assert "9 elements, model has 10" in check_contribution(**{**ok, "numel": 9})
    assert "token weight 0" in check_contribution(**{**ok, "tokens": 0})
    assert "outside" in check_contribution(**{**ok, "tokens": MAX_TOKENS + 1})
    assert "staleness 3 > 2" in check_contribution(**{**ok, "staleness": 3})


def test_token_weights_cap_at_a_multiple_of_the_group_median_and_discount() -> None:
    cfg = RoundConfig(weight_cap_factor=4, stale_discount=0.5)
    weights = token_weights({"lead": (100, 0), "greedy": (10**12, 0), "stale": (100, 2), "small": (30, 0)}, cfg=cfg)
    # median claim (lower) is 100: the greedy claim is worth 400, whoever leads and however small the leader's is
    assert weights == {"greedy": 400, "lead": 100, "small": 30, "stale": 25}
    assert token_weights({"lead": (1, 0), "greedy": (10**12, 0), "b": (100, 0)}, cfg=cfg)["greedy"] == 400
    assert token_weights({"lead": (0, 0)}, cfg=cfg) == {"lead": 1}  # never a zero total


def test_weighted_average_is_exact_and_order_independent() -> None:
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    avg = weighted_average({"b": b, "a": a}, {"a": 1.0, "b": 3.0})
    assert torch.allclose(avg, torch.tensor([2.5, 5.0]))
    assert torch.equal(weighted_average({"a": a, "b": b}, {"a": 1.0, "b": 3.0}), avg)
    assert torch.equal(a, torch.tensor([1.0, 2.0]))  # inputs untouched
    with pytest.raises(ValueError):
        weighted_average({}, {})


def test_deadlines_derive_from_one_config() -> None:
    d = Deadlines.of(RoundConfig(exchange_timeout_s=20, control_timeout_s=4))
    assert (d.control, d.transfer, d.linger) == (4, 20, 20)
    # the training thread outwaits the wire: claim, plan and pipes (a control frame each), parts, reduced shards
    assert d.exchange > 3 * d.control + 2 * d.transfer


def test_round_config_validation_names_values() -> None:
    with pytest.raises(ValueError, match="quorum: got 0"):
        RoundConfig(quorum=0)
    with pytest.raises(ValueError, match="allowed fp32, fp16, bf16, int8, int4"):
        RoundConfig(codec="gzip")
    with pytest.raises(ValueError, match="control_timeout_s: got 0.1"):
        RoundConfig(control_timeout_s=0.1)


def test_admission_refuses_incompatible_or_wrong_state_joins() -> None:
    model = LocalModel(fingerprint="fp", config={"d_model": 128}, numel=10)
    kw = dict(run_id="r", model=model, state_hash=H1, collecting_round=3, closed=False, size=0, max_group=4)
    req = pb.JoinRequest(protocol_version=PROTOCOL_VERSION, run_id="r", fingerprint="fp", round=3, state_hash=H1)
    assert admit(req, **kw) == (pb.JoinReply.ACCEPTED, "")
    assert admit(req, **{**kw, "collecting_round": None})[0] == pb.JoinReply.NOT_LEADER
    assert admit(req, **{**kw, "collecting_round": 2})[0] == pb.JoinReply.NOT_LEADER
    assert admit(req, **{**kw, "closed": True})[0] == pb.JoinReply.ROUND_CLOSED
    assert admit(req, **{**kw, "size": 3})[0] == pb.JoinReply.FULL
    assert admit(req, **{**kw, "state_hash": H2})[0] == pb.JoinReply.WRONG_STATE
    status, msg = admit(pb.JoinRequest(protocol_version=PROTOCOL_VERSION + 1, run_id="r", fingerprint="fp"), **kw)
    assert status == pb.JoinReply.INCOMPATIBLE and "protocol version differs" in msg
    status, msg = admit(
        pb.JoinRequest(
            protocol_version=PROTOCOL_VERSION, run_id="r", fingerprint="zz", task_config_json='{"d_model": 256}'
        ),
        **kw,
    )
    assert status == pb.JoinReply.INCOMPATIBLE and "d_model: ours 128 vs theirs 256" in msg
    status, msg = admit(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, run_id="other", fingerprint="fp"), **kw)
    assert status == pb.JoinReply.INCOMPATIBLE and "run id differs" in msg

"""Credit for verified work: the rule on plain numbers, the statement that carries it, and whole rounds on the
in-memory transport with a free rider (a zero or random Δ claiming 1000× the tokens) and a member that lies about
its own score. Each defence has its control: without the probe the rider is credited, and without the reducers'
check of the gradient sketch the liar is."""
from __future__ import annotations

import pytest
import torch
from _fake_rounds import NUMEL, announce, by_rank, peers, round_from_heads, whole_round

from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.round import audit as audit_module
from swarmloco.protocol.round import shard_reduce
from swarmloco.protocol.round.config import RoundConfig
from swarmloco.protocol.round.credit import CREDIT_BAND, clip_scales, credits, uncredited
from swarmloco.protocol.round.rules import token_weights
from swarmloco.protocol.testing.fake import FakeNetwork
from swarmloco.protocol.testing.faults import FaultInjector
from swarmloco.protocol.trust.certificates import Certificate, Head, Statement

pytestmark = pytest.mark.timeout(60)
G = torch.ones(NUMEL)  # the fake task's loss gradient: every honest Δ (delta(i) = i + 1 everywhere) lowers it


def probe(seed: bytes) -> torch.Tensor:
    return G.clone()


# --- the rule ------------------------------------------------------------------------------------------------------
def test_honest_members_of_uneven_speed_are_all_credited() -> None:
    # a peer that trained twice the tokens lowers the loss less than twice as much: still credited in full
    assert credits([10.0, 15.0, 30.0], [100, 200, 400], [100, 200, 400]) == (100, 200, 400)


def test_a_zero_or_harmful_delta_earns_nothing() -> None:
    assert credits([10.0, 0.0, -5.0], [100, 400, 100], [100, 400, 100]) == (100, 0, 0)
    assert credits([0.0, -1.0], [100, 100], [100, 100]) == (0, 0)


def test_a_claim_far_beyond_the_work_behind_it_earns_nothing() -> None:
    # the rider's Δ lowers the loss a little, but per claimed token far less than the group's median member
    rider = 10.0 / 100 / CREDIT_BAND * 400 * 0.9
    assert credits([10.0, 12.0, rider], [100, 100, 400], [100, 100, 400]) == (100, 100, 0)


def test_a_cut_member_is_judged_on_what_it_claims_and_credited_its_cut_weight() -> None:
    # weight 1 after a cut; an honest Δ again earns that weight (and so its full weight next round) ...
    assert credits([10.0, 11.0, 9.0], [100, 100, 100], [100, 100, 1]) == (100, 100, 1)
    # ... but a token Δ behind a large claim does not, however small the cut weight makes its rate look
    assert credits([10.0, 11.0, 0.01], [100, 100, 400], [100, 100, 1]) == (100, 100, 0)


def test_clip_scales_read_back_the_robust_rule() -> None:
    assert clip_scales([1.0, 3.0, 50.0], [0.3, 0.2, 0.0], 2.0) == [1.0, 2.0 / 3.0, 0.0]
    assert clip_scales([1.0, 3.0], [0.5, 0.5], 0.0) == [1.0, 1.0]  # the plain mean clips nothing


def test_the_next_plan_cuts_exactly_the_uncredited_members() -> None:
    cfg = RoundConfig()
    claims = {"a": (100, 0), "b": (100, 0), "c": (10**6, 0)}
    assert token_weights(claims, cfg=cfg, cut={"c"}) == {"a": 100, "b": 100, "c": 1}
    statement = _statement(credit=(100, 0, 0), weights=(100, 50, 0))
    # "c" had no weight at all (nothing to cut); "b" had weight and no credit
    assert uncredited(Head.of(Certificate(statement))) == {"b"}
    assert uncredited(Head.of(Certificate(_statement(credit=None, weights=(100, 50, 0))))) == frozenset()


# --- the statement -------------------------------------------------------------------------------------------------
def _statement(*, credit: tuple[int, ...] | None, weights: tuple[int, ...] = (100, 100, 100),
               work: int | None = None) -> Statement:
    counted = weights if credit is None else credit
    return Statement(run_id="run", round=3, prev_hash="a" * 64, new_hash="b" * 64, members=("a", "b", "c"),
                     weights=weights, swarm=3, work=sum(counted) if work is None else work, credit=credit)


def test_credit_travels_in_the_certificate_and_is_bounded_by_the_weight() -> None:
    s = _statement(credit=(100, 0, 100))
    assert s.problem() == ""
    assert Certificate.from_bytes(Certificate(s).to_bytes()).statement == s
    assert Certificate.from_bytes(Certificate(_statement(credit=None)).to_bytes()).statement.credit is None
    assert "credit" in _statement(credit=(100, 101, 0), work=201).problem()
    assert "credit" in _statement(credit=(100, 0)).problem()
    assert "credit" in _statement(credit=(100, -1, 0), work=100).problem()
    # the chain's work counts credit, not weights: a statement that counts an uncredited weight is malformed
    assert "work" in _statement(credit=(100, 0, 0), work=50).problem()
    assert _statement(credit=(100, 0, 0), work=300).problem() == ""  # (work includes earlier rounds)
    with pytest.raises(ValueError, match="credit"):
        Certificate.from_bytes(Certificate(s).to_bytes().replace(b'"credit":[100,0,100]', b'"credit":[1.5,0,1]'))


# --- whole rounds --------------------------------------------------------------------------------------------------
def _swarm(net: FakeNetwork, spec: str, *, with_probe: bool = True) -> list:
    """Four peers in leader order, the last (never view 0's leader) hostile as `spec` says. A leader waits up to 3 s
    for ready peers that have not joined yet, so a peer whose thread starts late still makes the group."""
    averagers = by_rank(peers(net, 4, quorum=3, probe=probe if with_probe else None, grace_max_s=3.0,
                              round_timeout_s=20))
    bad = averagers[3]
    bad.hooks = FaultInjector.parse(spec)
    assert bad.steps is not None
    bad.steps.hooks = bad.hooks
    return averagers


@pytest.mark.parametrize("rider", ["freeride", "freeride_noise"])
def test_a_free_rider_is_credited_nothing_and_weighs_1_in_the_next_round(net: FakeNetwork, rider: str) -> None:
    averagers = _swarm(net, f"contribute={rider}@*")
    bad = averagers[3].transport.peer_id
    results, _ = whole_round(averagers)
    assert all(r.outcome == Outcome.COMMITTED for r in results), [r.reason for r in results]
    s = results[0].certificate.statement
    credit = dict(zip(s.members, s.credit, strict=True))
    weight = dict(zip(s.members, s.weights, strict=True))
    assert weight[bad] == 400  # its 1000× claim, capped at 4× the median: merged at that weight this once ...
    assert credit[bad] == 0  # ... and credited nothing
    assert all(credit[p] == weight[p] == 100 for p in s.members if p != bad), credit
    assert s.work == 300
    # the next round: every plan from this state gives it weight 1; it is scored again and earns nothing again
    # (a free rider rides in the rounds it leads too)
    again = _next_round(averagers, offset=4)
    assert all(r.outcome == Outcome.COMMITTED for r in again), [r.reason for r in again]
    s2 = again[0].certificate.statement
    assert dict(zip(s2.members, s2.weights, strict=True))[bad] == 1
    assert dict(zip(s2.members, s2.credit, strict=True))[bad] == 0
    assert s2.work == s.work + 300


def test_a_cut_peer_that_contributes_honestly_earns_its_weight_back(net: FakeNetwork) -> None:
    averagers = _swarm(net, "contribute=freeride@0")  # a free ride in the first round only
    bad = averagers[3].transport.peer_id
    first, _ = whole_round(averagers)
    assert all(r.outcome == Outcome.COMMITTED for r in first), [r.reason for r in first]
    for expect_weight in (1, 100):  # cut to 1 while it proves itself, then its full weight
        results = _next_round(averagers, offset=len(averagers))
        assert all(r.outcome == Outcome.COMMITTED for r in results), [r.reason for r in results]
        s = results[0].certificate.statement
        assert dict(zip(s.members, s.weights, strict=True))[bad] == expect_weight
        assert dict(zip(s.members, s.credit, strict=True))[bad] == expect_weight


def test_control_without_the_probe_the_free_rider_is_credited_its_capped_claim(net: FakeNetwork) -> None:
    averagers = _swarm(net, "contribute=freeride@*", with_probe=False)
    bad = averagers[3].transport.peer_id
    results, _ = whole_round(averagers)
    s = results[0].certificate.statement
    assert s.credit is None and dict(zip(s.members, s.credited, strict=True))[bad] == 400


def _next_round(averagers: list, offset: int) -> list:
    """Every peer announces the head it now holds, then they run one round from it."""
    for a in averagers:
        announce(a.transport, a.head.round, a.head.state_hash, work=a.head.work)
    results, _ = round_from_heads(averagers, offset=offset)
    return results


def _lying_probe(seed: bytes) -> torch.Tensor:
    """A member that sketches its random Δ against a g of its own choosing (aligned with its Δ), so that its
    claimed <g_j, part> is large and positive."""
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))


@pytest.fixture(params=["checked", "unchecked"])
def sketch_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "unchecked":  # the control: reducers and members that take any gradient sketch on trust
        monkeypatch.setattr(audit_module, "gradient_dot_matches", lambda *a, **k: True)
        monkeypatch.setattr(audit_module, "gradient_combination_ok", lambda *a, **k: True)
    return str(request.param)


def test_a_member_that_lies_about_its_score_is_convicted(net: FakeNetwork, sketch_check: str) -> None:
    averagers = _swarm(net, "contribute=freeride_noise@*")
    liar = averagers[3]
    assert liar.steps is not None
    liar.steps.probe = _lying_probe
    # its random Δ is drawn with the same generator as its g, so the two are aligned: a large claimed score
    liar.hooks = FaultInjector.parse("contribute=freeride_noise@*")
    liar.steps.hooks = liar.hooks
    results, _ = whole_round(averagers)
    bad = liar.transport.peer_id
    honest = results[:3]
    if sketch_check == "unchecked":
        committed = [r for r in honest if r.outcome == Outcome.COMMITTED]
        assert committed and dict(zip(committed[0].certificate.statement.members,
                                      committed[0].certificate.statement.credit, strict=True))[bad] > 0
        return
    assert all(r.outcome == Outcome.DISCARDED and bad in r.cheaters for r in honest), [r.reason for r in honest]
    assert all(bad in a.steps.banned for a in averagers[:3])


@pytest.mark.parametrize("checked", [True, False])
def test_a_reducer_that_lies_only_about_its_own_part_is_convicted(net: FakeNetwork, monkeypatch: pytest.MonkeyPatch,
                                                                  checked: bool) -> None:
    """The <g, part> of a reducer's own part of its own shard is checked by no reducer: it holds the only copy. A
    free rider (a random Δ claiming 1000× the tokens) computes everything honestly, checks the others' values
    honestly, and adds 1e6 to that one value. Every member checks each shard's values against the result it holds
    (they are linear in the parts, like the probes): the liar is convicted. The control, without that check: it is
    credited."""
    averagers = _swarm(net, "contribute=freeride_noise@*")
    bad = averagers[3].transport.peer_id
    its_part: list[torch.Tensor] = []
    real_audit, real_sketches = shard_reduce.audit, audit_module.sketches

    async def noting_its_part(case, pipes, *, timeout):  # type: ignore[no-untyped-def]
        if case.plan.members[case.k] == bad:
            its_part.append(case.own[case.k])
        return await real_audit(case, pipes, timeout=timeout)

    def lying(seed, probes, shards, extras=None, **kw):  # type: ignore[no-untyped-def]
        out = real_sketches(seed, probes, shards, extras, **kw)
        for tensors, values in zip(shards, out, strict=True):
            if len(tensors) == 2 and its_part and tensors[0] is its_part[-1]:  # its sketch of its own shard
                values[0][probes] += 1e6
        return out

    monkeypatch.setattr(shard_reduce, "audit", noting_its_part)
    monkeypatch.setattr(audit_module, "sketches", lying)
    if not checked:
        monkeypatch.setattr(audit_module, "gradient_combination_ok", lambda *a, **k: True)
    results, _ = whole_round(averagers)
    honest = results[:3]
    assert its_part
    if not checked:
        committed = [r for r in honest if r.outcome == Outcome.COMMITTED]
        assert committed and dict(zip(committed[0].certificate.statement.members,
                                      committed[0].certificate.statement.credit, strict=True))[bad] > 0
        return
    assert all(r.outcome == Outcome.DISCARDED and bad in r.cheaters for r in honest), [r.reason for r in honest]
    assert all("credit" in r.cheaters[bad] for r in honest), [r.cheaters for r in honest]

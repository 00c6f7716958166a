"""Poisoned contributions and cheating reducers against real honest peers: one hostile peer of four, built from
the project's own code (a `SWARMLOCO_FAULTS` fault injector), admitted like the others.

- Δ × −1000, claiming 1000× the tokens, every round: with the robust aggregator the honest peers' final eval loss
  stays within 5% of a clean run of the same settings; with the plain mean (the control) it does not. (A random Δ
  1000× as long is dropped by the same rule: tests/unit/test_robust_rounds.py.)
- A free rider (a zero Δ claiming 1000× the tokens): credited nothing, and the final eval loss within 2% of a
  clean run.
- A reducer that signs and sends −(its true shard): no round with its result is certified, the honest peers ban
  it, and later rounds commit without it. (Noise 1000× as long, and different shards for different members, are
  covered with the same one in tests/unit/test_robust_rounds.py, on the in-memory transport.)

On the code before signed results, audits and robust aggregation, the poisoned runs end with an eval loss many
times the clean one (or a NaN), and the cheating reducers' shards are committed.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
from swarm_harness import PRESET as HARNESS_PRESET
from swarm_harness import Swarm, assert_no_split

# tiny, not the harness's nano: on nano the free rider's final loss came within 2% of a clean run in 2 runs of 3
# only (0.97x, 0.98x, 1.027x: clean runs alone differ by ~1.5%); the bounds below were calibrated on tiny
PRESET = "tiny"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600), pytest.mark.preset(PRESET)]
ROUNDS = 5
HONEST = ["a", "b", "c"]


def _run(swarm: Swarm, *, faults: str = "", extra: tuple[str, ...] = (), rounds: int = ROUNDS) -> dict[str, Any]:
    """Three honest peers and a fourth (hostile when `faults` is set) train `rounds` rounds; returns per honest
    peer its committed rounds, last eval loss, exit code and the round events."""
    ids = swarm.identities(4)
    for name, (_, identity) in zip(HONEST, ids[:3], strict=True):
        # evaluated once, at the last round: the loss this module compares
        swarm.start(name, *extra, "--eval-every", str(rounds), identity=identity, rounds=rounds, quorum=3, wait_for=4)
    swarm.start("x", *extra, identity=ids[3][1], faults=faults, rounds=rounds + 3, quorum=3, wait_for=4)
    # the honest peers stop after `rounds`; the hostile one (banned, alone) is stopped by the fixture
    swarm.wait_for(lambda: all(swarm.peers[n].proc.poll() is not None for n in HONEST), 420, "the honest peers")
    codes = {n: swarm.peers[n].proc.poll() for n in HONEST}
    out: dict[str, Any] = {"codes": codes, "hostile": ids[3][0]}
    for name in HONEST:
        rounds_ = [e for e in swarm.events(name, "round") if e.get("outcome") == "committed"]
        losses = [e["eval_loss"] for e in rounds_ if e.get("eval_loss") is not None]
        out[name] = {"committed": len(rounds_), "loss": losses[-1] if losses else math.nan,
                     "events": swarm.events(name, "round")}
    return out


def _loss(run: dict[str, Any]) -> float:
    """The eval loss of the final state: among the honest peers that committed the last round (a peer that missed
    one certificate re-syncs to the state instead of committing it)."""
    last = max(run[n]["committed"] for n in HONEST)
    return max(run[n]["loss"] for n in HONEST if run[n]["committed"] == last)


def _all_rounds(run: dict[str, Any]) -> bool:
    """Every round certified: some honest peer committed each, and none missed more than one (it re-synced)."""
    counts = [run[n]["committed"] for n in HONEST]
    return max(counts) == ROUNDS and min(counts) >= ROUNDS - 1


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, peer_zygote: Any) -> float:
    s = Swarm(tmp_path_factory.mktemp("clean"), spawner=peer_zygote, preset=PRESET)
    try:
        run = _run(s)
        assert all(c == 0 for c in run["codes"].values()), s.tails()
        assert _all_rounds(run), s.tails()
        return _loss(run)
    finally:
        s.close()
        s.assert_nothing_left()


def test_robust_aggregation_keeps_the_model_within_5_percent_of_a_clean_run(swarm: Swarm, clean: float) -> None:
    """One real-process case (Δ × −1000 with 1000× the tokens); the random 1000× Δ is covered with it on the
    in-memory transport (tests/unit/test_robust_rounds.py), where the same rule drops both."""
    run = _run(swarm, faults="contribute=negate1000@*")
    assert all(c == 0 for c in run["codes"].values()), swarm.tails()
    assert _all_rounds(run), swarm.tails()
    loss = _loss(run)
    assert math.isfinite(loss) and loss <= 1.05 * clean, (loss, clean)
    # the hostile Δ was in the rounds (it was not refused as malformed), it just weighed nothing
    assert any(run["hostile"] in e.get("members", []) for n in HONEST for e in run[n]["events"])
    assert_no_split(swarm, HONEST)


def test_a_free_rider_is_credited_nothing_and_costs_the_model_little(swarm: Swarm, clean: float) -> None:
    """A member that sends a zero Δ claiming 1000× the tokens, every round: every certified round it contributed
    to credits it 0 (the honest members in full), the rounds after its first weigh it 1, and the honest final eval
    loss stays within 2% of the clean run. It rides in the rounds it leads too. (A rider that is honest whenever it
    leads earns its full weight back for the round after: docs/security.md, "Free riders, what is left".)"""
    run = _run(swarm, faults="contribute=freeride@*")
    hostile = run["hostile"]
    assert all(c == 0 for c in run["codes"].values()), swarm.tails()
    assert _all_rounds(run), swarm.tails()
    ridden = 0
    for name in HONEST:
        for e in run[name]["events"]:
            if e.get("outcome") != "committed" or hostile not in e.get("members", []):
                continue
            credit = dict(zip(e["members"], e["credit"], strict=True))
            weight = dict(zip(e["members"], e["weights"], strict=True))
            assert credit[hostile] == 0 and all(credit[p] == weight[p] for p in credit if p != hostile), e
            assert e["round"] == 1 or weight[hostile] == 1, e  # cut from its first uncredited round on
            ridden += 1
    assert ridden, "the free rider never contributed to a certified round"
    loss = _loss(run)
    assert math.isfinite(loss) and loss <= 1.02 * clean, (loss, clean)
    assert_no_split(swarm, HONEST)


def test_plain_mean_is_poisoned_the_control(swarm: Swarm, clean: float) -> None:
    run = _run(swarm, faults="contribute=negate1000@*", extra=("--aggregator", "mean"))
    losses = [run[n]["loss"] for n in HONEST]
    crashed = any(c != 0 for c in run["codes"].values())
    assert crashed or not all(math.isfinite(x) for x in losses) or min(losses) > 1.5 * clean, (losses, clean)


@pytest.mark.preset(HARNESS_PRESET)  # compares no loss: the harness's cheaper model will do
def test_a_cheating_reducer_is_never_certified_and_is_banned(swarm: Swarm) -> None:
    """One real-process case (a reducer that flips its result); flip, noise1000 and equivocate are each covered on
    the in-memory transport (tests/unit/test_robust_rounds.py)."""
    run = _run(swarm, faults="reduce=flip@*")
    hostile = run["hostile"]
    assert all(c == 0 for c in run["codes"].values()), swarm.tails()
    for name in HONEST:
        events = run[name]["events"]
        # no certified round ever has the cheater among its contributors
        assert not any(e.get("outcome") == "committed" and hostile in e.get("members", []) for e in events), events
        assert any(hostile in e.get("cheaters", {}) for e in events), events
    assert _all_rounds(run), swarm.tails()
    assert_no_split(swarm, HONEST)

"""Validate before adopting (peer/adoption.py): a certified state must also be worth training from."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from swarmloco.peer.adoption import AdoptionCheck
from swarmloco.peer.config import AdoptConfig, ConfigError, RuntimeConfig, TrainConfig
from swarmloco.peer.model import GPT, GPTConfig
from swarmloco.peer.outer import outer_step
from swarmloco.peer.outer_config import OuterConfig
from swarmloco.peer.replica import Replica
from swarmloco.peer.swarm_state import progress_kept
from swarmloco.peer.swarm_sync import STALE_TRIES, SwarmSync
from swarmloco.peer.task import Batch, Task, lm_loss
from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.chain.forks import Behind
from swarmloco.protocol.round.averager import RoundResult
from swarmloco.protocol.trust.certificates import Certificate, Statement

CFG = GPTConfig(context=16, d_model=32, n_layers=1, n_heads=2)
# A sequence a small model learns in a few dozen steps: the held-out loss really falls with training.
DATA = (torch.arange(8192) * 7 % 13).to(torch.uint8)


def _windows(g: torch.Generator, n: int) -> Batch:
    idx = torch.randint(0, DATA.numel() - 17, (n,), generator=g)[:, None] + torch.arange(17)
    w = DATA[idx].long()
    return w[:, :-1], w[:, 1:]


def _task() -> Task:
    def batches(start: int):  # type: ignore[no-untyped-def]
        step = start
        while True:
            yield _windows(torch.Generator().manual_seed(step), 8)
            step += 1

    def factory() -> GPT:
        torch.manual_seed(0)
        return GPT(CFG)

    return Task(name="t", model_factory=factory, train_batches=batches, loss_fn=lm_loss,
                evaluate=lambda m: float("nan"), config=CFG.to_dict(),
                probe=lambda seed: [_windows(torch.Generator().manual_seed(seed), 8) for _ in range(2)])


def _replica() -> Replica:
    return Replica(_task(), TrainConfig(inner_steps=5, warmup_steps=0, lr=3e-3), OuterConfig(),
                   RuntimeConfig(device="cpu"))


def _train(replica: Replica, rounds: int) -> None:
    for _ in range(rounds):
        for _ in range(5):
            replica.inner_step()
        replica.apply_outer(replica.pseudo_gradient())


def _copy(t: dict[str, torch.Tensor], scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {n: v.clone() * scale for n, v in t.items()}


@pytest.fixture(scope="module")
def trained() -> Replica:
    r = _replica()
    _train(r, 4)
    return r


def test_a_joiner_at_theta0_adopts_a_trained_state(trained: Replica) -> None:
    joiner = _replica()
    verdict = AdoptionCheck(joiner, AdoptConfig(), seed=1).verdict(
        trained.global_params, trained.momentum, next_round=False)
    assert verdict.problem == "" and verdict.new_loss < verdict.own_loss, verdict


def test_a_rescaled_state_is_refused_however_valid_its_certificate(trained: Replica) -> None:
    """The attack seen in an open run: sybils certified a rescaled θ ahead of the honest chain."""
    peer = _replica()
    peer.load_global(_copy(trained.global_params), _copy(trained.momentum), trained.round, keep_local=False)
    check = AdoptionCheck(peer, AdoptConfig(), seed=2)
    for scale in (3.0, 1.5, 0.3):
        verdict = check.verdict(_copy(trained.global_params, scale), trained.momentum, next_round=False)
        assert "held-out loss" in verdict.problem, (scale, verdict)
    # Switched off (any loss accepted), the same state would be adopted: the check is what refuses it.
    lax = AdoptionCheck(peer, AdoptConfig(tolerance=10.0), seed=2)
    assert lax.verdict(_copy(trained.global_params, 1.5), trained.momentum, next_round=False).problem == ""


def test_non_finite_state_is_refused(trained: Replica) -> None:
    params = _copy(trained.global_params)
    next(iter(params.values()))[0] = float("inf")
    verdict = AdoptionCheck(_replica(), AdoptConfig(), seed=3).verdict(params, trained.momentum, next_round=False)
    assert verdict.problem == "it holds non-finite values"


def test_the_next_round_must_lie_within_a_few_outer_steps(trained: Replica) -> None:
    peer = _replica()
    _train(peer, 3)
    honest = _copy(peer.global_params)
    momentum = _copy(peer.momentum)
    for _ in range(5):
        peer.inner_step()
    step = outer_step(honest, peer.pseudo_gradient(), momentum, OuterConfig())  # the round a peer would certify
    check = AdoptionCheck(peer, AdoptConfig(tolerance=10.0), seed=4)
    assert check.verdict(honest, momentum, next_round=True).problem == "", (step, list(peer.outer_steps))
    noise = {n: torch.randn_like(v) for n, v in peer.global_params.items()}
    norm = math.sqrt(sum(float(v.norm()) ** 2 for v in noise.values()))
    far = {n: v + noise[n] * (10 * max(peer.outer_steps) / norm) for n, v in peer.global_params.items()}
    verdict = check.verdict(far, peer.momentum, next_round=True)
    assert "from our state, one round back" in verdict.problem and verdict.distance > 8 * max(peer.outer_steps)
    # Further ahead or on another fork, no distance bound applies: only the loss (here: any loss) is checked.
    assert check.verdict(far, peer.momentum, next_round=False).problem == ""


def test_outer_step_returns_its_length() -> None:
    params = {"w": torch.randn(5, 3)}
    before = params["w"].clone()
    length = outer_step(params, {"w": torch.randn(5, 3)}, {"w": torch.zeros(5, 3)}, OuterConfig())
    assert math.isclose(length, float((params["w"] - before).norm()), rel_tol=1e-5)


def test_each_peer_judges_on_batches_of_its_own() -> None:
    a, b = AdoptionCheck(_replica(), AdoptConfig()), AdoptionCheck(_replica(), AdoptConfig())
    assert a.batches is not None and b.batches is not None
    assert not torch.equal(a.batches[0][0], b.batches[0][0])


@pytest.mark.parametrize("kw", [{"tolerance": -0.1}, {"tolerance": 11.0}, {"step_factor": 0.5}])
def test_bad_settings_are_refused_with_their_name(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="adopt_"):
        AdoptConfig(**kw)


def test_progress_is_kept_across_a_resync_only_where_the_others_can_merge_it() -> None:
    """A peer at round 1 (hash "a"), 5 inner steps into its round, adopts a certified state. Its Δ survives as a stale
    contribution only where the group knows the Δ's base: not across forks (a split swarm's lighter half, healed,
    offered Δs based on its own round 1 that the heavier half refused in every round, forever)."""
    def target(round_number: int, prev: str, members: tuple[str, ...] = ("x", "y")) -> Behind:
        statement = Statement(run_id="r", round=round_number, prev_hash=prev, new_hash="c" * 64, members=members,
                              weights=(1,) * len(members), swarm=2, work=10)
        return Behind(round=round_number, state_hash="c" * 64, donors=["x"], certificate=Certificate(statement))

    def kept(t: Behind, **kw: int) -> tuple[bool, bool]:
        args = {"steps": 5, "staleness": t.round - 1, "max_staleness": 2, **kw}
        return progress_kept(t, round_number=1, state_hash="a" * 64, me="me", **args)

    assert kept(target(2, "a" * 64)) == (True, False)  # the next round from our state: its peers held ours
    assert kept(target(2, "a" * 64, ("me", "x"))) == (False, True)  # our Δ is in it already
    assert kept(target(2, "b" * 64)) == (False, False)  # one round on, another fork
    assert kept(target(1, "0" * 64)) == (False, False)  # our round, another hash: another fork
    assert kept(target(3, "b" * 64)) == (True, False)  # further on: its chain may hold our state; staleness bounds it
    assert kept(target(3, "b" * 64), max_staleness=1) == (False, False)
    assert kept(target(2, "a" * 64), steps=0) == (False, False)  # nothing trained, nothing to keep


def test_kept_progress_that_no_group_merges_is_dropped_after_a_few_discarded_rounds() -> None:
    """Kept across a resync whose fork we could not tell (the target was two rounds on), a Δ whose base the group
    never held is refused in every round: each is discarded, and the peer offered the same Δ again at once. After
    STALE_TRIES discarded rounds in a row it trains afresh from θ_r instead; fresh progress is never dropped so."""
    replica = _replica()
    for _ in range(3):
        replica.inner_step()
    wasted: list[int] = []
    sync = SwarmSync.__new__(SwarmSync)
    sync.replica, sync.staleness, sync.stale_tries = replica, 2, 0
    sync.node = SimpleNamespace(update_record=lambda **kw: None)  # type: ignore[assignment]
    sync.reports = SimpleNamespace(resynced=wasted.append)  # type: ignore[assignment]
    sync.log_round = lambda entry, **kw: None  # type: ignore[method-assign]
    refused = RoundResult(outcome=Outcome.DISCARDED, round=0, leader="x", role="member",
                          reason="its Δ is based on round 1, a state we do not know as certified")
    sync.averager = SimpleNamespace(run_round=lambda *a, **kw: refused)  # type: ignore[assignment]
    group = SimpleNamespace(view=0)
    for _ in range(STALE_TRIES - 1):
        sync.average(group, {})  # type: ignore[arg-type]
        assert (replica.round_steps, sync.staleness) == (3, 2)
    tokens = replica.round_tokens
    sync.average(group, {})  # type: ignore[arg-type]
    assert (replica.round_steps, sync.staleness, wasted) == (0, 0, [tokens]) and tokens > 0
    assert all(torch.equal(p, replica.global_params[n]) for n, p in replica.local_params().items())
    for _ in range(3):
        replica.inner_step()
    for _ in range(2 * STALE_TRIES):  # fresh progress (staleness 0): a discarded round keeps it for the next
        sync.average(group, {})  # type: ignore[arg-type]
    assert replica.round_steps == 3

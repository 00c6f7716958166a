"""Validate before adopting: a certified state offered by others must also be a state worth training from.

A certificate proves that enough admitted peers signed a state, not that the state is any good: identities can be
cheap, and a few of them can sign a fabricated θ (a rescaled copy of ours, a model trained on something else).
So before a peer adopts a state it did not compute itself (a join, a re-sync after a missed certificate, a fork
switch) it checks the state against its own:
  - every value is finite;
  - its loss on held-out batches that this peer drew with a private seed is at most (1 + tolerance) × the loss of
    the state the peer holds (a joiner holds θ_0, so any trained state passes and a broken one does not). Nobody
    knows those batches, so nobody can fit a state to them;
  - when the state claims to be the round right after ours (its certificate names our state as its parent), its
    distance from ours is at most `step_factor` × the longest outer step we applied lately: one honest round moves
    the state by about one such step. Further ahead, or on another fork, the distance has no bound we could check,
    and the loss check alone applies.
A state that fails is refused and its claimants distrusted (peer/swarm_sync.py, `Chain.refuse`).
"""
from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass

import torch

from swarmloco.peer.config import AdoptConfig
from swarmloco.peer.replica import Replica
from swarmloco.peer.swarm_state import all_finite
from swarmloco.peer.task import Batch, mean_loss

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    problem: str  # "" when the state may be adopted
    own_loss: float
    new_loss: float
    distance: float  # ‖θ_new − θ_ours‖; NaN when not measured


class AdoptionCheck:
    """This peer's judge of offered states: its private held-out batches and its record of recent outer steps."""

    def __init__(self, replica: Replica, cfg: AdoptConfig, *, seed: int | None = None) -> None:
        self.replica, self.cfg = replica, cfg
        task = replica.task
        # A seed of our own, never published: the batches a state is judged on cannot be known in advance.
        self.batches: list[Batch] | None = task.probe(secrets.randbits(62) if seed is None else seed) \
            if task.probe is not None else None

    def loss(self, params: dict[str, torch.Tensor]) -> float:
        """The held-out loss of a global state, in a scratch model (the replica's own model is left alone)."""
        task, scratch = self.replica.task, self.replica.scratch_model(params)
        if self.batches is None:
            return task.evaluate(scratch)
        return mean_loss(scratch, self.batches, task.loss_fn)

    def verdict(self, params: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor], *,
                next_round: bool) -> Verdict:
        """Whether to adopt the global state (params, momentum). `next_round`: its certificate names the state we
        hold as its parent, so one outer step separates the two."""
        nan = float("nan")
        if not all_finite(params, momentum):
            return Verdict("it holds non-finite values", nan, nan, nan)
        ours = self.replica.global_params
        distance = nan
        steps = self.replica.outer_steps
        if next_round and self.cfg.step_factor and steps and max(steps) > 0:
            distance = math.sqrt(sum(float(torch.linalg.vector_norm(params[n] - ours[n])) ** 2 for n in ours))
            bound = self.cfg.step_factor * max(steps)
            if distance > bound:
                return Verdict(f"it lies {distance:.4g} from our state, one round back; our outer steps were at most "
                               f"{max(steps):.4g} (bound {bound:.4g})", nan, nan, distance)
        own, new = self.loss(ours), self.loss(params)
        if not math.isfinite(new) or new > own + self.cfg.tolerance * abs(own):
            return Verdict(f"its held-out loss {new:.4f} is worse than our state's {own:.4f} by more than "
                           f"{self.cfg.tolerance:.0%}", own, new, distance)
        return Verdict("", own, new, distance)

"""Solo training: M = 1 DiLoCo. Each round's budget of inner steps ends with an outer Nesterov step on the peer's own
pseudo-gradient; no network."""
from __future__ import annotations

from typing import Any

from swarmloco.peer.config import PeerConfig
from swarmloco.peer.replica import Replica
from swarmloco.peer.signals import StopFlag
from swarmloco.peer.training import TrainingLoop, harness_hooks


class SoloSync:
    mode = "solo"

    def start(self, loop: TrainingLoop) -> None:
        pass

    def round(self, loop: TrainingLoop) -> None:
        r = loop.replica
        _, spent = loop.train_round()
        if not spent:
            return  # stopped mid-round: the partial progress stays local (and in the checkpoint)
        r.apply_outer(r.pseudo_gradient())
        entry = loop.after_round({"round": r.round, "step": r.step, "state_hash": r.state_hash()})
        loop.progress.event("round", **entry)

    def finish(self, loop: TrainingLoop) -> None:
        pass

    def summary(self, loop: TrainingLoop) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def run_solo(replica: Replica, cfg: PeerConfig, *, stop: StopFlag | None = None) -> dict[str, Any]:
    """Train until max_steps/max_rounds or a stop request; returns the run summary."""
    return TrainingLoop(replica, cfg, stop if stop is not None else StopFlag(), hooks=harness_hooks()).run(SoloSync())

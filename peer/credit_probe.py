"""The credit probe: the loss gradient at θ_r on held-out batches that a round's audit seed picks.

Every member of a round computes it once the round's contributions and results are fixed and signed, so nobody
could tune a Δ to the batches it is judged on; the round credits each contribution by the loss decrease it causes
to first order, <g, Δ> (`swarmloco.protocol.round.credit`). Members compare each other's numbers, so the gradient
is taken in float32 without autocast, in eval mode (no dropout): two devices then differ by float rounding only.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn

from swarmloco.peer.replica import Replica
from swarmloco.peer.swarm_state import flatten

_DOMAIN = b"swarmloco-credit-probe-v1\n"


def credit_probe(replica: Replica) -> CreditProbe | None:
    """The probe for this replica's task, or None when the task has no probe batches (its rounds credit the
    weights unscored)."""
    return CreditProbe(replica) if replica.task.probe is not None else None


class CreditProbe:
    """Callable with an audit seed; returns g flat in the replica's parameter order, on the CPU. One scratch model
    is kept and reloaded with θ_r on each call; the replica's own model, with its local progress, is left alone."""

    def __init__(self, replica: Replica) -> None:
        if replica.task.probe is None:
            raise ValueError("the task has no probe batches (Task.probe): its contributions cannot be scored")
        self.replica = replica
        self._model: nn.Module | None = None

    @staticmethod
    def batch_seed(seed: bytes) -> int:
        return int.from_bytes(hashlib.sha256(_DOMAIN + seed).digest()[:8], "little") >> 1

    def __call__(self, seed: bytes) -> torch.Tensor:
        r = self.replica
        assert r.task.probe is not None
        batches = [tuple(t.to(r.device) for t in b) for b in r.task.probe(self.batch_seed(seed))]
        if not batches:
            raise ValueError("the task's probe gave no batches")
        model = self._scratch()
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type=r.device.type, enabled=False):
            loss = sum(r.task.loss_fn(model, b) for b in batches) / len(batches)
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
        return flatten(grads, r.names).cpu()

    def _scratch(self) -> nn.Module:
        r = self.replica
        if self._model is None:
            self._model = r.task.model_factory().to(r.device).eval()
        with torch.no_grad():
            for name, p in self._model.named_parameters():
                p.copy_(r.global_params[name].to(p.device, torch.float32))
        return self._model

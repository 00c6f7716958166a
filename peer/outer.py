"""The DiLoCo outer step: Nesterov SGD applied to the global parameters with an averaged pseudo-gradient.

Kept pure (tensors in, tensors mutated in place, nothing else) so that every peer, whatever its hardware, runs the
same float operations on CPU fp32 tensors and ends with bit-identical θ and momentum.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from swarmloco.peer.outer_config import OuterConfig


@torch.no_grad()
def pseudo_gradient(
    global_params: Mapping[str, torch.Tensor], local_params: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Δ = θ_global − θ_local, as fp32 CPU tensors."""
    return {name: g - local_params[name].detach().to("cpu", torch.float32) for name, g in global_params.items()}


@torch.no_grad()
def outer_step(
    params: Mapping[str, torch.Tensor],
    delta: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    config: OuterConfig,
) -> float:
    """Apply one outer step in place, matching torch.optim.SGD(nesterov=True, dampening=0) with Δ as the gradient;
    returns the step's length ‖θ_new − θ_old‖.

    m ← μ·m + Δ;  update = Δ + μ·m (Nesterov) or m;  θ ← θ − lr·update.
    """
    if params.keys() != delta.keys() or params.keys() != momentum.keys():
        raise ValueError("outer_step: params, delta and momentum must have the same tensor names")
    squares = 0.0
    for name, theta in params.items():
        d, m = delta[name], momentum[name]
        if d.shape != theta.shape or m.shape != theta.shape:
            raise ValueError(f"outer_step: shape mismatch for {name}: θ {tuple(theta.shape)}, Δ {tuple(d.shape)}")
        m.mul_(config.momentum).add_(d)
        update = d.add(m, alpha=config.momentum) if config.nesterov else m
        theta.sub_(update, alpha=config.lr)
        squares += float(torch.linalg.vector_norm(update)) ** 2
    return config.lr * squares**0.5

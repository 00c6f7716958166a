"""The peer's credit probe on the real default task: g is the loss gradient at θ_r (not at the local replica), the
same for the same seed, other batches for another seed, and it separates an honest Δ from a zero or random one."""
from __future__ import annotations

from pathlib import Path

import torch

from swarmloco.peer.cli import build_replica
from swarmloco.peer.config import PeerConfig, RunConfig, RuntimeConfig, TrainConfig
from swarmloco.peer.credit_probe import CreditProbe, credit_probe
from swarmloco.peer.outer_config import OuterConfig
from swarmloco.peer.swarm_state import flatten


def _replica(workdir: Path):  # type: ignore[no-untyped-def]
    cfg = PeerConfig(run=RunConfig(preset="tiny", solo=True, max_steps=0, workdir=str(workdir), checkpoint_every=0),
                     train=TrainConfig(inner_steps=8, warmup_steps=2, batch_size=4), outer=OuterConfig(),
                     runtime=RuntimeConfig(device="cpu", seed=3))
    return build_replica(cfg)


def test_the_probe_scores_an_honest_delta_above_a_zero_or_random_one(tmp_path: Path) -> None:
    replica = _replica(tmp_path)
    probe = credit_probe(replica)
    assert isinstance(probe, CreditProbe)
    before = probe(b"seed-1")
    for _ in range(12):
        replica.inner_step()
    g = probe(b"seed-1")
    # θ_r did not move: the local steps are not what the probe differentiates
    assert torch.equal(g, before) and g.shape == before.shape and g.dtype == torch.float32
    assert not torch.equal(probe(b"seed-2"), g)  # another seed draws other batches
    honest = flatten(replica.pseudo_gradient(), replica.names)
    noise = torch.randn(honest.shape, generator=torch.Generator().manual_seed(0)) * honest.norm() / honest.numel()**0.5
    assert float(g @ torch.zeros_like(honest)) == 0.0
    # Δ = θ_r − θ_local and the outer step moves θ along −Δ: a Δ that lowers the loss has <g, Δ> > 0
    assert float(g @ honest) > 10 * abs(float(g @ noise)) > 0

"""The model a peer config builds, named as a run manifest names it: the task's name and the model fingerprint.

Peers announce the fingerprint in their DHT records and average only with peers that announce the same one
(`swarmloco.protocol.round.rules.compatible`). It hashes the task's config, the run's seed and every parameter's name
and shape, so `expected_model` builds the task as the peer does (`task_context`) and its model on the meta device:
the shapes without the memory or the initialisation. A coordinator computes the same from its --run-config and
serves it in the manifest; a peer that joins compares it with its own (`swarmloco.peer.join.check_model`).

Importing this module loads no torch: only `expected_model` does.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarmloco.peer.config import PeerConfig

if TYPE_CHECKING:
    from swarmloco.peer.task import TaskContext


@dataclass(frozen=True, kw_only=True)
class RunModel:
    task: str  # the task's name (swarmloco.peer.task.Task.name)
    fingerprint: str  # the model fingerprint its peers announce


def fingerprint_config(task_config: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """The config a peer announces and hashes into its fingerprint: the task's, with the seed of θ_0, as JSON has it."""
    config = {**dict(task_config), "seed": seed}
    return json.loads(json.dumps(config, sort_keys=True, default=str))  # type: ignore[no-any-return]


def task_context(cfg: PeerConfig, *, data_seed: int = 0) -> TaskContext:
    """The TaskContext a peer with `cfg` gives its task (a shard index still 'auto' reads as 0: the model does not
    depend on the shard)."""
    from swarmloco.peer.data import ShardSpec
    from swarmloco.peer.task import TaskContext

    run = cfg.run
    return TaskContext(shard=ShardSpec(index=run.shard_index or 0, count=run.num_shards), seed=cfg.runtime.seed,
                       data_seed=data_seed, preset=run.preset, batch_size=cfg.train.batch_size or None)


def expected_model(cfg: PeerConfig) -> RunModel:
    """The task and fingerprint a peer with `cfg` will have. Raises what loading the task raises (TaskError, a
    ConfigError, for a plug-in that cannot be loaded)."""
    import torch

    from swarmloco.peer.task import load_task
    from swarmloco.protocol.base.records import fingerprint

    task = load_task(cfg.run.task, task_context(cfg))
    try:
        with torch.device("meta"):
            model = task.model_factory()
    except Exception:  # a plug-in's model that cannot be built without memory (it loads weights): build it for real
        model = task.model_factory()
    layout = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    return RunModel(task=task.name, fingerprint=fingerprint(fingerprint_config(task.config, cfg.runtime.seed), layout))

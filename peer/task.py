"""What a peer trains: the `Task` interface, the default byte-level GPT task, and `module:factory` plug-ins.

A task bundles a model factory, a deterministic train-batch iterator, a loss and an eval function. Anything that
fits this shape can be trained by the swarm; see README "Bring your own model".
"""
from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarmloco.peer import data as corpus
from swarmloco.peer.config import ConfigError
from swarmloco.peer.model import GPT, PRESETS
from swarmloco.peer.presets import DEFAULT_TASK, default_task_name

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True, kw_only=True)
class TaskContext:
    """What the peer tells a task factory about itself."""

    shard: corpus.ShardSpec = field(default_factory=corpus.ShardSpec)
    seed: int = 0  # model init: must match across the swarm
    data_seed: int = 0  # data order: differs per peer so replicas never train on identical batches
    preset: str = "tiny"
    batch_size: int | None = None


@dataclass(kw_only=True)
class Task:
    """A trainable job.

    `train_batches(start_step)` must yield the same batches for the same start step (exact resume relies on it);
    `loss_fn(model, batch)` returns a scalar; `evaluate(model)` returns the held-out loss; `config` describes the
    model and feeds its fingerprint, which peers compare before averaging. `probe(seed)`, if given, returns a few
    held-out batches drawn by `seed`: a peer checks every state it is offered on batches of its own choosing
    (peer/adoption.py), so nobody can tune a state to the batches it will be judged on. Without it, that check uses
    `evaluate`.
    """

    name: str
    model_factory: Callable[[], nn.Module]
    train_batches: Callable[[int], Iterator[Batch]]
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor]
    evaluate: Callable[[nn.Module], float]
    config: Mapping[str, Any]
    probe: Callable[[int], list[Batch]] | None = None

    @staticmethod
    def tokens_in(batch: Batch) -> int:
        return int(batch[0].numel())


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def mean_loss(model: nn.Module, batches: list[Batch], loss_fn: Callable[[nn.Module, Batch], torch.Tensor]) -> float:
    """Average loss over fixed batches, on the model's device, in eval mode."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for batch in batches:
            moved = tuple(t.to(device) for t in batch)
            with autocast_for(device):
                total += float(loss_fn(model, moved))
        return total / max(len(batches), 1)
    finally:
        model.train(was_training)


def autocast_for(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA; a disabled context elsewhere (CPU runs in fp32 for exactness)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


DEFAULT_BATCH = {"nano": 16, "tiny": 16, "small": 16, "base": 8}


def default_task(ctx: TaskContext) -> Task:
    """Byte-level GPT on the Python standard library (real text every machine has; nothing to download)."""
    if ctx.preset not in PRESETS:
        raise ValueError(f"preset: got {ctx.preset!r}, allowed {', '.join(PRESETS)}")
    cfg = PRESETS[ctx.preset]
    batch_size = ctx.batch_size or DEFAULT_BATCH[ctx.preset]
    root = corpus.stdlib_root()
    train_files, eval_files = corpus.split_files(corpus.list_source_files(root), ctx.shard)
    train_data = corpus.load_bytes(root, train_files)
    eval_data = corpus.load_bytes(root, eval_files, max_bytes=4 << 20)
    fixed_eval = corpus.eval_batches(eval_data, n_batches=8, batch_size=16, seq_len=cfg.context)
    logger.info(
        "default task: preset %s, shard %d/%d: %d train files (%.1f MB), %d eval files",
        ctx.preset, ctx.shard.index, ctx.shard.count, len(train_files), train_data.numel() / 1e6, len(eval_files),
    )

    def train_batches(start_step: int) -> Iterator[Batch]:
        step = start_step
        while True:
            yield corpus.sample_batch(
                train_data, batch_size=batch_size, seq_len=cfg.context, seed=ctx.seed * 1_000_003 + ctx.data_seed,
                shard_index=ctx.shard.index, step=step,
            )
            step += 1

    def model_factory() -> nn.Module:
        torch.manual_seed(ctx.seed)  # identical initial θ on every peer
        return GPT(cfg)

    return Task(
        name=default_task_name(ctx.preset),
        model_factory=model_factory,
        train_batches=train_batches,
        loss_fn=lm_loss,
        evaluate=lambda model: mean_loss(model, fixed_eval, lm_loss),
        probe=lambda seed: corpus.probe_batches(eval_data, n_batches=4, batch_size=8, seq_len=cfg.context, seed=seed),
        # what defines the model, and so its fingerprint: the batch size is each peer's own (peers with different
        # batch sizes average together, weighted by tokens), so it stays out
        config={"task": DEFAULT_TASK, **cfg.to_dict()},
    )


class TaskError(ConfigError):
    """--task names nothing loadable; the message says what to fix."""


def _import_task_module(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name != module_name and not module_name.startswith(exc.name + "."):
            raise TaskError(f"task: importing {module_name!r} failed: it needs {exc.name!r}, which is not "
                            "installed in this environment") from None
        path = Path(*module_name.split("."))
        here = path.with_suffix(".py").exists() or (path / "__init__.py").exists()
        hint = ("it is in the current directory, which the swarmloco command does not search: run with "
                "PYTHONPATH=. (or PYTHONPATH=DIR for a module in DIR)") if here else \
            f"is its directory on PYTHONPATH ({os.environ.get('PYTHONPATH') or 'unset'})?"
        raise TaskError(f"task: no module named {module_name!r}; {hint}") from None
    except SyntaxError as exc:
        raise TaskError(f"task: {exc.filename}:{exc.lineno}: syntax error: {exc.msg}") from None


def load_task(spec: str | None, ctx: TaskContext) -> Task:
    """`None` → the default task; `"package.module:factory"` → factory(ctx), which must return a Task."""
    if spec is None:
        return default_task(ctx)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"task: got {spec!r}, allowed 'package.module:factory' (a module, a colon, the name of a "
                        "function in it that returns a swarmloco.peer.task.Task)")
    module = _import_task_module(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise TaskError(f"task: {module_name!r} ({getattr(module, '__file__', '?')}) has no function {attr!r}; "
                        f"it defines: {', '.join(found) or 'no functions'}")
    task = factory(ctx)
    if not isinstance(task, Task):
        raise TaskError(f"task: {spec} returned {type(task).__name__}, expected swarmloco.peer.task.Task")
    return task

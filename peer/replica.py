"""One peer's replica: the local model with its inner AdamW, plus the global DiLoCo state it started the round from.

Global state (θ_r, outer momentum m_r, round r) lives on CPU in fp32 so that the outer step and the state hash are
bit-identical on every peer whatever its accelerator. The local model lives on the training device.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from swarmloco.peer.config import RuntimeConfig, TrainConfig
from swarmloco.peer.outer import outer_step, pseudo_gradient
from swarmloco.peer.outer_config import OuterConfig
from swarmloco.peer.task import Batch, Task, autocast_for
from swarmloco.protocol.base.hashing import state_hash

logger = logging.getLogger(__name__)


@dataclass
class Snapshot:
    global_params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    local: dict[str, torch.Tensor]
    round: int
    round_steps: int
    round_tokens: int


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available; use --device cpu or auto")
    return device


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up then optional cosine decay, as a function of the *global* step."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if not cfg.decay_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.decay_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class StepResult:
    loss: float
    tokens: int
    seconds: float
    lr: float


class Replica:
    """Local training state and the global state of the current round."""

    def __init__(self, task: Task, train: TrainConfig, outer: OuterConfig, runtime: RuntimeConfig) -> None:
        self.task, self.train_cfg, self.outer_cfg = task, train, outer
        self.device = pick_device(runtime.device)
        if runtime.threads:
            torch.set_num_threads(runtime.threads)
        self.model: nn.Module = task.model_factory().to(self.device)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.global_params = {n: p.detach().to("cpu", torch.float32).clone() for n, p in self.model.named_parameters()}
        self.momentum = {n: torch.zeros_like(p) for n, p in self.global_params.items()}
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train.lr, betas=(train.beta1, train.beta2), weight_decay=train.weight_decay
        )
        self.round = 0  # index of the global state θ_r this replica trains from
        self.step = 0  # inner steps taken by this replica (drives the data order)
        self.round_steps = 0  # inner steps taken since θ_r
        self.round_tokens = 0
        self.tokens = 0  # tokens this replica trained on, all rounds
        self._batches: Iterator[Batch] | None = None
        # ‖θ_{r+1} − θ_r‖ of the last outer steps this replica applied: how far one honest round moves the state
        self.outer_steps: deque[float] = deque(maxlen=16)

    # --- inner training -------------------------------------------------------------------------------------------
    def schedule_step(self) -> int:
        """The global step that keys the learning rate: same for every peer at the same point of the same round."""
        return self.round * self.train_cfg.inner_steps + self.round_steps

    def inner_step(self) -> StepResult:
        if self._batches is None:
            self._batches = self.task.train_batches(self.step)
        start = time.perf_counter()
        batch = tuple(t.to(self.device, non_blocking=True) for t in next(self._batches))
        lr = lr_at(self.schedule_step(), self.train_cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        with autocast_for(self.device):
            loss = self.task.loss_fn(self.model, batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"inner loss became {loss.item()} at step {self.step}; lower --inner-lr")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.train_cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_cfg.grad_clip)
        self.optimizer.step()
        tokens = self.task.tokens_in(batch)
        self.step += 1
        self.round_steps += 1
        self.round_tokens += tokens
        self.tokens += tokens
        return StepResult(loss=float(loss.detach()), tokens=tokens, seconds=time.perf_counter() - start, lr=lr)

    # --- outer step -----------------------------------------------------------------------------------------------
    def local_params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def pseudo_gradient(self) -> dict[str, torch.Tensor]:
        return pseudo_gradient(self.global_params, self.local_params())

    def apply_outer(self, delta: dict[str, torch.Tensor], *, new_round: int | None = None) -> None:
        """θ_{r+1} = Nesterov(θ_r, Δ); the local model restarts from it."""
        self.outer_steps.append(outer_step(self.global_params, delta, self.momentum, self.outer_cfg))
        self.round = self.round + 1 if new_round is None else new_round
        self.reset_local()

    def snapshot(self) -> Snapshot:
        """Copies of everything an outer step changes, so that an uncertified round can be undone exactly."""
        with torch.no_grad():
            local = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        return Snapshot(
            global_params={n: t.clone() for n, t in self.global_params.items()},
            momentum={n: t.clone() for n, t in self.momentum.items()},
            local=local, round=self.round, round_steps=self.round_steps, round_tokens=self.round_tokens,
        )

    def restore(self, snap: Snapshot) -> None:
        """Back to the snapshot: θ_r and m_r, and the local replica with the progress it had made since θ_r."""
        self.global_params, self.momentum = snap.global_params, snap.momentum
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(snap.local[name])
        self.round, self.round_steps, self.round_tokens = snap.round, snap.round_steps, snap.round_tokens

    def reset_local(self) -> None:
        """Local parameters ← θ_r; inner AdamW state is kept (DiLoCo never averages it)."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(self.global_params[name].to(p.device, p.dtype))
        self.round_steps = 0
        self.round_tokens = 0

    def load_global(
        self, params: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor], round_number: int, *, keep_local: bool
    ) -> None:
        """Adopt a verified global state (joiner, behind peer, or re-sync after a hash mismatch)."""
        if set(params) != set(self.global_params) or set(momentum) != set(self.global_params):
            raise ValueError("global state does not match this model's parameter names")
        self.global_params = {n: params[n].to("cpu", torch.float32).clone() for n in self.names}
        self.momentum = {n: momentum[n].to("cpu", torch.float32).clone() for n in self.names}
        self.round = round_number
        if not keep_local:
            self.reset_local()

    def state_hash(self) -> str:
        return state_hash(self.global_params, self.momentum)

    def scratch_model(self, params: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """A fresh copy of the model holding `params` (default: θ_r), for evaluation; the replica's own model, with
        its local progress, is left alone."""
        scratch = self.task.model_factory().to(self.device)
        with torch.no_grad():
            for name, p in scratch.named_parameters():
                p.copy_((self.global_params if params is None else params)[name].to(p.device, p.dtype))
        return scratch

    def evaluate_global(self) -> float:
        """Eval loss of θ_r (not of the local replica)."""
        return self.task.evaluate(self.scratch_model())

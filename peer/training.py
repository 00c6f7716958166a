"""One training loop for every mode: inner steps until the round's budget is spent, then a sync strategy ends it.

Solo training (M = 1 DiLoCo) ends a round by applying the peer's own pseudo-gradient (`swarmloco.peer.solo`); a swarm
peer by averaging it with other peers' (`swarmloco.peer.swarm_sync`). Everything else lives here once: the budget and
the stop conditions, the slowdown used to emulate slower hardware, evaluation and checkpoints after a round, the final
checkpoint and the run summary.
"""
from __future__ import annotations

import collections
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

from swarmloco.peer import checkpoint
from swarmloco.peer.config import PeerConfig
from swarmloco.peer.memory import release_free_memory
from swarmloco.peer.progress import Progress, round_float
from swarmloco.peer.replica import Replica
from swarmloco.peer.signals import StopFlag
from swarmloco.protocol.base.hooks import Hooks

logger = logging.getLogger(__name__)
FAULTS_ENV = "SWARMLOCO_FAULTS"


def harness_hooks() -> Hooks:
    """The no-op hooks; or, when a test harness set SWARMLOCO_FAULTS, its fault injector (never loaded otherwise)."""
    if not os.environ.get(FAULTS_ENV):
        return Hooks()
    from swarmloco.protocol.testing.faults import FaultInjector

    return FaultInjector.from_env()


def slowdown_sleep(seconds: float, recent: collections.deque[float], slowdown: float) -> float:
    """How long to sleep after a step of `seconds` to emulate hardware `slowdown` times slower: (slowdown - 1) times
    the step, but never more than twice the median of the recent steps (`recent`, which this appends to). A step that
    took far longer than its neighbours was not computing all that time (the process was stopped, or the machine
    suspended), and slower hardware would not have been slower by that much."""
    recent.append(seconds)
    return (slowdown - 1) * min(seconds, 2 * statistics.median(recent))


class Sync(Protocol):
    """How a round ends. `start` runs once the replica is loaded; `round` trains one round through the loop and
    syncs it; `finish` runs after the last round; `summary` adds mode-specific fields; `close` always runs."""

    mode: str

    def start(self, loop: TrainingLoop) -> None: ...

    def round(self, loop: TrainingLoop) -> None: ...

    def finish(self, loop: TrainingLoop) -> None: ...

    def summary(self, loop: TrainingLoop) -> dict[str, Any]: ...

    def close(self) -> None: ...


class TrainingLoop:
    def __init__(self, replica: Replica, cfg: PeerConfig, stop: StopFlag, *, hooks: Hooks | None = None) -> None:
        self.replica, self.cfg, self.stop = replica, cfg, stop
        self.hooks = hooks or Hooks()
        self.progress = Progress(
            log_format=cfg.run.log_format, total_steps=cfg.run.max_steps or None, initial_step=replica.step
        )
        self.hooks.observe(self._fault_fired)
        self.history: list[dict[str, Any]] = []
        self.compute_s = 0.0
        self.recent_steps: collections.deque[float] = collections.deque(maxlen=16)  # seconds, for the slowdown
        self.step_times: collections.deque[float] = collections.deque(maxlen=16)  # whole steps, slowdown included
        self.tokens_per_step = 0.0  # of the last step
        self.initial_eval = 0.0
        self.on_step: Callable[[float], None] | None = None  # the swarm's coordinator reports
        self.checkpoint_dir = f"{cfg.run.workdir}/checkpoint"
        self.resumed: dict[str, Any] = {}  # the checkpoint's sidecar when resuming
        self.checkpoint_extra: dict[str, Any] = {}  # what the sync strategy keeps in the checkpoint (certificate)

    def _fault_fired(self, phase: str, action: str, round_number: int) -> None:
        self.progress.event("fault", phase=phase, action=action, round=round_number)

    # --- when a round, and the run, are over ----------------------------------------------------------------------
    def steps_exhausted(self) -> bool:
        """Stop requested or --max-steps reached: no more inner steps, even mid-round."""
        return bool(self.stop) or bool(self.cfg.run.max_steps and self.replica.step >= self.cfg.run.max_steps)

    def done(self) -> bool:
        """The run is over: no more steps, or --max-rounds rounds reached."""
        max_rounds = self.cfg.run.max_rounds
        return self.steps_exhausted() or bool(max_rounds and self.replica.round >= max_rounds)

    def budget_spent(self, round_started: float) -> bool:
        r, budget = self.replica, self.cfg.budget
        if budget.round_tokens:
            return r.round_tokens >= budget.round_tokens
        if budget.round_seconds:
            return time.monotonic() - round_started >= budget.round_seconds and r.round_steps > 0
        return r.round_steps >= self.cfg.train.inner_steps

    def step_seconds(self) -> float:
        """How long a step takes: the median of the recent ones (0 before the first)."""
        recent = tuple(self.step_times)  # one C-level copy: the network loop reads it while training appends
        return statistics.median(recent) if recent else 0.0

    def eta(self, round_started: float) -> float:
        """Unix time this peer expects to have spent its budget, from its own measured step times. Thread-safe: the
        network loop publishes it while the training thread trains."""
        r, budget = self.replica, self.cfg.budget
        steps, tokens = r.round_steps, r.round_tokens
        if budget.round_seconds:
            return time.time() + max(0.0, budget.round_seconds - (time.monotonic() - round_started))
        if steps:
            per_step, tokens_per_step = (time.monotonic() - round_started) / steps, tokens / steps
        elif self.step_times:  # a round's first step: the steps of the rounds before tell
            per_step, tokens_per_step = self.step_seconds(), self.tokens_per_step
        else:
            return time.time() + 60
        if budget.round_tokens:
            remaining = max(0, budget.round_tokens - tokens) / max(1.0, tokens_per_step)
        else:
            remaining = max(0, self.cfg.train.inner_steps - steps)
        return time.time() + remaining * per_step

    # --- training -------------------------------------------------------------------------------------------------
    def train_step(self) -> None:
        self.hooks.inner_step(self.replica.round)
        started = time.perf_counter()
        result = self.replica.inner_step()
        if self.cfg.run.slowdown > 1:
            time.sleep(slowdown_sleep(result.seconds, self.recent_steps, self.cfg.run.slowdown))
        took = time.perf_counter() - started
        self.compute_s += took
        self.step_times.append(took)
        self.tokens_per_step = float(result.tokens)
        self.progress.step(
            step=self.replica.step, round=self.replica.round, loss=result.loss, tokens=result.tokens, lr=result.lr
        )
        if self.on_step is not None:
            self.on_step(result.loss)

    def train_round(self, *, stop_early: Callable[[float], bool] | None = None) -> tuple[float, bool]:
        """Inner steps from θ_r until the budget is spent, the run is done, or `stop_early(round_started)` says so
        (checked after each step, so at least one is taken). Returns (seconds, whether the budget was spent)."""
        started = time.monotonic()
        while not (spent := self.budget_spent(started)) and not self.done():
            self.train_step()
            if stop_early is not None and stop_early(started):
                break
        return time.monotonic() - started, spent

    def after_round(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Evaluate and checkpoint on schedule after θ_r advanced; the entry joins the run's history."""
        r, run = self.replica, self.cfg.run
        if r.round % run.eval_every == 0:
            entry["eval_loss"] = round_float(r.evaluate_global())
        self.history.append(entry)
        if run.checkpoint_every and r.round % run.checkpoint_every == 0:
            self.save_checkpoint()
        return entry

    def save_checkpoint(self) -> None:
        checkpoint.save(self.replica, self.checkpoint_dir,
                        extra={"initial_eval_loss": self.initial_eval, **self.checkpoint_extra})

    # --- the run --------------------------------------------------------------------------------------------------
    def run(self, sync: Sync) -> dict[str, Any]:
        r = self.replica
        try:
            meta = checkpoint.load(r, self.checkpoint_dir) if self.cfg.run.resume else {}
            self.resumed = meta
            if meta:
                logger.info("resumed from %s at step %d, round %d", self.checkpoint_dir, r.step, r.round)
            # θ_0 is the same on every fresh peer (same seed): this is the run's initial loss, measured before any
            # state is pulled from a swarm; a resumed peer keeps the value from its checkpoint.
            initial = meta.get("initial_eval_loss")
            self.initial_eval = float(initial) if initial is not None else r.evaluate_global()
            self.progress.event(
                "start",
                mode=sync.mode,
                step=r.step,
                round=r.round,
                eval_loss=round_float(self.initial_eval),
                device=str(r.device),
            )
            sync.start(self)
            started, start_tokens = time.perf_counter(), r.tokens
            try:
                while not self.done():
                    sync.round(self)
                    release_free_memory()  # what the round freed, back to the OS (`swarmloco.peer.memory`)
            finally:
                self.progress.close()
                self.save_checkpoint()
            wall = time.perf_counter() - started
            sync.finish(self)
            last = self.history[-1] if self.history else {}
            final_eval = (
                last["eval_loss"] if last.get("round") == r.round and "eval_loss" in last else r.evaluate_global()
            )
            summary = {
                "mode": sync.mode,
                "task": r.task.name,
                "initial_eval_loss": round_float(self.initial_eval),
                "final_eval_loss": round_float(final_eval),
                "steps": r.step,
                "rounds": r.round,
                "tokens": r.tokens,
                "tokens_per_s": round_float((r.tokens - start_tokens) / wall) if wall > 0 else 0.0,
                "wall_s": round_float(wall),
                "compute_s": round_float(self.compute_s),
                "state_hash": r.state_hash(),
                "stopped_early": bool(self.stop),
                "history": self.history,
                **sync.summary(self),
            }
            self.progress.event("done", **{k: v for k, v in summary.items() if k != "history"})
            return summary
        finally:
            sync.close()

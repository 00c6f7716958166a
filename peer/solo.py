"""Solo training: M = 1 DiLoCo (H inner steps, then an outer Nesterov step on the peer's own Δ), no network."""
from __future__ import annotations

import logging
import time
from typing import Any

from peer import checkpoint
from peer.progress import Progress, round_float
from peer.replica import Replica
from peer.signals import StopFlag

logger = logging.getLogger(__name__)


def run_solo(replica: Replica, cfg: dict[str, Any], *, stop: StopFlag | None = None) -> dict[str, Any]:
    """Train until max_steps/max_rounds or a stop request; returns the run summary."""
    run, train = cfg["run"], cfg["train"]
    stop = stop or StopFlag()
    ckpt_dir = f"{run.workdir}/checkpoint"
    meta: dict[str, Any] = {}
    if run.resume:
        meta = checkpoint.load(replica, ckpt_dir)
        logger.info("resumed from %s at step %d, round %d", ckpt_dir, replica.step, replica.round)
    initial_eval = meta.get("initial_eval_loss")
    if initial_eval is None:
        initial_eval = replica.evaluate_global()
    progress = Progress(log_format=run.log_format, total_steps=run.max_steps or None, initial_step=replica.step)
    progress.event("start", step=replica.step, round=replica.round, eval_loss=round_float(initial_eval), device=str(replica.device))
    started, start_tokens, eval_loss = time.perf_counter(), replica.tokens, initial_eval
    history: list[dict[str, Any]] = []

    def done() -> bool:
        return bool(stop) or (run.max_steps and replica.step >= run.max_steps) or (run.max_rounds and replica.round >= run.max_rounds)

    try:
        while not done():
            result = replica.inner_step()
            if run.slowdown > 1:
                time.sleep(result.seconds * (run.slowdown - 1))
            progress.step(step=replica.step, round=replica.round, loss=result.loss, tokens=result.tokens, lr=result.lr)
            if replica.round_steps < train.inner_steps:
                continue
            replica.apply_outer(replica.pseudo_gradient())
            record: dict[str, Any] = {"round": replica.round, "step": replica.step, "state_hash": replica.state_hash()}
            if replica.round % run.eval_every == 0:
                eval_loss = replica.evaluate_global()
                record["eval_loss"] = round_float(eval_loss)
            history.append(record)
            progress.event("round", **record)
            if run.checkpoint_every and replica.round % run.checkpoint_every == 0:
                checkpoint.save(replica, ckpt_dir, extra={"initial_eval_loss": initial_eval})
    finally:
        progress.close()
        checkpoint.save(replica, ckpt_dir, extra={"initial_eval_loss": initial_eval})
    if not history or history[-1].get("round") != replica.round or "eval_loss" not in history[-1]:
        eval_loss = replica.evaluate_global()
    elapsed = time.perf_counter() - started
    summary = {
        "mode": "solo",
        "task": replica.task.name,
        "initial_eval_loss": round_float(initial_eval),
        "final_eval_loss": round_float(eval_loss),
        "steps": replica.step,
        "rounds": replica.round,
        "tokens": replica.tokens,
        "tokens_per_s": round_float((replica.tokens - start_tokens) / elapsed) if elapsed > 0 else 0.0,
        "wall_s": round_float(elapsed),
        "state_hash": replica.state_hash(),
        "stopped_early": bool(stop),
        "history": history,
    }
    progress.event("done", **{k: v for k, v in summary.items() if k != "history"})
    return summary

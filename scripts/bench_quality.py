"""`bench quality`: eval loss of DiLoCo (M replicas, H inner steps) vs a data-parallel baseline at equal tokens.

Mode: **in-process simulation**. The M replicas of a round are the project's own `swarmloco.peer.replica.Replica`
objects in one process, each reading its own data shard; their pseudo-gradients are averaged with token weights and the
same outer Nesterov step is applied to all of them, which is exactly what a swarm round computes (without the network,
codecs, quorum or stragglers). Every replica's state hash is checked to be identical after each round.

The data-parallel baseline is one process with an M× larger batch on the whole training set, which is
mathematically the same as synchronous data-parallel training with averaged gradients across M workers.
A "solo" peer is M=1 DiLoCo at the baseline's batch (the scaling-laws paper's M=1 comparison). Warm-started runs
begin from the baseline's parameters after a short data-parallel phase (as in the DiLoCo paper), with a fresh inner
AdamW (its learning-rate warm-up restarts); their token count includes the warm-up.
Runs are independent jobs spread over worker processes with one torch thread each.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import logging
import math
import multiprocessing as mp
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scripts.bench_common import kill_processes, ratio, table, write_json

logger = logging.getLogger(__name__)

MODE = "in-process simulation (M Replica objects in one process; not the networked swarm)"


@dataclass(frozen=True, kw_only=True)
class QualityConfig:
    """Sizes shared by every run: per-replica batch, inner steps per replica, warm-up steps (data-parallel)."""

    preset: str = "tiny"
    replicas: int = 4
    batch: int = 4  # sequences per replica step; the baseline uses replicas × batch
    steps: int = 1000  # inner steps per replica (= baseline steps), so every run sees the same tokens
    warmup: int = 100  # data-parallel steps before warm-started DiLoCo
    inner_lr: float = 4e-4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 2 or self.batch < 1 or self.steps < 1:
            raise ValueError(
                f"quality: replicas {self.replicas} >= 2, batch {self.batch} >= 1, steps {self.steps} >= 1"
            )
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"quality: warmup {self.warmup} must be in [0, steps={self.steps})")


@dataclass(frozen=True, kw_only=True)
class Job:
    label: str
    kind: str  # "dp" or "diloco"
    replicas: int = 1
    inner_steps: int = 0  # H
    outer_lr: float = 0.0
    warm: bool = False


@dataclass(kw_only=True)
class Result:
    job: Job
    eval_loss: float
    train_loss: float
    tokens: int
    seconds: float
    rounds: int = 0
    trace: list[float] = field(default_factory=list)  # eval loss after each round


def plan_jobs(cfg: QualityConfig, hs: list[int], lrs: list[float], *, full_sweep: bool) -> list[Job]:
    """Baseline; M-replica DiLoCo for every H at the middle lr; the lr sweep at the middle H (scratch and warm);
    solo M=1 with the lr sweep from scratch and the middle lr warm. `full_sweep` crosses every H with every lr."""
    m, mid_h, mid_lr = cfg.replicas, hs[len(hs) // 2], (0.7 if 0.7 in lrs else lrs[len(lrs) // 2])
    jobs = [Job(label="data-parallel", kind="dp")]
    grid = (
        [(h, lr) for h in hs for lr in lrs]
        if full_sweep
        else [(h, mid_lr) for h in hs] + [(mid_h, lr) for lr in lrs if lr != mid_lr]
    )
    for h, lr in grid:
        jobs.append(Job(label=f"DiLoCo M={m} H={h} lr={lr}", kind="diloco", replicas=m, inner_steps=h, outer_lr=lr))
    if cfg.warmup:
        for lr in lrs:
            jobs.append(
                Job(
                    label=f"DiLoCo M={m} H={mid_h} lr={lr} +warm",
                    kind="diloco",
                    replicas=m,
                    inner_steps=mid_h,
                    outer_lr=lr,
                    warm=True,
                )
            )
    for lr in lrs:
        jobs.append(Job(label=f"solo M=1 H={mid_h} lr={lr}", kind="diloco", replicas=1, inner_steps=mid_h, outer_lr=lr))
    if cfg.warmup:
        jobs.append(
            Job(
                label=f"solo M=1 H={mid_h} lr={mid_lr} +warm",
                kind="diloco",
                replicas=1,
                inner_steps=mid_h,
                outer_lr=mid_lr,
                warm=True,
            )
        )
    return jobs


def _replica(cfg: QualityConfig, shard: int, shards: int, batch: int, inner_steps: int, outer_lr: float) -> Any:
    from swarmloco.peer.config import RuntimeConfig, TrainConfig
    from swarmloco.peer.data import ShardSpec
    from swarmloco.peer.outer_config import OuterConfig
    from swarmloco.peer.replica import Replica
    from swarmloco.peer.task import TaskContext, default_task

    task = default_task(
        TaskContext(shard=ShardSpec(index=shard, count=shards), seed=cfg.seed, preset=cfg.preset, batch_size=batch)
    )
    train = TrainConfig(lr=cfg.inner_lr, inner_steps=inner_steps)
    return Replica(
        task, train, OuterConfig(lr=outer_lr if outer_lr > 0 else 0.7), RuntimeConfig(device="cpu", seed=cfg.seed)
    )


def warmup_state(cfg: QualityConfig, path: Path) -> None:
    """Run the baseline's first `warmup` steps and save its parameters (the same steps the baseline itself takes)."""
    import torch

    rep = _replica(cfg, 0, 1, cfg.batch * cfg.replicas, cfg.steps, 0.0)
    for _ in range(cfg.warmup):
        rep.inner_step()
    torch.save({n: p.detach().clone() for n, p in rep.model.named_parameters()}, path)


def run_job(cfg: QualityConfig, job: Job, warm_path: str | None) -> Result:
    """One run, in a worker process with one torch thread."""
    import torch

    torch.set_num_threads(1)
    start = time.perf_counter()
    big = cfg.batch * cfg.replicas
    if job.kind == "dp":
        rep = _replica(cfg, 0, 1, big, cfg.steps, 0.0)
        losses = [rep.inner_step().loss for _ in range(cfg.steps)]
        return Result(
            job=job,
            eval_loss=rep.task.evaluate(rep.model),
            train_loss=_tail(losses),
            tokens=rep.tokens,
            seconds=time.perf_counter() - start,
        )
    # DiLoCo: M=1 uses the baseline's batch on all data; M>1 uses one shard and the per-replica batch each.
    batch = big if job.replicas == 1 else cfg.batch
    reps = [_replica(cfg, i, job.replicas, batch, job.inner_steps, job.outer_lr) for i in range(job.replicas)]
    steps, warm_tokens = cfg.steps, 0
    if job.warm:
        assert warm_path is not None
        params = torch.load(warm_path)
        zeros = {n: torch.zeros_like(p) for n, p in params.items()}
        for rep in reps:
            rep.load_global(params, zeros, 0, keep_local=False)
        steps -= cfg.warmup
        warm_tokens = cfg.warmup * big * reps[0].task.config["context"]
    # Full rounds of H steps; a shorter last round keeps the token count equal to the baseline's.
    lengths = [job.inner_steps] * (steps // job.inner_steps) + (
        [steps % job.inner_steps] if steps % job.inner_steps else []
    )
    rounds = len(lengths)
    trace: list[float] = []
    losses = []
    for length in lengths:
        for rep in reps:
            losses.extend(rep.inner_step().loss for _ in range(length))
        total = sum(rep.round_tokens for rep in reps)
        deltas = [(rep.round_tokens / total, rep.pseudo_gradient()) for rep in reps]
        avg = {n: sum(w * d[n] for w, d in deltas) for n in deltas[0][1]}
        for rep in reps:
            rep.apply_outer(avg)
        hashes = {rep.state_hash() for rep in reps}
        if len(hashes) != 1:
            raise RuntimeError(
                f"{job.label}: replicas diverged after round {reps[0].round}: {len(hashes)} state hashes"
            )
        trace.append(reps[0].evaluate_global())
    tokens = warm_tokens + sum(rep.tokens for rep in reps)
    return Result(
        job=job,
        eval_loss=trace[-1],
        train_loss=_tail(losses),
        tokens=tokens,
        seconds=time.perf_counter() - start,
        rounds=rounds,
        trace=trace,
    )


def _tail(losses: list[float], n: int = 50) -> float:
    tail = losses[-n:]
    return sum(tail) / max(len(tail), 1)


def run_all(cfg: QualityConfig, jobs: list[Job], workers: int, timeout: float) -> list[Result]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        warm_path = None
        if any(j.warm for j in jobs):
            warm_path = str(Path(tmp) / "warm.pt")
            warmup_state(cfg, Path(warm_path))
        pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
        try:
            futures = {pool.submit(run_job, cfg, job, warm_path): job for job in jobs}
            results = []
            for fut in cf.as_completed(futures, timeout=timeout):
                res = fut.result()
                logger.info("%s: eval %.4f in %.0f s", res.job.label, res.eval_loss, res.seconds)
                results.append(res)
        finally:
            procs = list(getattr(pool, "_processes", {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            kill_processes(procs)
    order = {j.label: i for i, j in enumerate(jobs)}
    return sorted(results, key=lambda r: order[r.job.label])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="model preset of the default task (tiny, small, base)")
    p.add_argument("--replicas", type=int, default=4, help="M: replicas for DiLoCo; the baseline uses an M× batch")
    p.add_argument("--batch", type=int, default=4, help="sequences per replica step (the baseline uses M× this)")
    p.add_argument("--steps", type=int, default=1000, help="inner steps per replica (= baseline steps); equal tokens")
    p.add_argument(
        "--warmup", type=int, default=100, help="data-parallel warm-up steps for warm-started runs (0 = none)"
    )
    p.add_argument("--inner-steps", type=int, nargs="+", default=[50, 100, 250], help="H values to try")
    p.add_argument("--outer-lr", type=float, nargs="+", default=[0.5, 0.7, 1.0], help="outer Nesterov lr values to try")
    p.add_argument("--inner-lr", type=float, default=4e-4, help="inner AdamW learning rate (project default 4e-4)")
    p.add_argument(
        "--seed", type=int, default=0, help="model init and data order seed (rerun with others to gauge noise)"
    )
    p.add_argument("--full-sweep", action="store_true", help="cross every H with every outer lr (slower)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (one torch thread each)")
    p.add_argument("--timeout", type=float, default=3600, help="give up after this many seconds")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        cfg = QualityConfig(
            preset=args.preset,
            replicas=args.replicas,
            batch=2,
            steps=20,
            warmup=5,
            inner_lr=args.inner_lr,
            seed=args.seed,
        )
        hs, lrs = [10], [0.7]
    else:
        cfg = QualityConfig(
            preset=args.preset,
            replicas=args.replicas,
            batch=args.batch,
            steps=args.steps,
            warmup=args.warmup,
            inner_lr=args.inner_lr,
            seed=args.seed,
        )
        hs, lrs = sorted(args.inner_steps), sorted(args.outer_lr)
    jobs = plan_jobs(cfg, hs, lrs, full_sweep=args.full_sweep)
    started = time.perf_counter()
    results = run_all(cfg, jobs, args.workers, args.timeout)
    wall = time.perf_counter() - started
    dp = next(r for r in results if r.job.kind == "dp")
    rows, runs = [], []
    for r in results:
        rel = ratio(r.eval_loss, dp.eval_loss)
        start = "dp warm-up" if r.job.warm else "scratch"
        rows.append(
            [
                r.job.label,
                r.job.replicas,
                r.job.inner_steps or "—",
                r.job.outer_lr or "—",
                start,
                r.rounds or "—",
                r.tokens,
                r.eval_loss,
                rel,
                r.seconds,
            ]
        )
        runs.append(
            {
                **asdict(r.job),
                "eval_loss": r.eval_loss,
                "train_loss": r.train_loss,
                "tokens": r.tokens,
                "rounds": r.rounds,
                "seconds": r.seconds,
                "ratio_to_dp": rel,
                "trace": r.trace,
            }
        )
    best = _best_lr(results)
    ctx_len = dp.tokens // max(cfg.steps * cfg.batch * cfg.replicas, 1)
    notes = [
        f"mode: {MODE}",
        (
            f"preset {cfg.preset}, context {ctx_len}; baseline = one process, batch {cfg.batch * cfg.replicas} "
            f"(= sync data-parallel over {cfg.replicas} workers of batch {cfg.batch}), {cfg.steps} steps, "
            f"inner AdamW lr {cfg.inner_lr}"
        ),
        f"seed {cfg.seed}; DiLoCo M={cfg.replicas}: batch {cfg.batch} per replica, own shard each, "
        "token-weighted mean of Δ, Nesterov momentum 0.9",
        f"warm-started runs: {cfg.warmup} data-parallel steps first (tokens included); "
        "solo = M=1 at the baseline batch",
        "ratio = eval loss / data-parallel eval loss (lower is better; 1.00 = parity)",
        f"best outer lr (lowest eval loss, per group): {best}; total wall {wall:.0f} s with {args.workers} workers",
    ]
    print(
        table(
            "quality: eval loss at equal tokens",
            ["run", "M", "H", "outer lr", "start", "rounds", "tokens", "eval loss", "ratio to DP", "wall s"],
            rows,
            notes,
        )
    )
    write_json(
        args.json,
        {
            "benchmark": "quality",
            "mode": MODE,
            "quick": bool(args.quick),
            "config": asdict(cfg),
            "wall_s": wall,
            "dp_eval_loss": dp.eval_loss,
            "best_outer_lr": best,
            "runs": runs,
        },
    )
    return 0 if all(math.isfinite(r.eval_loss) for r in results) else 1


def _best_lr(results: list[Result]) -> dict[str, float]:
    groups: dict[str, list[Result]] = {}
    for r in results:
        if r.job.kind == "diloco":
            key = f"M={r.job.replicas} H={r.job.inner_steps} {'warm' if r.job.warm else 'scratch'}"
            groups.setdefault(key, []).append(r)
    return {k: min(v, key=lambda r: r.eval_loss).job.outer_lr for k, v in groups.items() if len(v) > 1}

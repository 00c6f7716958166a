"""The baselines `bench allreduce` compares our rounds with, each peer a process of its own.

- gloo: `torch.distributed.all_reduce` (SUM) with the gloo backend after one warm-up call; a rep is the slowest
  rank's time for one call, started together after a barrier, and the ranks' mean process CPU for it.
- hivemind: `DecentralizedAverager.step(wait=False, require_trigger=True)`; each peer waits until matchmaking has
  formed the full group (stage AWAITING_TRIGGER), all peers pass a barrier, then each times
  `allow_allreduce()` → `result()`. A rep is the slowest peer's time, so matchmaking is excluded and reported
  separately as the whole `.step()` call. One warm-up round first.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import resource
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from scripts.bench_common import free_port, kill_processes

WAIT_S = 120.0  # any single blocking wait in a worker or the parent


def _numel(size_mb: float) -> int:
    return int(size_mb * 2**20) // 4


def gloo_worker(rank: int, world: int, port: int, numel: int, reps: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=WAIT_S))
        tensor = torch.empty(numel, dtype=torch.float32)
        times, cpus = [], []
        for rep in range(reps + 1):  # rep 0 is a warm-up
            tensor.fill_(rank + 1.0)
            dist.barrier()
            before = _process_cpu()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            elapsed = time.perf_counter() - start
            cpu = _process_cpu() - before
            expected = world * (world + 1) / 2
            if abs(float(tensor[0]) - expected) > 1e-3 or abs(float(tensor[-1]) - expected) > 1e-3:
                raise RuntimeError(f"gloo all_reduce wrong: {float(tensor[0])} != {expected}")
            if rep:
                times.append(elapsed)
                cpus.append(cpu)
        out.put(("ok", rank, (times, cpus)))
        dist.destroy_process_group()
    except Exception:  # reported to the parent, which fails the benchmark with it
        out.put(("error", rank, traceback.format_exc(limit=-4)))


def hivemind_worker(rank: int, world: int, numel: int, reps: int, peers_q: Any, barrier: Any, out: Any) -> None:
    import torch
    from hivemind import DHT
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage

    dht = averager = None
    mp.set_start_method("fork", force=True)  # hivemind's DHT and averager processes are built for fork
    try:
        maddrs = ["/ip4/127.0.0.1/tcp/0"]
        if rank == 0:
            dht = DHT(start=True, host_maddrs=maddrs)
            visible = [str(a) for a in dht.get_visible_maddrs()]
            for _ in range(world - 1):
                peers_q.put(visible)
        else:
            dht = DHT(start=True, host_maddrs=maddrs, initial_peers=peers_q.get(timeout=WAIT_S))
        # request_timeout only bounds a stuck part: on a loaded machine 1 s turned a slow part into a partial average
        averager = DecentralizedAverager([torch.zeros(numel)], dht, prefix="bench", start=True, target_group_size=world,
                                         min_group_size=world, min_matchmaking_time=2.0, request_timeout=10.0)
        times, steps = [], []
        for rep in range(reps + 1):  # rep 0 is a warm-up
            with averager.get_tensors() as tensors:
                tensors[0].fill_(rank + 1.0)
            barrier.wait(WAIT_S)
            step_start = time.perf_counter()
            control = averager.step(wait=False, require_trigger=True, timeout=WAIT_S)
            deadline = time.monotonic() + WAIT_S
            while control.stage != AveragingStage.AWAITING_TRIGGER:
                if control.done() or time.monotonic() > deadline:
                    raise RuntimeError(f"hivemind matchmaking did not form a group of {world} (stage {control.stage})")
                time.sleep(0.002)
            barrier.wait(WAIT_S)
            start = time.perf_counter()
            control.allow_allreduce()
            control.result(timeout=WAIT_S)
            end = time.perf_counter()
            with averager.get_tensors() as tensors:
                got, expected = float(tensors[0][0]), (world + 1) / 2
            if abs(got - expected) > 1e-3:
                raise RuntimeError(f"hivemind average wrong: {got} != {expected}")
            if rep:
                times.append(end - start)
                steps.append(end - step_start)
        out.put(("ok", rank, (times, steps)))
    except Exception:  # reported to the parent, which fails the benchmark with it
        out.put(("error", rank, traceback.format_exc(limit=-4)))
    finally:
        if averager is not None:
            averager.shutdown()
        if dht is not None:
            dht.shutdown()


def _collect(out: Any, procs: Sequence[mp.process.BaseProcess], timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        try:
            status, rank, payload = out.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except queue.Empty as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(results)}/{len(procs)} workers reported within {timeout:.0f} s"
                ) from None
            dead = [p.pid for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
            if dead:
                raise RuntimeError(f"workers {dead} died without reporting") from exc
            continue
        if status != "ok":
            raise RuntimeError(f"worker {rank}: {payload}")
        results[rank] = payload
    return [results[r] for r in sorted(results)]


def _run(procs: Sequence[mp.process.BaseProcess], out: Any, timeout: float) -> list[Any]:
    """Start one process per rank, and each rank's report in rank order; every process is ended either way."""
    try:
        for p in procs:
            p.start()
        return _collect(out, procs, timeout)
    finally:
        kill_processes(procs)


def _process_cpu() -> float:
    """User + system CPU seconds of this process so far, every thread included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def gloo_seconds(size_mb: float, peers: int, reps: int, timeout: float) -> tuple[list[float], list[float]]:
    """Per rep: the slowest rank's seconds, and the mean over ranks of the process CPU seconds of the call."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=gloo_worker, args=(r, peers, port, _numel(size_mb), reps, out), daemon=True)
        for r in range(peers)
    ]
    per_rank = _run(procs, out, timeout)
    return ([max(t[0][i] for t in per_rank) for i in range(reps)],
            [sum(t[1][i] for t in per_rank) / peers for i in range(reps)])


def hivemind_seconds(size_mb: float, peers: int, reps: int, timeout: float) -> tuple[list[float], list[float]]:
    ctx = mp.get_context("spawn")
    out, peers_q, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(peers)
    procs = [
        ctx.Process(target=hivemind_worker, args=(r, peers, _numel(size_mb), reps, peers_q, barrier, out), daemon=False)
        for r in range(peers)
    ]
    per_rank = _run(procs, out, timeout)
    allreduce = [max(t[0][i] for t in per_rank) for i in range(reps)]
    step = [max(t[1][i] for t in per_rank) for i in range(reps)]
    return allreduce, step

"""`bench allreduce`: averaging one fp32 tensor across N processes on 127.0.0.1 — ours vs gloo vs hivemind.

- gloo: `torch.distributed.all_reduce` (SUM) with the gloo backend, one process per peer, after one warm-up call;
  a rep is the slowest rank's time for one call, started together after a barrier.
- hivemind: `DecentralizedAverager.step(wait=False, require_trigger=True)`; each peer waits until matchmaking has
  formed the full group (stage AWAITING_TRIGGER), all peers pass a barrier, then each times
  `allow_allreduce()` → `result()`. A rep is the slowest peer's time, so matchmaking (the DHT part, ~seconds) is
  excluded and reported separately as `hivemind_step_s` (the whole `.step()` call). One warm-up round first.
- ours: `bench_hooks.ours_allreduce_seconds(size_mb, peers, reps, codec)`, imported lazily; when missing the
  table says so and the JSON holds null.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from scripts.bench_common import (
    NOT_AVAILABLE,
    free_port,
    kill_processes,
    median,
    ratio,
    run_hook,
    table,
    write_json,
)

logger = logging.getLogger(__name__)

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
        times = []
        for rep in range(reps + 1):  # rep 0 is a warm-up
            tensor.fill_(rank + 1.0)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            elapsed = time.perf_counter() - start
            expected = world * (world + 1) / 2
            if abs(float(tensor[0]) - expected) > 1e-3 or abs(float(tensor[-1]) - expected) > 1e-3:
                raise RuntimeError(f"gloo all_reduce wrong: {float(tensor[0])} != {expected}")
            if rep:
                times.append(elapsed)
        out.put(("ok", rank, times))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- reported to the parent, which fails the benchmark with it
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
    except Exception:  # noqa: BLE001 -- reported to the parent, which fails the benchmark with it
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


def gloo_seconds(size_mb: float, peers: int, reps: int, timeout: float) -> list[float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=gloo_worker, args=(r, peers, port, _numel(size_mb), reps, out), daemon=True)
        for r in range(peers)
    ]
    try:
        for p in procs:
            p.start()
        per_rank = _collect(out, procs, timeout)
    finally:
        kill_processes(procs)
    return [max(t[i] for t in per_rank) for i in range(reps)]


def hivemind_seconds(size_mb: float, peers: int, reps: int, timeout: float) -> tuple[list[float], list[float]]:
    ctx = mp.get_context("spawn")
    out, peers_q, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(peers)
    procs = [
        ctx.Process(target=hivemind_worker, args=(r, peers, _numel(size_mb), reps, peers_q, barrier, out), daemon=False)
        for r in range(peers)
    ]
    try:
        for p in procs:
            p.start()
        per_rank = _collect(out, procs, timeout)
    finally:
        kill_processes(procs)
    allreduce = [max(t[0][i] for t in per_rank) for i in range(reps)]
    step = [max(t[1][i] for t in per_rank) for i in range(reps)]
    return allreduce, step


def ours_seconds(size_mb: int, peers: int, reps: int, codec: str, timeout: float) -> tuple[list[float] | None, str]:
    value, why = run_hook("ours_allreduce_seconds", size_mb, peers, reps, codec, timeout=timeout)
    if value is None:
        return None, why
    times = [float(t) for t in value]
    if not times or any(not t > 0 for t in times):
        return None, f"hook returned invalid times {times}"
    return times, ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=int, nargs="+", default=[100], help="tensor sizes in MiB (fp32), e.g. 10 100")
    p.add_argument("--peers", type=int, nargs="+", default=[2], help="process counts, e.g. 2 4")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per method (median reported; >= 3)")
    p.add_argument(
        "--codecs",
        nargs="+",
        default=["fp32", "int8", "int4"],
        help="codecs passed to our averaging; fp32 is the lossless `ours_s`",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per method and configuration")


def run(args: argparse.Namespace) -> int:
    sizes, peer_counts, reps = ([1], [2], 3) if args.quick else (args.size_mb, args.peers, max(3, args.reps))
    codecs = ["fp32"] if args.quick else list(dict.fromkeys(["fp32", *args.codecs]))
    results: dict[str, dict[str, Any]] = {}
    rows, notes = [], []
    for size in sizes:
        for peers in peer_counts:
            logger.info("allreduce %d MiB, %d peers: gloo", size, peers)
            gloo = gloo_seconds(size, peers, reps, args.timeout)
            logger.info("allreduce %d MiB, %d peers: hivemind", size, peers)
            hv, hv_step = hivemind_seconds(size, peers, reps, args.timeout)
            entry: dict[str, Any] = {
                "size_mb": size,
                "peers": peers,
                "reps": reps,
                "gloo_s": median(gloo),
                "hivemind_s": median(hv),
                "hivemind_step_s": median(hv_step),
                "gloo_all_s": gloo,
                "hivemind_all_s": hv,
                "ours_codec_s": {},
                "ours_note": None,
            }
            for codec in codecs:
                logger.info("allreduce %d MiB, %d peers: ours (%s)", size, peers, codec)
                times, why = ours_seconds(size, peers, reps, codec, args.timeout)
                entry["ours_codec_s"][codec] = median(times)
                if why:
                    entry["ours_note"] = why
                    notes.append(f"ours ({codec}, {size} MiB, {peers} peers): {why}")
                    if why == NOT_AVAILABLE:
                        break
            entry["ours_s"] = entry["ours_codec_s"].get("fp32")
            entry["hivemind_vs_gloo"] = ratio(entry["hivemind_s"], entry["gloo_s"])
            entry["ours_vs_gloo"] = ratio(entry["ours_s"], entry["gloo_s"])
            entry["ours_codec_vs_gloo"] = {c: ratio(s, entry["gloo_s"]) for c, s in entry["ours_codec_s"].items()}
            results.setdefault(str(size), {})[str(peers)] = entry
            best = {c: s for c, s in entry["ours_codec_s"].items() if s is not None}
            fastest = min(best, key=lambda c: best[c]) if best else None
            ours_cell = "not available" if entry["ours_note"] == NOT_AVAILABLE else entry["ours_s"]
            rows.append(
                [
                    size,
                    peers,
                    entry["gloo_s"],
                    entry["hivemind_s"],
                    entry["hivemind_step_s"],
                    ours_cell,
                    entry["hivemind_vs_gloo"],
                    entry["ours_vs_gloo"],
                    f"{fastest} {entry['ours_codec_vs_gloo'][fastest]:.3g}" if fastest else "—",
                ]
            )
    if any(n.endswith(NOT_AVAILABLE) for n in notes):
        print(f"ours: {NOT_AVAILABLE}")
    notes = list(dict.fromkeys(notes)) + [
        f"median of {reps} reps per method after one warm-up, slowest peer per rep, 127.0.0.1, same run",
        "gloo: torch.distributed.all_reduce(SUM), barrier then one call",
        (
            "hivemind: DecentralizedAverager allow_allreduce()→result() after the full group matched "
            "(matchmaking excluded); "
            "hivemind .step() = the whole call including matchmaking (min_matchmaking_time 2 s)"
        ),
        "ours fp32 = lossless; best codec = fastest of " + ", ".join(codecs) + " as time/gloo",
    ]
    print(
        table(
            "allreduce: one fp32 tensor, seconds and ratio to gloo",
            [
                "MiB",
                "peers",
                "gloo s",
                "hivemind s",
                "hivemind .step() s",
                "ours fp32 s",
                "hivemind/gloo",
                "ours fp32/gloo",
                "ours best codec/gloo",
            ],
            rows,
            notes,
        )
    )
    write_json(args.json, {"benchmark": "allreduce", "quick": bool(args.quick), "results": results})
    return 0

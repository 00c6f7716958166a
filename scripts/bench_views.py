"""The view schedule simulated: how many views, and how many seconds, until one leader holds a majority group, by
swarm size, share of leaders that stall, and how much of the record set each look misses.

    python -m scripts.bench views --json runs/bench/views.json [--quick]

Every peer runs the real decision (`swarmloco.protocol.round.schedule.decide`) on a virtual clock, every
`POLL_S`, on the records it happens to see; nothing here re-implements who leads. What is modelled, not run:
peers become ready spread over `--spread` seconds; each look sees each other record with probability `visible`
(a DHT read that missed some); a join counts once the member has followed the same leader in the same view for
`--rtt` seconds; a stalling leader never closes; a group closes the moment it holds a majority of the swarm (the
grace window is left out). It measures agreement, not bandwidth: what a 1,000-peer round costs on the wire is in
docs/scaling.md.
"""
from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Collection
from typing import Any

import swarmloco.protocol.round.schedule as schedule
from scripts.bench_common import table, write_json
from swarmloco.protocol.base.records import PROTOCOL_VERSION, PeerRecord
from swarmloco.protocol.round.schedule import POLL_S, Action, Views, ViewSchedule, decide

T0 = 1_000_000.0
SEED = "5eed" * 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", type=float, default=5.0, help="the first view's length in seconds")
    p.add_argument("--spread", type=float, default=2.0, help="seconds over which the peers become ready")
    p.add_argument("--rtt", type=float, default=0.5, help="seconds from deciding to follow a leader to being in")
    p.add_argument("--trials", type=int, default=0, help="trials per cell (0: 20, or 2 with --quick)")


def _record(ready: bool, eta: float, view: int) -> PeerRecord:
    return PeerRecord(version=PROTOCOL_VERSION, fingerprint="fp", config_json="{}", round=1, state_hash=SEED,
                      work=0, ready=ready, view=view, eta=eta, updated=eta)


def simulate(n: int, *, stall: float, visible: float, args: argparse.Namespace, seed: int) -> tuple[int, float]:
    """(views used, seconds from the first readiness) until a majority group closes; (0, inf) if none in 10 views."""
    rng = random.Random(seed)
    ids = [f"peer-{seed}-{i:05d}" for i in range(n)]
    stallers = set(rng.sample(ids, round(stall * n)))
    ready_at = {p: T0 + rng.uniform(0, args.spread) for p in ids}
    first = min(ready_at.values())
    sched = ViewSchedule(base_s=args.base)
    need = n // 2 + 1

    def enough(peers: Collection[str]) -> bool:  # a group closes the moment it holds a majority (see above)
        return len(peers) >= need

    views: dict[str, Views] = {}
    records = {p: _record(False, ready_at[p], 0) for p in ids}
    following: dict[str, tuple[str, int, float]] = {}  # member -> (leader, view, since)
    leading: dict[str, int] = {}
    t = first
    while t < first + sched.start(10):
        t += POLL_S
        for p in ids:
            if ready_at[p] > t:
                continue
            if p not in views:
                views[p] = Views(round=1, state_hash=SEED, ready_at=ready_at[p], anchor=float("inf"))
            seen = records if visible >= 1 else {q: r for q, r in records.items() if rng.random() < visible}
            here = {q: r for q, r in seen.items() if q != p}
            views[p].see({q: r.eta for q, r in here.items() if r.ready}, me=p, lookback_s=60.0, enough=enough)
            d = decide(me=p, views=views[p], here=here, seed=SEED, schedule=sched, now=t, enough=enough)
            records[p] = _record(True, ready_at[p], d.view)
            leading.pop(p, None)
            if d.action is Action.LEAD:
                leading[p] = d.view
                following.pop(p, None)
            else:
                old = following.get(p)
                since = old[2] if old is not None and old[:2] == (d.leader, d.view) else t
                following[p] = (d.leader, d.view, since)
        for leader, view in leading.items():
            if leader in stallers:
                continue
            members = sum(1 for lv in following.values() if lv[:2] == (leader, view) and t - lv[2] >= args.rtt)
            if 1 + members >= need:
                return view + 1, t - first
    return 0, float("inf")


def run(args: argparse.Namespace) -> int:
    quick = bool(args.quick)
    trials = args.trials or (2 if quick else 20)
    sizes = (4, 32) if quick else (4, 32, 256, 1000)
    schedule.view_rank = functools.lru_cache(maxsize=None)(schedule.view_rank)  # one hash per (view, peer)
    cells: list[dict[str, Any]] = []
    rows = []
    for n in sizes:
        for stall, visible in ((0.0, 1.0), (0.0, 0.9), (0.25, 1.0), (0.25, 0.9), (0.5, 0.9))[:5 if n <= 256 else 4]:
            started = time.monotonic()
            runs = [simulate(n, stall=stall, visible=visible, args=args, seed=s) for s in range(trials)]
            done = [r for r in runs if r[0]]
            cell = {"peers": n, "stalling_leaders": stall, "records_seen": visible, "trials": len(runs),
                    "formed": len(done), "views_mean": statistics.mean(v for v, _ in done) if done else None,
                    "views_max": max(v for v, _ in done) if done else None,
                    "seconds_mean": statistics.mean(s for _, s in done) if done else None,
                    "seconds_per_base": (statistics.mean(s for _, s in done) / args.base) if done else None,
                    "sim_s": round(time.monotonic() - started, 1)}
            cells.append(cell)
            rows.append([n, stall, visible, f"{len(done)}/{len(runs)}", cell["views_mean"], 1 / (1 - stall),
                         cell["views_max"], cell["seconds_mean"], cell["seconds_per_base"]])
            print(f"  {n} peers, {stall:.0%} stalling, {visible:.0%} seen: {cell}", flush=True)
    print(table("View schedule, simulated: until a majority group closes",
                ["peers", "stalling leaders", "records seen per look", "formed", "views (mean)",
                 "views if each is a fresh draw", "views (max)",
                 "seconds (mean)", "seconds ÷ first view"], rows,
                notes=[f"first view {args.base:g} s, views double to 8x; ready spread {args.spread:g} s; join "
                       f"{args.rtt:g} s; a look every {POLL_S:g} s; {trials} trials per cell",
                       "a fresh draw per view would take 1 / (1 − stalling share) views on average",
                       "the real `decide` on a virtual clock; stalling leaders never close; no grace window"]))
    write_json(args.json, {"benchmark": "views", "base_s": args.base, "spread_s": args.spread, "rtt_s": args.rtt,
                           "cells": cells})
    return 0

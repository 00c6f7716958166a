"""Contribution scores, measured: does the first-order loss decrease g·Δ separate honest pseudo-gradients from a
free rider's zero, random or negated Δ?

    python -m scripts.bench scores --json runs/bench/scores.json [--quick] [--inner-steps 50] [--rounds 12]

Three replicas of the default task (one shard, different data orders) train `--inner-steps` AdamW steps from the
same θ_r, as peers do; their mean pseudo-gradient is applied with the outer step, and the next round starts from the
new state. Every round, g is the gradient of the loss at θ_r on a probe batch none of them trained on (the task's
`probe`, a fresh seed each round), and each candidate Δ is scored by

    z = cos(g, Δ) · √n     (n parameters)

For a Δ drawn independently of g, z is about standard normal; an honest Δ lowers the loss, so its z is large and
positive. This is the measurement behind verified credit (swarmloco.protocol.round.credit): g is what every member
of a round computes with the peer's `CreditProbe`, and the last column is what that costs against one peer's inner
steps of the round (the probe runs once per round, in the audit).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from scripts.bench_common import table, write_json

PEERS = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--inner-steps", type=int, default=0, help="inner steps per round (0: 50, or 5 with --quick)")
    p.add_argument("--rounds", type=int, default=0, help="outer rounds (0: 12, or 2 with --quick)")


def _replicas() -> list[Any]:
    from swarmloco.peer.cli import build_replica
    from swarmloco.peer.config import build_config

    cfg = build_config(env={})
    cfg = replace(cfg, run=replace(cfg.run, shard_index=0))
    return [build_replica(cfg, data_seed=seed) for seed in range(1, PEERS + 1)]


def _flat(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    from swarmloco.peer.swarm_state import flatten

    return flatten(tensors, names).cpu()  # the random and zero Δs below are made on the CPU


def _probe(replica: Any) -> Any:
    from swarmloco.peer.credit_probe import CreditProbe

    if replica.task.probe is None:
        raise SystemExit("scores: the task has no probe batches (Task.probe)")
    return CreditProbe(replica)  # what every member of a round computes: g at θ_r on batches the seed draws


def _z(g: torch.Tensor, delta: torch.Tensor) -> float:
    denominator = float(g.norm()) * float(delta.norm())
    return float(g @ delta) / denominator * math.sqrt(g.numel()) if denominator > 0 else 0.0


def run(args: argparse.Namespace) -> int:
    steps = args.inner_steps or (5 if args.quick else 50)
    rounds = args.rounds or (2 if args.quick else 12)
    torch.manual_seed(0)
    replicas = _replicas()
    names = replicas[0].names
    n = sum(replicas[0].global_params[k].numel() for k in names)
    print(f"  {PEERS} replicas, {n:,} parameters, {steps} inner steps per round, {rounds} rounds", flush=True)
    cells: list[dict[str, Any]] = []
    probe = _probe(replicas[0])
    for r in range(rounds):
        started = time.monotonic()
        for replica in replicas:
            for _ in range(steps):
                replica.inner_step()
        train_s = (time.monotonic() - started) / len(replicas)  # one peer's inner steps of the round
        deltas = [replica.pseudo_gradient() for replica in replicas]
        honest = [_flat(d, names) for d in deltas]
        probed = time.monotonic()
        g = probe(f"round-{r}".encode())
        probe_s = time.monotonic() - probed
        scale = float(honest[0].norm()) / math.sqrt(n)
        z_honest = [_z(g, d) for d in honest]
        cell = {"round": r, "train_s": round(train_s, 3), "probe_s": round(probe_s, 3), "z_honest": z_honest,
                "z_honest_min": min(z_honest),
                "z_random": _z(g, torch.randn(n, generator=torch.Generator().manual_seed(r)) * scale),
                "z_zero": _z(g, torch.zeros(n)), "z_scaled_1pct": _z(g, honest[0] * 0.01),
                "z_negated": _z(g, -honest[0]), "seconds": round(time.monotonic() - started, 2)}
        cells.append(cell)
        print(f"  round {r}: {cell}", flush=True)
        average = {k: torch.stack([d[k] for d in deltas]).mean(0) for k in names}
        for replica in replicas:
            replica.apply_outer(average)
    rows = [[c["round"], c["z_honest_min"], statistics.mean(c["z_honest"]), c["z_random"],
             c["z_zero"], c["z_scaled_1pct"], c["z_negated"],
             c["z_honest_min"] / max(abs(c["z_random"]), 1.0), c["probe_s"] / c["train_s"]] for c in cells]
    print(table("Contribution scores: z = cos(g, Δ)·√n, g the loss gradient at θ_r on a fresh probe batch",
                ["round", "honest z (min)", "honest z (mean)", "random Δ z", "zero Δ z",
                 "1% of an honest Δ z", "negated Δ z", "honest min ÷ max(|random|, 1)",
                 "probe ÷ one peer's inner steps"], rows,
                notes=[f"{PEERS} replicas of the default task, {steps} inner steps per round, {n:,} parameters",
                       "a Δ independent of g scores about N(0, 1); z is scale-free, so a shrunken honest Δ scores "
                       "like the honest one: credit must weigh the loss decrease itself, not only its sign"]))
    write_json(args.json, {"benchmark": "scores", "inner_steps": steps, "rounds": rounds, "parameters": n,
                           "cells": cells})
    return 0

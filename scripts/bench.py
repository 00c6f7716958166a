"""Benchmark harness entry point: `python -m scripts.bench SUBCOMMAND [--quick] [--json PATH] ...`.

Subcommands (each prints a markdown table of ratios measured side by side in one run, and writes JSON):
  allreduce    our averaging vs torch.distributed gloo all_reduce vs hivemind DecentralizedAverager
  quality      eval loss of DiLoCo (M replicas, H inner steps, outer lr sweep) vs data-parallel at equal tokens
  comm         bytes per trained token: data-parallel ring all-reduce vs DiLoCo with each codec
  utilisation  compute vs wait share of heterogeneous peers shaped-link self-check
  join         late-joiner state fetch vs moving the same bytes over a plain loopback socket
  trust        certified rounds: certification vs exchange time per round, and the cost of each offline check
  codecs       encode/decode throughput of every codec, now vs before vectorising, vs a loopback send
  scale        round overhead (matchmaking, exchange, commit) and memory per peer for 2 .. 32 local peers
  goodput      tokens merged per second with churn-30s vs without, default quorum and lock-step
  views        the view schedule simulated (the real decision, a virtual clock): views until a majority group
  scores       contribution scores: the loss decrease g·Δ of honest pseudo-gradients vs a zero, random or negated Δ
  ingest       coordinator: durable reports per second and latency, group commit vs one commit per report
  cli          seconds until the console script answers --help or a mistyped flag (target: under 0.5 s)
The logic lives in scripts/bench_<name>.py; `--quick` shrinks every size for the smoke test (`make bench-smoke`).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "allreduce": ("scripts.bench_allreduce", "averaging one fp32 tensor: ours vs gloo vs hivemind"),
    "quality": ("scripts.bench_quality", "eval loss of DiLoCo vs data-parallel at equal tokens"),
    "comm": ("scripts.bench_comm", "bytes per trained token: data-parallel vs DiLoCo per codec"),
    "utilisation": ("scripts.bench_utilisation", "compute/wait share of heterogeneous peers; shaped-link check"),
    "join": ("scripts.bench_join", "late-joiner state fetch vs a plain loopback socket"),
    "trust": ("scripts.bench_trust", "certified rounds: certification vs exchange, and the offline checks"),
    "scale": ("scripts.bench_scale", "round overhead and memory per peer vs the number of peers (2 .. 32)"),
    "codecs": ("scripts.bench_codecs", "codec encode/decode throughput: now vs before, and vs a loopback send"),
    "robust": ("scripts.bench_robust", "what robust aggregation and the audit cost per round (with vs without)"),
    "goodput": ("scripts.bench_goodput", "goodput under churn vs steady, default quorum and lock-step (4 peers)"),
    "views": ("scripts.bench_views", "the view schedule simulated: views until a majority group, 4 .. 1,000 peers"),
    "scores": ("scripts.bench_scores", "contribution scores: g·Δ of honest Δs vs a free rider's zero/random Δ"),
    "ingest": ("scripts.bench_ingest", "coordinator: durable reports/s and latency, group commit vs one per report"),
    "cli": ("scripts.bench_cli", "seconds until `swarmloco --help`, a command's --help or a flag error answers"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
        p.add_argument("--quick", action="store_true", help="tiny sizes for the smoke test (checks sanity, not speed)")
        importlib.import_module(module_name).add_arguments(p)
        p.set_defaults(_module=module_name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so every `finally` kills our children and deletes namespaces.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return int(importlib.import_module(args._module).run(args))


if __name__ == "__main__":
    sys.exit(main())

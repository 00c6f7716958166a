"""What the defences of a round cost: the same averaging round with the robust aggregator and the audit (the
defaults) and without them (plain mean, no audit), real peers over loopback, in one run.

Both arms sign and check every claim, plan, part and result (that is not optional); the difference is the per-shard
norms and clipping, the signed coefficients, and the audit's three extra frames per connection with its Gaussian
probes (`--audit-probes`, 2 by default) drawn over every shard.

    python -m scripts.bench robust --size-mb 10 100 --peers 4 --codecs fp32 int8 --reps 3

Prints one table: seconds from release until the slowest peer holds the average (median over reps, one warm-up
round first), its ratio between the arms, the audit's share, and bytes sent per peer.
"""
from __future__ import annotations

import argparse
from typing import Any

from scripts.bench_common import run_hook, table

PLAIN = {"aggregator": "mean", "audit_probes": 0}
ROBUST: dict[str, Any] = {}  # the defaults: clip, 2 audit probes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=float, nargs="+", default=[10, 100], help="tensor sizes in MiB (fp32)")
    p.add_argument("--peers", type=int, nargs="+", default=[4], help="process counts")
    p.add_argument("--codecs", nargs="+", default=["fp32", "int8"], help="wire codecs")
    p.add_argument("--reps", type=int, default=3, help="timed rounds per arm (median reported)")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per arm")


def _arm(size: float, peers: int, reps: int, codec: str, rounds: dict[str, Any],
         timeout: float) -> tuple[dict[str, Any] | None, str]:
    value, why = run_hook("ours_allreduce", size, peers, reps, codec, timeout=timeout,
                          optional={"rounds": rounds})
    if value is None:
        return None, why
    reps_out = value["reps"]
    seconds = sorted(r["seconds"] for r in reps_out)
    audit = sorted(r.get("audit_s", 0.0) for r in reps_out)
    sent = sorted(r["sent_mean"] for r in reps_out)
    return {"seconds": seconds[len(seconds) // 2], "audit_s": audit[len(audit) // 2],
            "sent": sent[len(sent) // 2], "all": seconds}, ""


def run(args: argparse.Namespace) -> int:
    rows: list[list[Any]] = []
    failed = False
    for size in args.size_mb:
        for peers in args.peers:
            for codec in args.codecs:
                print(f"{size:g} MiB, {peers} peers, {codec}: plain mean, no audit ...", flush=True)
                plain, why_p = _arm(size, peers, args.reps, codec, PLAIN, args.timeout)
                print(f"{size:g} MiB, {peers} peers, {codec}: robust + audit ...", flush=True)
                robust, why_r = _arm(size, peers, args.reps, codec, ROBUST, args.timeout)
                if plain is None or robust is None:
                    failed = True
                    rows.append([f"{size:g}", peers, codec, why_p or "-", why_r or "-", "", "", ""])
                    continue
                rows.append([
                    f"{size:g}", peers, codec, f"{plain['seconds']:.3f}", f"{robust['seconds']:.3f}",
                    f"{robust['seconds'] / plain['seconds']:.2f}x", f"{robust['audit_s']:.3f}",
                    f"{robust['sent'] / plain['sent']:.3f}x",
                ])
    print(table("robust aggregation + audit vs plain mean, no audit (one run)",
                ["MiB", "peers", "codec", "plain s", "robust+audit s", "ratio", "of which audit s", "bytes ratio"],
                rows, ["seconds: release until the slowest peer holds the average, median over reps (after one "
                       "warm-up); ours_allreduce in scripts/bench_allreduce_hooks.py"]))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

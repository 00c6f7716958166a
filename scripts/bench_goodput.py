"""Goodput under churn: tokens merged into the agreed state per second of wall time with `churn-30s` (a random peer
SIGKILLed and restarted every 30 s) divided by the same without churn, 4 real peers on 127.0.0.1, one run each;
and the same ratio for a lock-step baseline, where every round waits for every peer (quorum = peers, a round
timeout long enough to outlast a restart).

    python -m scripts.bench goodput --json runs/bench/goodput.json [--quick]

Prints one table: goodput of each arm, and the churn ÷ steady ratio per mode.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from scripts.bench_common import fmt, ratio, table, write_json
from swarmloco.chaos import ChaosConfig, run_chaos_config

MODES = ("default", "lockstep")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=int, default=4, help="peer processes")
    p.add_argument("--duration", type=float, default=0.0, help="seconds per arm (0: 180, or 40 with --quick)")
    p.add_argument("--workdir", default="runs/bench/goodput", help="the arms' workdirs go under here")
    p.add_argument("--lockstep-round-timeout", type=float, default=0.0,
                   help="lock-step arm's --round-timeout (0: 60 s, 30 s with --quick)")


def _arm(args: argparse.Namespace, mode: str, scenario: str) -> dict[str, Any]:
    quick = bool(args.quick)
    duration = args.duration or (40.0 if quick else 180.0)
    lockstep = mode == "lockstep"
    cfg = ChaosConfig(
        scenario=scenario, workdir=Path(args.workdir) / f"{mode}-{scenario}",
        json_out=Path(args.workdir) / f"{mode}-{scenario}.json", peers=args.peers, duration_s=duration,
        settle_s=30.0 if quick else 60.0, quick=quick, quorum=args.peers if lockstep else 0,
        round_timeout_s=(args.lockstep_round_timeout or (30.0 if quick else 60.0)) if lockstep else 0.0,
    )
    print(f"{mode}, {scenario}: {args.peers} peers for {duration:.0f}s ...", flush=True)
    started = time.monotonic()
    out = run_chaos_config(cfg)
    keep = ("rounds_committed", "tokens_committed", "wall_s", "goodput_tokens_per_s", "views_per_round", "orphans",
            "one_final_hash", "error", "quorum", "round_timeout_s")
    arm = {k: out.get(k) for k in keep}
    arm["faults"] = len(out.get("faults", []))
    arm["seconds_with_startup"] = round(time.monotonic() - started, 1)
    return arm


def run(args: argparse.Namespace) -> int:
    arms: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        for scenario in ("steady", "churn-30s"):
            arms[f"{mode}/{scenario}"] = _arm(args, mode, scenario)
    ratios = {mode: ratio(arms[f"{mode}/churn-30s"]["goodput_tokens_per_s"],
                          arms[f"{mode}/steady"]["goodput_tokens_per_s"]) for mode in MODES}
    rows = [[mode, arms[f"{mode}/steady"]["goodput_tokens_per_s"], arms[f"{mode}/churn-30s"]["goodput_tokens_per_s"],
             ratios[mode], arms[f"{mode}/steady"]["rounds_committed"], arms[f"{mode}/churn-30s"]["rounds_committed"],
             arms[f"{mode}/churn-30s"]["faults"]] for mode in MODES]
    print(table(f"goodput under churn, {args.peers} peers (one run per arm)",
                ["mode", "steady tok/s", "churn tok/s", "churn ÷ steady", "steady rounds", "churn rounds",
                 "churn faults"], rows,
                ["goodput: tokens of the certified rounds all peers agree on (bounded token weights), per second of "
                 "the fault window plus settling; `swarmloco chaos run` per arm",
                 "lockstep: quorum = peers and a long round timeout, so every round waits for every peer",
                 f"churn: a random peer SIGKILLed and restarted every {8 if args.quick else 30} s"]))
    payload = {"benchmark": "goodput", "quick": bool(args.quick), "peers": args.peers,
               "goodput_ratio": ratios["default"], "lockstep_goodput_ratio": ratios["lockstep"], "arms": arms}
    write_json(args.json, payload)
    bad = [k for k, a in arms.items() if a["error"] or a["orphans"]]
    if bad:
        print(f"arms with an error or orphans: {', '.join(bad)} ({fmt(len(bad))})", flush=True)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--quick", action="store_true")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""`bench allreduce`: averaging one fp32 tensor across N processes — ours (every codec) vs gloo vs hivemind.

- gloo and hivemind: the baselines in scripts.bench_allreduce_baselines, one process per peer.
- ours: the hook `ours_allreduce(size_mb, peers, reps, codec, netns=None)` (scripts.bench_allreduce_hooks, found by
  name through scripts.bench_hooks in a child process): a rep runs from one barrier releasing every peer, each
  with its group formed, to the slowest peer holding the checked average; it also returns each peer's bytes sent
  and a phase breakdown. Missing or failing, its cells say so and the JSON holds null.

`--shaped RATE` reruns ours with every peer in its own network namespace behind a tbf-shaped veth
(scripts.bench_net.shaped_star) and compares each round with the bound bytes-per-link / RATE. Every failure is a
table cell and a note, never a missing row.
"""
from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

from scripts.bench_allreduce_baselines import gloo_seconds, hivemind_seconds
from scripts.bench_common import (
    NOT_AVAILABLE,
    fmt,
    median,
    ratio,
    run_hook,
    table,
    write_json,
)
from scripts.bench_net import NetnsUnavailable, shaped_link_check, shaped_star

logger = logging.getLogger(__name__)

CODECS = ("fp32", "fp16", "bf16", "int8", "int4")


def _attempt(what: str, fn: Callable[[], Any], *, tries: int = 1) -> tuple[Any, str]:
    """fn()'s value, or (None, why): a failed method becomes a table cell and a note, never a missing row. With
    `tries` > 1 a failure is retried, and a value that came only on a later try carries a note saying so."""
    failures: list[str] = []
    for _ in range(tries):
        try:
            value = fn()
        except Exception as exc:  # reported in the table
            logger.warning("%s failed (try %d of %d): %r", what, len(failures) + 1, tries, exc)
            failures.append(str(exc)[-300:])  # a worker's traceback ends with the error itself
            continue
        return value, (f"ok on try {len(failures) + 1} of {tries}; before: {failures[-1]}" if failures else "")
    return None, f"failed {tries} time(s): {failures[-1]}"


def ours(size_mb: float, peers: int, reps: int, codec: str, timeout: float,
         netns: list[tuple[str, str]] | None = None) -> tuple[dict[str, Any] | None, str]:
    """The hook's rounds, summarised: medians over reps of every timed field; bytes as sent by the peers."""
    optional = {"netns": netns} if netns else None
    value, why = run_hook("ours_allreduce", size_mb, peers, reps, codec, timeout=timeout, optional=optional)
    if value is None:
        return None, why
    reps_out = value["reps"]
    if not reps_out or any(not r["seconds"] > 0 for r in reps_out):
        return None, f"hook returned invalid times {[r['seconds'] for r in reps_out]}"
    summary = {k: median([float(r[k]) for r in reps_out]) for k in reps_out[0]}
    summary["all_s"] = [r["seconds"] for r in reps_out]
    summary["encoded_bytes"] = value["encoded_bytes"]
    return summary, ""


def parse_rate(rate: str) -> float:
    """tc's rate syntax ("100mbit", "1gbit", "500kbit") in bits per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate: got {rate!r}, expected e.g. 100mbit")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=float, nargs="+", default=[10, 100], help="tensor sizes in MiB (fp32)")
    p.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8], help="process counts")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per method (median reported; >= 3)")
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS, help="our codecs; fp32 is lossless")
    p.add_argument("--hivemind-max-peers", type=int, default=8, help="skip hivemind above this many peers")
    p.add_argument("--hivemind-max-mb", type=float, default=100, help="skip hivemind above this size")
    p.add_argument("--shaped", metavar="RATE", help="also run ours with every peer in its own namespace behind a "
                   "tbf-shaped veth at RATE (e.g. 100mbit; root only)")
    p.add_argument("--shaped-size-mb", type=float, default=10, help="tensor size of the shaped runs")
    p.add_argument("--shaped-peers", type=int, default=4, help="peers in the shaped runs")
    p.add_argument("--shaped-codecs", nargs="+", default=["fp32", "int8"], choices=CODECS, help="shaped codecs")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per method and configuration")


def _cell(seconds: float | None, base: float | None, why: str = "") -> str:
    if seconds is None:
        return why.split(":")[0] if why else "—"
    r = ratio(seconds, base)
    return f"{fmt(seconds)} ({fmt(r)}×)" if r is not None else fmt(seconds)


def _measure(size: float, peers: int, reps: int, codecs: list[str], args: argparse.Namespace,
             notes: list[str]) -> dict[str, Any]:
    where = f"{size:g} MiB, {peers} peers"
    logger.info("allreduce %s: gloo", where)
    measured, gloo_why = _attempt("gloo", lambda: gloo_seconds(size, peers, reps, args.timeout))
    gloo, gloo_cpu = measured if measured is not None else (None, None)
    entry: dict[str, Any] = {"size_mb": size, "peers": peers, "reps": reps, "gloo_s": median(gloo), "gloo_all_s": gloo,
                             "gloo_cpu_s": median(gloo_cpu), "gloo_note": gloo_why or None, "hivemind_note": None,
                             "ours_note": None, "ours": {}}
    if gloo_why:
        notes.append(f"gloo ({where}): {gloo_why}")
    hv: tuple[list[float], list[float]] | None = None
    if peers > args.hivemind_max_peers or size > args.hivemind_max_mb:
        entry["hivemind_note"] = "skipped"
        notes.append(f"hivemind ({where}): skipped (--hivemind-max-peers {args.hivemind_max_peers}, "
                     f"--hivemind-max-mb {args.hivemind_max_mb:g})")
    else:
        logger.info("allreduce %s: hivemind", where)
        # hivemind's averager runs on fixed timeouts and, on a busy machine, can fail a step: the baseline gets a
        # second try (the note says so) rather than a missing cell
        hv, hv_why = _attempt("hivemind", lambda: hivemind_seconds(size, peers, reps, args.timeout), tries=2)
        if hv_why:
            entry["hivemind_note"] = hv_why
            notes.append(f"hivemind ({where}): {hv_why}")
    entry["hivemind_s"] = median(hv[0]) if hv else None
    entry["hivemind_step_s"] = median(hv[1]) if hv else None
    entry["hivemind_all_s"] = hv[0] if hv else None
    entry["hivemind_vs_gloo"] = ratio(entry["hivemind_s"], entry["gloo_s"])
    for codec in codecs:
        logger.info("allreduce %s: ours (%s)", where, codec)
        got, why = ours(size, peers, reps, codec, args.timeout)
        entry["ours"][codec] = got if got is not None else {"note": why}
        if why:
            entry["ours_note"] = why
            notes.append(f"ours ({codec}, {where}): {why}")
            if why == NOT_AVAILABLE:
                break
    fp32 = entry["ours"].get("fp32") or {}
    entry["ours_s"] = fp32.get("seconds")
    entry["ours_vs_gloo"] = ratio(entry["ours_s"], entry["gloo_s"])
    entry["ours_codec_vs_gloo"] = {c: ratio(o.get("seconds"), entry["gloo_s"]) for c, o in entry["ours"].items()}
    return entry


def _shaped(args: argparse.Namespace, reps: int, notes: list[str]) -> tuple[list[list[Any]], dict[str, Any]]:
    size, peers, rate = args.shaped_size_mb, args.shaped_peers, args.shaped
    bits = parse_rate(rate)
    rows, out = [], {"rate": rate, "size_mb": size, "peers": peers, "check": None, "codecs": {}}
    try:
        out["check"] = shaped_link_check(8 << 20, rate=rate)
        for codec in args.shaped_codecs:
            logger.info("allreduce shaped %s: %g MiB, %d peers, %s", rate, size, peers, codec)
            with shaped_star(peers, rate=rate) as namespaces:
                got, why = ours(size, peers, reps, codec, args.timeout, [(ns.name, ns.address) for ns in namespaces])
            if got is None:
                notes.append(f"shaped ours ({codec}): {why}")
                rows.append([size, peers, codec, "—", "—", why.split(":")[0], "—", "—"])
                continue
            link = max(got["sent_max"], got["received_max"])  # each veth is shaped both ways: the busier direction
            bound = link * 8 / bits
            got["bound_s"] = bound
            out["codecs"][codec] = got
            rows.append([size, peers, codec, link / 2**20, bound, got["seconds"], got["seconds"] / bound,
                         got["round_s"]])
    except NetnsUnavailable as exc:
        notes.append(f"shaped runs skipped: {exc}")
        out["note"] = str(exc)
    return rows, out


def run(args: argparse.Namespace) -> int:
    sizes, peer_counts, reps = ([1.0], [2], 3) if args.quick else (args.size_mb, args.peers, max(3, args.reps))
    codecs = ["fp32"] if args.quick else list(dict.fromkeys(["fp32", *args.codecs]))
    results: dict[str, dict[str, Any]] = {}
    time_rows: list[list[Any]] = []
    byte_rows: list[list[Any]] = []
    phase_rows: list[list[Any]] = []
    notes: list[str] = []
    for size in sizes:
        for peers in peer_counts:
            entry = _measure(size, peers, reps, codecs, args, notes)
            results.setdefault(f"{size:g}", {})[str(peers)] = entry
            gloo = entry["gloo_s"]
            by_codec = entry["ours"]
            time_rows.append([size, peers, _cell(gloo, None, entry["gloo_note"] or ""),
                              _cell(entry["hivemind_s"], gloo, entry["hivemind_note"] or ""),
                              *(_cell(by_codec[c].get("seconds"), gloo, by_codec[c].get("note", "")) if c in by_codec
                                else "—" for c in codecs)])
            share = 2 * (peers - 1) / peers
            byte_rows.append([size, peers, share, *(
                f"{o['sent_max'] / o['encoded_bytes']:.3f} / {o['sent_mean'] / o['encoded_bytes']:.3f}"
                if "sent_max" in (o := by_codec.get(c, {})) else "—" for c in codecs)])
            for c, o in by_codec.items():
                if "seconds" in o:
                    phase_rows.append([size, peers, c, o["plan_s"], o["parts_s"], o["reduced_s"], o["average_s"],
                                       f"{fmt(o['audit_s'])} ({o['audit_s'] / o['seconds']:.0%})",
                                       o["round_s"] - o["seconds"], o["encode_cpu_s"], o["decode_cpu_s"],
                                       o["accumulate_cpu_s"], _cell(cpu := o["user_cpu_s"] + o["sys_cpu_s"],
                                                                    entry["gloo_cpu_s"]),
                                       max(cpu, peers * cpu / (os.cpu_count() or 1)), o["page_faults"]])
    if any(n.endswith(NOT_AVAILABLE) for n in notes):
        print(f"ours: {NOT_AVAILABLE}")
    print(table(
        "allreduce: seconds per round (ratio to gloo), same run",
        ["MiB", "peers", "gloo s", "hivemind s", *(f"ours {c}" for c in codecs)], time_rows,
        [*dict.fromkeys(notes),
         f"median of {reps} reps after one warm-up, slowest peer per rep, 127.0.0.1",
         "gloo: torch.distributed.all_reduce(SUM) after a barrier; hivemind: allow_allreduce()→result() after the "
         "full group matched (matchmaking excluded)",
         "ours: every peer's group formed, one barrier releases all peers, `Averager.run_round`; timed to the slowest "
         "peer holding the checked average (the certificate that follows is in the phase table)",
         "targets: lossless fp32 ≤ 3× gloo at 2 peers and ≤ 2× at 4, with robust aggregation and the audit on, "
         "and faster than hivemind at both"],
    ))
    print(table(
        "allreduce: bytes each peer sent per round / the encoded vector (max / mean over peers)",
        ["MiB", "peers", "2(N−1)/N", *codecs], byte_rows,
        ["sent = shard parts + reduced shards, frame headers included (the control messages of the plan and the "
         "votes are not counted); the encoded vector = codec.encoded_size(numel)"],
    ))
    print(table(
        "allreduce: where our round's time goes (seconds since the release, slowest peer; CPU per peer)",
        ["MiB", "peers", "codec", "plan+pipes", "parts sent", "own shard reduced", "average held",
         "audit (share)", "certify",
         "encode CPU", "decode CPU", "accumulate CPU", "process CPU (× gloo's)", "CPU floor s", "page faults"],
        phase_rows,
        ["plan+pipes: the first encode starts (claims in, plan out, every shard connection open); parts sent: the "
         "uplink's last part written; own shard reduced: the reduced shard's encode starts; average held: `apply` "
         "called; audit: the longest any member's audit took (inside the time to average held; target ≤ 10%); "
         "certify: after that, until the last peer holds the certificate",
         "CPU columns: seconds inside codec calls per peer (executor threads, one torch thread each); process CPU: "
         "user + system seconds of the whole peer process during `run_round` (hashing, checks, audit and the "
         "kernel's copies included), and its minor page faults, both the mean over peers; gloo's: the same for one "
         "rank's all_reduce",
         f"CPU floor: the least a round can take on this machine's {os.cpu_count()} cores with that much CPU per "
         "peer (peers × process CPU / cores, or one peer's CPU): where the peers outnumber the cores, every peer's "
         "work competes for them, and the ratio of CPU per peer bounds the ratio of times"],
    ))
    shaped: dict[str, Any] | None = None
    if args.shaped and not args.quick:
        shaped_notes: list[str] = []
        rows, shaped = _shaped(args, reps, shaped_notes)
        check = shaped.get("check")
        if check:
            shaped_notes.append(f"self-check: one TCP stream through a shaped link moved {check['mbit_s']:.1f} "
                                f"Mbit/s (tc rate {check['rate']})")
        print(table(
            f"allreduce over {args.shaped} links: each peer in its own namespace, tbf-shaped veth both ways",
            ["MiB", "peers", "codec", "bytes per link MiB", "bound s", "ours s", "ours / bound", "round s"], rows,
            [*shaped_notes, "bound = the busiest peer's max(sent, received) bytes × 8 / rate; ours s as above "
             "(release → slowest peer holds the average); round s includes the certificate"],
        ))
    write_json(args.json, {"benchmark": "allreduce", "quick": bool(args.quick), "results": results, "shaped": shaped})
    return 0

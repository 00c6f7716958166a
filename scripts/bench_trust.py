"""`bench trust`: what the trust layer costs, measured in one run.

Rounds: N real peer processes average one tensor (`bench_hooks.round_phases`); each round's time is split into the
exchange (contributions in, average out, as before certificates) and the certification that now follows it (members
apply, sign the statement, the leader gathers the votes and sends the certificate, every member verifies it). The
ratio round / exchange is the slowdown a round pays for being certified.

Checks: the per-operation CPU cost of what every peer verifies offline, timed in this process: a ticket, a signed
DHT record (signature + ticket), and a certificate with 4, 16 and 64 signers (each signature and ticket).
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

from scripts.bench_common import median, ratio, run_hook, table, write_json

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=float, nargs="+", default=[1, 10], help="tensor sizes in MiB (fp32)")
    p.add_argument("--peers", type=int, nargs="+", default=[2, 4], help="process counts")
    p.add_argument("--codec", default="int8", help="wire codec of the rounds")
    p.add_argument("--reps", type=int, default=5, help="rounds per configuration (median reported; >= 3)")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per configuration")


def _per_call_us(fn: Any, *, seconds: float = 0.3) -> float:
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - started) / calls * 1e6


def check_costs() -> list[list[Any]]:
    from hivemind.utils import get_dht_time

    from swarmloco.protocol.base.records import PeerRecord
    from swarmloco.protocol.trust.admission import Gate, Ticket
    from swarmloco.protocol.trust.certificates import Certificate, Statement
    from swarmloco.protocol.trust.identity import Identity
    from swarmloco.protocol.trust.signed_records import open_record, seal

    def key() -> Identity:
        return Identity(path=Path("<memory>"), private_key=Identity.generate())

    run, authority = "bench", key()
    gate = Gate(run, authority.peer_id)
    peer = key()
    ticket = Ticket.issue(authority, run_id=run, peer_id=peer.peer_id)
    record = PeerRecord.announce(fingerprint="fp", config_json="{}", round=7, state_hash="a" * 64, work=70)
    envelope = seal(peer, run, record, ticket.to_bytes().decode(), get_dht_time() + 20)
    rows = [["ticket check", _per_call_us(lambda: gate.check(ticket.to_bytes(), peer.peer_id))],
            ["signed record check", _per_call_us(lambda: open_record(envelope, run_id=run, subkey=peer.peer_id,
                                                                     gate=gate))]]
    for n in (4, 16, 64):
        members = sorted((key() for _ in range(n)), key=lambda i: i.peer_id)
        s = Statement(run_id=run, round=8, prev_hash="a" * 64, new_hash="b" * 64,
                      members=tuple(m.peer_id for m in members), weights=tuple(100 for _ in members), swarm=n,
                      work=70 + 100 * n)
        tickets = {m.peer_id: Ticket.issue(authority, run_id=run, peer_id=m.peer_id).to_bytes().decode()
                   for m in members}
        cert = Certificate(s, {m.peer_id: Certificate.sign(m, s) for m in members}, tickets)
        assert not cert.problem(run_id=run, gate=gate, quorum=2)
        rows.append([f"certificate check, {n} signers ({len(cert.to_bytes()) / 1024:.1f} KiB)",
                     _per_call_us(lambda c=cert: c.problem(run_id=run, gate=gate, quorum=2), seconds=0.5)])
    return rows


def run(args: argparse.Namespace) -> int:
    sizes, peer_counts, reps = ([1], [2], 3) if args.quick else (args.size_mb, args.peers, max(3, args.reps))
    rows, results, notes = [], {}, []
    for size in sizes:
        for peers in peer_counts:
            logger.info("trust: %g MiB, %d peers", size, peers)
            value, why = run_hook("round_phases", size, peers, reps, args.codec, timeout=args.timeout)
            if value is None:
                notes.append(f"{size} MiB, {peers} peers: {why}")
                continue
            round_s = median([r["round_s"] for r in value])
            certify_s = median([r["certify_s"] for r in value])
            exchange_s = round_s - certify_s if round_s is not None and certify_s is not None else None
            results[f"{size}MiB-{peers}"] = {"rounds": value, "round_s": round_s, "certify_s": certify_s}
            rows.append([size, peers, exchange_s, certify_s, round_s, ratio(round_s, exchange_s)])
    checks = check_costs()
    print(table("Certified rounds: the exchange vs the certification that follows it (same rounds)",
                ["MiB", "peers", "exchange s", "certify s", "round s", "round / exchange"], rows,
                [*notes, f"codec {args.codec}, median of {reps} rounds, 127.0.0.1, slowest peer per phase",
                 "exchange: contributions in and the average out; certify: members apply, sign, vote; the leader "
                 "sends the certificate and every member verifies it"]))
    print(table("Offline checks every peer makes (CPU, this process)", ["check", "µs per call"], checks))
    write_json(args.json, {"benchmark": "trust", "rounds": results, "checks_us": {r[0]: r[1] for r in checks}})
    return 0

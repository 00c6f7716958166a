"""`bench ingest`: durable reports per second and their latency at the coordinator, with and without group commit.

    python -m scripts.bench ingest --clients 64 --seconds 10 --json runs/bench/ingest.json [--quick]

One run, two arms on fresh databases: the real coordinator (HTTP server, report verification, the SQLite store with
synchronous=FULL) in this process, and `--clients` client threads spread over worker processes, each a peer of its
own posting signed heartbeat reports back to back over one keep-alive connection. A report counts once it is
acknowledged (HTTP 200): by then its transaction is fsynced. After each arm the server stops and the database is
reopened: every acknowledged (peer, nonce) must be in it ("lost" counts those that are not). The coordinator's rate
limits are lifted for the run, since one machine's clients would otherwise share one address's budget.
"""
from __future__ import annotations

import argparse
import http.client
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from scripts.bench_common import table, write_json

RUN_ID = "ingest"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (each one peer, one connection)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per arm (after 1 s of warm-up)")
    p.add_argument("--workers", type=int, default=4, help="client processes the clients are spread over")


def _client(port: int, threads: int, start_at: float, stop_at: float, out: Any) -> None:
    """Worker process: `threads` peers posting signed heartbeats; returns (latency, ok, peer, nonce) per request
    sent after `start_at`."""
    from swarmloco.protocol.trust.identity import Identity
    from swarmloco.protocol.trust.reports import build_report

    results: list[tuple[float, bool, str, str]] = []
    lock = threading.Lock()

    def one(n: int) -> None:
        me = Identity(path=Path("<memory>"), private_key=Identity.generate())
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        mine: list[tuple[float, bool, str, str]] = []
        tokens = 0
        while time.time() < stop_at:
            tokens += 1000
            report = build_report(me, RUN_ID, "heartbeat", {"tokens_total": tokens, "round": n})
            body = report.encode()
            sent = time.monotonic()
            try:
                conn.request("POST", "/api/reports", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                ok = False
            if time.time() >= start_at:
                mine.append((time.monotonic() - sent, ok, report.peer_id, report.nonce))
        conn.close()
        with lock:
            results.extend(mine)

    pool = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    out.put(results)


def _arm(group_commit: bool, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from swarmloco.coordinator.authority import AuthorityConfig
    from swarmloco.coordinator.server import CoordinatorConfig, CoordinatorServer
    from swarmloco.coordinator.service import ServiceConfig
    from swarmloco.coordinator.store import SQLiteStore
    from swarmloco.protocol.trust.admission import AdmissionPolicy

    db = workdir / f"{'group' if group_commit else 'single'}.sqlite"
    service = ServiceConfig(run_id=RUN_ID, rate_per_s=1e9, rate_burst=1e9, peer_rate_per_s=1e9, peer_rate_burst=1e9,
                            authority=AuthorityConfig(policy=AdmissionPolicy(mode="none")))
    server = CoordinatorServer(CoordinatorConfig(db=db, port=0, dht=False, service=service,
                                                 group_commit=group_commit)).start()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 3.0  # the workers' imports and identities first, then 1 s of warm-up inside
    stop_at = start_at + 1.0 + args.seconds
    per = [args.clients // args.workers + (i < args.clients % args.workers) for i in range(args.workers)]
    procs = [ctx.Process(target=_client, args=(server.port, n, start_at + 1.0, stop_at, out)) for n in per if n]
    for p in procs:
        p.start()
    results: list[tuple[float, bool, str, str]] = []
    try:
        time.sleep(max(0.0, start_at + 1.0 - time.time()))
        first = server.store.commits  # commits within the measured window only
        time.sleep(max(0.0, stop_at - time.time()))
        commits = server.store.commits - first
        for _ in procs:
            results += out.get(timeout=args.seconds + 120)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        server.stop()
    store = SQLiteStore(db)
    stored = set(store.nonces())
    store.close()
    acked = [(lat, peer, nonce) for lat, ok, peer, nonce in results if ok]
    latencies = sorted(lat for lat, _, _ in acked)

    def pct(q: float) -> float | None:
        return 1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None

    return {"group_commit": group_commit, "clients": args.clients, "seconds": args.seconds,
            "acknowledged": len(acked), "failed": len(results) - len(acked),
            "reports_per_s": len(acked) / args.seconds, "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "mean_ms": 1000 * statistics.mean(latencies) if latencies else None, "commits": commits,
            "lost": sum((peer, nonce) not in stored for _, peer, nonce in acked)}


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.clients, args.seconds, args.workers = 8, 2.0, 2
    if not (1 <= args.workers <= args.clients <= 1024 and args.seconds > 0):
        raise SystemExit("need 1 <= --workers <= --clients <= 1024 and --seconds > 0")
    with tempfile.TemporaryDirectory(prefix="swarmloco-ingest-") as tmp:
        arms = [_arm(False, args, Path(tmp)), _arm(True, args, Path(tmp))]
    single, group = arms
    rows = [["one commit per report" if not a["group_commit"] else "group commit", a["clients"],
             a["reports_per_s"], a["reports_per_s"] / single["reports_per_s"] if single["reports_per_s"] else None,
             a["p50_ms"], a["p99_ms"], a["commits"], a["acknowledged"] / a["commits"] if a["commits"] else None,
             a["failed"], a["lost"]] for a in arms]
    print(table("Coordinator ingest: durable reports per second (acknowledged = fsynced)",
                ["store", "clients", "reports/s", "× one per report", "p50 ms", "p99 ms", "commits",
                 "reports per commit", "failed", "acknowledged but lost"], rows,
                notes=[f"{args.seconds:g} s measured per arm after 1 s of warm-up; signed heartbeat reports, each "
                       "client a peer of its own on one keep-alive connection; server and clients share the machine",
                       "lost: acknowledged reports missing from the database reopened after the arm"]))
    write_json(args.json, {"benchmark": "ingest", "arms": arms})
    return 0 if all(a["lost"] == 0 for a in arms) and group["acknowledged"] > 0 else 1

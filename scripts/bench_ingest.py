"""`bench ingest`: durable reports per second and their latency at the coordinator, with and without group commit.

    python -m scripts.bench ingest --clients 64 --seconds 10 --json runs/bench/ingest.json [--quick]

One run, two arms on fresh databases: the real coordinator (HTTP server, report verification, the SQLite store with
synchronous=FULL) in this process, and `--clients` client threads spread over worker processes, each a peer of its
own posting signed heartbeat reports back to back over one keep-alive connection, one report per request. A report
counts once it is acknowledged (HTTP 200): by then its transaction is fsynced. After each arm the server stops and
the database is reopened: every acknowledged (peer, nonce) must be in it ("lost" counts those that are not). The
coordinator's rate limits are lifted for the run, since one machine's clients would otherwise share one address's
budget.

The clients are kept cheap, since they share the machine with the server: each signs its reports before the
measured window (distinct nonces, real Ed25519 signatures the coordinator verifies in full; more are signed on the
fly should they run out) and speaks HTTP/1.1 over a raw socket. The CPU seconds of the server process, of the
clients and of the whole machine within the measured window are recorded, so the table says what bounds the rate.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from scripts.bench_common import table, write_json

RUN_ID = "ingest"
PREBUILT_PER_S = 6000  # reports signed in advance per measured second, over all clients (more are signed live)
READY_TIMEOUT_S = 300.0  # the workers' imports and signing, before the arm gives up


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (each one peer, one connection)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per arm (after 1 s of warm-up)")
    p.add_argument("--workers", type=int, default=4, help="client processes the clients are spread over")


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (all cores; idle and iowait excluded)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class _Http:
    """One keep-alive HTTP/1.1 connection that posts prebuilt bodies and reads the answers (status only)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.head = f"POST /api/reports HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        self.sock: socket.socket | None = None

    def post(self, body: bytes) -> int:
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.rfile = self.sock.makefile("rb")
        self.sock.sendall(f"{self.head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        status_line = self.rfile.readline(1024)
        if not status_line:
            raise ConnectionError("server closed the connection")
        status, length, close = int(status_line.split()[1]), 0, False
        while (line := self.rfile.readline(8192)) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
            elif name.lower() == b"connection" and value.strip().lower() == b"close":
                close = True
        self.rfile.read(length)
        if close:
            self.close()
        return status

    def close(self) -> None:
        if self.sock is not None:
            self.rfile.close()
            self.sock.close()
            self.sock = None


def _client(port: int, threads: int, prebuilt: int, seconds: float, ready: Any, go: Any, start: Any,
            out: Any) -> None:
    """Worker process: `threads` peers posting signed heartbeats; returns its CPU seconds in the measured window
    and (latency, ok, peer, nonce) per request sent in it."""
    from swarmloco.protocol.trust.identity import Identity
    from swarmloco.protocol.trust.reports import build_report

    def sign(me: Identity, n: int, tokens: int) -> tuple[bytes, str, str]:
        report = build_report(me, RUN_ID, "heartbeat", {"tokens_total": tokens, "round": n})
        return report.encode(), report.peer_id, report.nonce

    peers = [Identity(path=Path("<memory>"), private_key=Identity.generate()) for _ in range(threads)]
    signed = [[sign(me, n, 1000 * (k + 1)) for k in range(prebuilt)] for n, me in enumerate(peers)]
    ready.put(os.getpid())
    if not go.wait(READY_TIMEOUT_S):
        out.put((0.0, 0, []))
        return
    measure_at, stop_at = start.value + 1.0, start.value + 1.0 + seconds
    results: list[tuple[float, bool, str, str]] = []
    lock = threading.Lock()
    live = [0]

    def one(n: int) -> None:
        me, pending, http = peers[n], signed[n], _Http(port)
        mine: list[tuple[float, bool, str, str]] = []
        k = len(pending)
        while time.time() < stop_at:
            if pending:
                body, peer, nonce = pending.pop(0) if len(pending) > 1 else pending.pop()
            else:  # ran out of prebuilt reports: sign on the fly (counted, it slows the client)
                k += 1
                body, peer, nonce = sign(me, n, 1000 * k)
                live[0] += 1
            sent = time.monotonic()
            try:
                ok = http.post(body) == 200
            except (OSError, ValueError, IndexError):
                http.close()
                ok = False
            if time.time() >= measure_at:
                mine.append((time.monotonic() - sent, ok, peer, nonce))
        http.close()
        with lock:
            results.extend(mine)

    cpu: list[float] = []

    def meter() -> None:  # this process's CPU seconds over the measured window
        for at in (measure_at, stop_at):
            time.sleep(max(0.0, at - time.time()))
            cpu.append(time.process_time())

    pool = [threading.Thread(target=one, args=(i,)) for i in range(threads)] + [threading.Thread(target=meter)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    out.put((cpu[1] - cpu[0], live[0], results))


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
    ready, out, go, start = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    per = [args.clients // args.workers + (i < args.clients % args.workers) for i in range(args.workers)]
    prebuilt = max(50, math.ceil(PREBUILT_PER_S * (args.seconds + 1.0) / args.clients))
    procs = [ctx.Process(target=_client, args=(server.port, n, prebuilt, args.seconds, ready, go, start, out))
             for n in per if n]
    results: list[tuple[float, bool, str, str]] = []
    client_cpu, live = 0.0, 0
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=READY_TIMEOUT_S)
        start.value = time.time() + 0.2
        go.set()
        time.sleep(max(0.0, start.value + 1.0 - time.time()))
        first, cpu0, busy0 = server.store.commits, time.process_time(), machine_busy_s()  # the measured window
        time.sleep(max(0.0, start.value + 1.0 + args.seconds - time.time()))
        commits = server.store.commits - first
        server_cpu, busy = time.process_time() - cpu0, machine_busy_s() - busy0
        for _ in procs:
            cpu, built, mine = out.get(timeout=args.seconds + 120)
            client_cpu, live, results = client_cpu + cpu, live + built, results + mine
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
            "lost": sum((peer, nonce) not in stored for _, peer, nonce in acked),
            "server_cores": server_cpu / args.seconds, "client_cores": client_cpu / args.seconds,
            "machine_cores": busy / args.seconds, "server_us_per_report": 1e6 * server_cpu / max(1, len(acked)),
            "signed_live": live}


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
             a["failed"], a["lost"], a["server_cores"], a["server_us_per_report"], a["client_cores"],
             a["machine_cores"]] for a in arms]
    print(table("Coordinator ingest: durable reports per second (acknowledged = fsynced)",
                ["store", "clients", "reports/s", "× one per report", "p50 ms", "p99 ms", "commits",
                 "reports per commit", "failed", "acknowledged but lost", "server cores", "server CPU µs/report",
                 "client cores", "machine cores"], rows,
                notes=[f"{args.seconds:g} s measured per arm after 1 s of warm-up; signed heartbeat reports (signed "
                       "before the window), each client a peer of its own on one keep-alive connection, one report "
                       "per request; server and clients share the machine",
                       "lost: acknowledged reports missing from the database reopened after the arm",
                       "cores: CPU seconds per measured second of the server process, the client processes and the "
                       f"whole machine ({os.cpu_count()} cores); reports signed live: "
                       f"{', '.join(str(a['signed_live']) for a in arms)}"]))
    write_json(args.json, {"benchmark": "ingest", "arms": arms})
    return 0 if all(a["lost"] == 0 for a in arms) and group["acknowledged"] > 0 else 1

"""Durability: SIGKILL the coordinator while peers stream reports, restart it, lose nothing."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from _coordinator_helpers import kill, make_identities, round_body, spawn_coordinator
from _ticket_helpers import admit_all, certificate, certified_round_body

from swarmloco.peer.report_sender import ReportSender, ReportSenderConfig
from swarmloco.protocol.trust.reports import Report

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]

PEERS, REPORTS_PER_PEER = 3, 120


def test_sigkill_mid_stream_loses_nothing_acknowledged(tmp_path: Path) -> None:
    db, ready = tmp_path / "runs.sqlite", tmp_path / "ready.json"
    ids = make_identities(tmp_path / "ids", PEERS)
    proc, info = spawn_coordinator(db, ready, "--no-dht", "--run-id", "durable")
    # invite-only (the default), with the code the coordinator generated and wrote into its ready file; tickets are
    # in the database too: they outlive the SIGKILL
    tickets = admit_all(info["url"], ids, "durable", invite=info["invite"])
    acked: dict[str, int] = {}
    lock = threading.Lock()

    def on_result(report: Report, status: int) -> None:
        with lock:
            acked[report.nonce] = status

    config = ReportSenderConfig(backoff_initial_s=0.05, backoff_max_s=0.5, heartbeat_interval_s=0,
                                connect_timeout_s=1.0, read_timeout_s=2.0)
    reporters = [ReportSender(info["url"], i, "durable", config=config, on_result=on_result).start() for i in ids]
    members = [i.peer_id for i in ids]
    certs = {r: certificate(ids, tickets, run_id="durable", round=r) for r in range(1, REPORTS_PER_PEER // 10 + 1)}
    rounds_sent = [0] * PEERS

    def produce(k: int) -> None:
        for step in range(REPORTS_PER_PEER):
            if step % 10 == 9:
                number = step // 10 + 1
                assert reporters[k].report_round(**certified_round_body(round_body(number, members), certs[number]))
                rounds_sent[k] += 1
            else:
                assert reporters[k].report_metrics(step=step, train_loss=2.0, tokens_per_s=50.0,
                                                   tokens_total=step * 64)
            time.sleep(0.01)

    producers = [threading.Thread(target=produce, args=(k,)) for k in range(PEERS)]
    try:
        for t in producers:
            t.start()
        deadline = time.monotonic() + 20
        while len(acked) < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        kill(proc, signal.SIGKILL)  # mid-stream: writes and responses are in flight
        with lock:
            acked_before_kill = dict(acked)
        assert len(acked_before_kill) >= 40
        time.sleep(0.5)  # peers keep producing into their buffers meanwhile
        proc, again = spawn_coordinator(db, ready, "--no-dht", "--run-id", "durable", port=info["port"])
        assert again["url"] == info["url"] and again["invite"] == info["invite"]  # the code survives a restart
        for t in producers:
            t.join(timeout=60)
        for r in reporters:
            assert r.flush(timeout=30), f"{r.stats}"
    finally:
        for r in reporters:
            r.close(timeout=5, reason=None)
        kill(proc, signal.SIGTERM)

    total = PEERS * REPORTS_PER_PEER
    assert all(s == 200 for s in acked.values()) and len(acked) == total
    assert all(r.stats.acknowledged == REPORTS_PER_PEER and r.stats.rejected == 0 for r in reporters)
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        stored = {n for (n,) in conn.execute("SELECT nonce FROM reports")}
        assert set(acked_before_kill) <= stored, "a report acknowledged before the kill is missing"
        assert stored == set(acked)
        assert conn.execute("SELECT COUNT(*) FROM reports").fetchone()[0] == total
        assert conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0] == total - sum(rounds_sent)
        assert conn.execute("SELECT COUNT(*) FROM round_reports").fetchone()[0] == sum(rounds_sent)
        assert conn.execute("SELECT COUNT(*) FROM rounds WHERE certificate IS NOT NULL").fetchone()[0] == len(certs)
    finally:
        conn.close()

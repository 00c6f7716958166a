"""The store's ledger of reports: everything one report writes, run inside the transaction of its group commit.

Mixed into :class:`swarmloco.coordinator.store.SQLiteStore`, which owns the connection and its lock, and opens the
transaction (and one savepoint per report) around :meth:`IngestTables._add_one`.
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from swarmloco.coordinator.store_accounts import AccountTables
from swarmloco.protocol.trust.certificates import Certificate
from swarmloco.protocol.trust.reports import Report

__all__ = ["IngestTables", "PendingReport", "Prefer", "StoredReport"]

Prefer = Callable[[Certificate, str], bool]  # (a new certificate, the stored one's text) -> replace it?


@dataclass(frozen=True, kw_only=True)
class StoredReport:
    """A report already in the ledger: what it contained and the answer that was given for it."""

    content_hash: str
    response: dict[str, Any]
    created: bool


@dataclass(eq=False)
class PendingReport:
    """One report to store (verified by the caller), and once its commit is over what became of it: ``result``
    when it is durable, or ``error``."""

    report: Report
    content_hash: str
    received_at: float
    certificate: Certificate | None = None
    uncredited: str = ""
    keep_reports: int | None = None
    prefer: Prefer | None = None
    result: StoredReport | None = None
    error: BaseException | None = None
    settled: bool = False


def _ledger_body(body: dict[str, Any]) -> str:
    """The body as kept in the ledger: a certificate is kept once, with its round, and referenced by digest here."""
    if body.get("certificate"):
        body = {**body, "certificate": "sha256:" + hashlib.sha256(body["certificate"].encode()).hexdigest()}
    return json.dumps(body, separators=(",", ":"))



class IngestTables(AccountTables):
    """Writes one report's rows; the caller holds the store's lock and has a savepoint open for the report."""

    _conn: sqlite3.Connection

    def _find(self, peer_id: str, nonce: str) -> StoredReport | None:
        row = self._conn.execute(
            "SELECT content_hash, response FROM reports WHERE peer_id=? AND nonce=?", (peer_id, nonce)
        ).fetchone()
        if row is None:
            return None
        return StoredReport(content_hash=row["content_hash"], response=json.loads(row["response"]), created=False)

    def _add_one(self, item: PendingReport) -> StoredReport:
        c, report = self._conn, item.report
        existing = self._find(report.peer_id, report.nonce)
        if existing is not None:
            return existing
        cur = c.execute(
            "INSERT INTO reports(peer_id, nonce, run_id, kind, timestamp, received_at, content_hash,"
            " body, response) VALUES (?,?,?,?,?,?,?,?,?)",
            (report.peer_id, report.nonce, report.run_id, report.kind, report.timestamp, item.received_at,
             item.content_hash, _ledger_body(report.body), "{}"),
        )
        report_id = int(cur.lastrowid or 0)
        response: dict[str, Any] = {"status": "stored", "report_id": report_id, "kind": report.kind,
                                    "peer_id": report.peer_id, "nonce": report.nonce}
        if report.kind == "round" and report.body["outcome"] == "committed":
            response["credited"] = item.certificate is not None
            if item.certificate is None:
                response["reason"] = item.uncredited or "no valid commit certificate"
        c.execute("UPDATE reports SET response=? WHERE id=?", (json.dumps(response), report_id))
        self._apply(report, report_id, item.received_at, item.certificate, item.prefer)
        if item.keep_reports is not None:
            self._bound(report.run_id, report.peer_id, item.keep_reports)
        return StoredReport(content_hash=item.content_hash, response=response, created=True)

    def _apply(self, r: Report, report_id: int, now: float, certificate: Certificate | None,
               prefer: Prefer | None) -> None:
        c, b = self._conn, r.body
        c.execute("INSERT INTO runs(run_id, created_at, last_seen) VALUES (?,?,?) "
                  "ON CONFLICT(run_id) DO UPDATE SET last_seen=MAX(last_seen, excluded.last_seen)",
                  (r.run_id, now, now))
        c.execute("INSERT INTO peers(run_id, peer_id, joined_at, last_seen) VALUES (?,?,?,?) "
                  "ON CONFLICT(run_id, peer_id) DO UPDATE SET last_seen=MAX(last_seen, excluded.last_seen), "
                  "left_at=NULL",
                  (r.run_id, r.peer_id, now, now))
        key = (r.run_id, r.peer_id)
        if r.kind == "hello":
            c.execute("UPDATE peers SET version=?, device=?, memory_bytes=?, tokens_per_s=? "
                      "WHERE run_id=? AND peer_id=?",
                      (b["version"], b["device"], b["memory_bytes"], b["tokens_per_s"], *key))
            self._account(r, device_kind=b.get("device_kind") or self._kind_of(b["device"]))
            self._account_work(r)
        elif r.kind == "bye":
            c.execute("UPDATE peers SET left_at=? WHERE run_id=? AND peer_id=?", (now, *key))
        elif r.kind == "heartbeat":
            if b.get("tokens_total") is not None:
                c.execute("UPDATE peers SET tokens_total=MAX(tokens_total, ?) WHERE run_id=? AND peer_id=?",
                          (b["tokens_total"], *key))
        elif r.kind == "metrics":
            c.execute("INSERT INTO metrics(report_id, run_id, peer_id, timestamp, step, train_loss, eval_loss,"
                      " tokens_per_s, tokens_total) VALUES (?,?,?,?,?,?,?,?,?)",
                      (report_id, *key, r.timestamp, b["step"], b["train_loss"], b.get("eval_loss"),
                       b["tokens_per_s"], b["tokens_total"]))
            # An eval-only sample (no train loss, tokens_per_s 0) must not blank the peer's last training figures.
            training = b["train_loss"] is not None
            c.execute("UPDATE peers SET tokens_total=MAX(tokens_total, ?), "
                      "last_train_loss=COALESCE(?, last_train_loss), "
                      "last_tokens_per_s=CASE WHEN ? THEN ? ELSE last_tokens_per_s END WHERE run_id=? AND peer_id=?",
                      (b["tokens_total"], b["train_loss"], training and b["tokens_per_s"] > 0, b["tokens_per_s"], *key))
            self._account_work(r)
        elif r.kind == "round":
            self._apply_round(r, report_id, now, certificate, prefer)

    def _apply_round(self, r: Report, report_id: int, now: float, certificate: Certificate | None,
                     prefer: Prefer | None) -> None:
        c, b = self._conn, r.body
        committed = b["outcome"] == "committed"
        if committed and certificate is None:
            self._account(r)
            self._account_work(r)
            return  # the peer's own claim: kept in the ledger, but it neither creates nor credits a round
        if certificate is not None:  # members, their credited tokens and the new state: what the members signed
            s = certificate.statement
            number, state_hash, members, tokens = s.round, s.new_hash, list(s.members), list(s.credited)
        else:
            number, state_hash, members, tokens = b["round"], b["state_hash"] or "", b["members"], b["tokens"]
        # One `rounds` row per distinct (round, outcome, hash): members that disagree show up as separate rows.
        c.execute("INSERT OR IGNORE INTO rounds(run_id, round, outcome, state_hash, members, tokens, "
                  "first_reported_at) VALUES (?,?,?,?,?,?,?)",
                  (r.run_id, number, b["outcome"], state_hash, json.dumps(members), json.dumps(tokens), r.timestamp))
        round_id = c.execute("SELECT id FROM rounds WHERE run_id=? AND round=? AND outcome=? AND state_hash=?",
                             (r.run_id, number, b["outcome"], state_hash)).fetchone()[0]
        if certificate is not None:  # also certifies a row recorded from a claim before certificates existed
            certified = c.execute("UPDATE rounds SET certificate=?, members=?, tokens=? WHERE id=? AND "
                                  "certificate IS NULL", (certificate.to_bytes().decode(), json.dumps(members),
                                                          json.dumps(tokens), round_id)).rowcount
            old = None if certified else c.execute("SELECT certificate, members, tokens FROM rounds WHERE id=?",
                                                   (round_id,)).fetchone()
            if old is not None and prefer is not None and old[0] != certificate.to_bytes().decode() and \
                    prefer(certificate, old[0]):  # a certificate of this state that outranks the one kept
                c.execute("UPDATE rounds SET certificate=?, members=?, tokens=? WHERE id=?",
                          (certificate.to_bytes().decode(), json.dumps(members), json.dumps(tokens), round_id))
                self._credit(r.run_id, json.loads(old[1]), [-t for t in json.loads(old[2])])
                replaced = Certificate.from_bytes(old[0].encode()).statement
                self._account_certified(r.run_id, round_id, replaced, now, sign=-1)
                certified = 1
            if certified:  # credited once, by the report that brought the certificate kept
                self._credit(r.run_id, members, tokens)
                self._account_certified(r.run_id, round_id, certificate.statement, now, at=r.timestamp)
        first = c.execute("SELECT 1 FROM round_reports WHERE round_id=? AND peer_id=?",
                          (round_id, r.peer_id)).fetchone() is None
        c.execute("INSERT INTO round_reports(round_id, report_id, peer_id, timestamp, train_s, wait_s, average_s,"
                  " eval_loss, failure_reason) VALUES (?,?,?,?,?,?,?,?,?)",
                  (round_id, report_id, r.peer_id, r.timestamp, b["train_s"], b["wait_s"], b["average_s"],
                   b.get("eval_loss"), b.get("failure_reason")))
        if committed and first:  # a member is credited once per round, however often it reports it
            c.execute("UPDATE peers SET rounds_committed=rounds_committed+1 WHERE run_id=? AND peer_id=?",
                      (r.run_id, r.peer_id))
        self._account_round(r, first=first, credited=certificate is not None)

    def _credit(self, run_id: str, members: Sequence[str], tokens: Sequence[int]) -> None:
        """Add each member's credited tokens of one certified round to the ledger (negative: take them back)."""
        self._conn.executemany(
            "INSERT INTO credits(run_id, peer_id, tokens, rounds) VALUES (?,?,?,?) ON CONFLICT DO UPDATE SET "
            "tokens=tokens+excluded.tokens, rounds=rounds+excluded.rounds",
            [(run_id, m, t, (t > 0) - (t < 0)) for m, t in zip(members, tokens, strict=True)])

    def _bound(self, run_id: str, peer_id: str, keep: int) -> None:
        """Keep at most about ``keep`` reports of one peer in one run: prune the oldest (with their metrics and
        round rows) in batches of a tenth, so the cost is paid once per batch rather than on every report."""
        c, key = self._conn, (run_id, peer_id)
        c.execute("UPDATE peers SET stored_reports=stored_reports+1 WHERE run_id=? AND peer_id=?", key)
        stored = c.execute("SELECT stored_reports FROM peers WHERE run_id=? AND peer_id=?", key).fetchone()[0]
        if stored <= keep + max(1, keep // 10):
            return
        row = c.execute("SELECT id FROM reports WHERE run_id=? AND peer_id=? ORDER BY id DESC LIMIT 1 OFFSET ?",
                        (*key, keep)).fetchone()
        if row is not None:
            old, args = "SELECT id FROM reports WHERE run_id=? AND peer_id=? AND id<=?", (*key, row[0])
            c.execute(f"DELETE FROM metrics WHERE report_id IN ({old})", args)
            touched = [r[0] for r in c.execute(f"SELECT round_id FROM round_reports WHERE report_id IN ({old})", args)]
            c.execute(f"DELETE FROM round_reports WHERE report_id IN ({old})", args)
            c.execute("DELETE FROM reports WHERE run_id=? AND peer_id=? AND id<=?", args)
            # Rounds nobody reports any more go too, unless certified: those are the run's history.
            for round_id in set(touched):
                c.execute("DELETE FROM rounds WHERE id=? AND certificate IS NULL AND NOT EXISTS "
                          "(SELECT 1 FROM round_reports WHERE round_id=?)", (round_id, round_id))
        count = c.execute("SELECT COUNT(*) FROM reports WHERE run_id=? AND peer_id=?", key).fetchone()[0]
        c.execute("UPDATE peers SET stored_reports=? WHERE run_id=? AND peer_id=?", (count, *key))

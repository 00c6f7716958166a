"""Progress store: the only place that speaks SQL.

:class:`Store` is the interface the service uses (runs, peers, rounds, metrics, the report ledger, and the
authority's tickets and revocations in :mod:`swarmloco.coordinator.store_authority`); the embedded default
:class:`SQLiteStore` keeps everything in one SQLite file in WAL mode with ``synchronous=FULL``, so a report
acknowledged with a 2xx has been fsynced. Schema changes are numbered migrations tracked by ``PRAGMA user_version``;
``PRAGMA integrity_check`` runs at start-up and refuses a damaged file. Each report is stored in a single
transaction: either every row it implies is written, or none; reports that arrive together share one commit (and
one fsync). A committed round exists only with its commit certificate, kept once in its ``rounds`` row.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from swarmloco.coordinator.migrations import MIGRATIONS
from swarmloco.coordinator.store_accounts import AccountTables
from swarmloco.coordinator.store_aggregates import Aggregates
from swarmloco.coordinator.store_authority import AuthorityTables, IssuedTicket
from swarmloco.coordinator.store_checkpoints import CheckpointTables
from swarmloco.coordinator.store_listings import Listings, Page
from swarmloco.protocol.base.text import bounded
from swarmloco.protocol.trust.certificates import Certificate
from swarmloco.protocol.trust.reports import Report

__all__ = ["Page", "SQLiteStore", "Store", "StoreError", "StoredReport"]

logger = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """The database cannot be used (damaged, newer schema, unwritable)."""


@dataclass(frozen=True, kw_only=True)
class StoredReport:
    """A report already in the ledger: what it contained and the answer that was given for it."""

    content_hash: str
    response: dict[str, Any]
    created: bool


Prefer = Callable[[Certificate, str], bool]  # (a new certificate, the stored one's text) -> replace it?


@dataclass(eq=False)
class _Pending:
    """One report waiting for the next group commit, and what became of it."""

    report: Report
    content_hash: str
    received_at: float
    certificate: Certificate | None
    uncredited: str
    keep_reports: int | None
    prefer: Prefer | None
    result: StoredReport | None = None
    error: BaseException | None = None
    settled: bool = False


class Store(Protocol):
    """What the coordinator needs from a database; an implementation must make :meth:`add_report` atomic."""

    def find_report(self, peer_id: str, nonce: str) -> StoredReport | None: ...
    def add_report(self, report: Report, *, content_hash: str, received_at: float,
                   certificate: Certificate | None = None, uncredited: str = "",
                   keep_reports: int | None = None, prefer: Prefer | None = None) -> StoredReport: ...
    def ensure_run(self, run_id: str, now: float) -> None: ...
    def has_run(self, run_id: str) -> bool: ...
    def run_count(self) -> int: ...
    def add_ticket(self, ticket: IssuedTicket, *, prune_expired_before: float) -> None: ...
    def find_ticket_request(self, peer_id: str, nonce: str) -> IssuedTicket | None: ...
    def latest_ticket(self, run_id: str, peer_id: str) -> IssuedTicket | None: ...
    def ticket_expiry(self, run_id: str, peer_id: str) -> float | None: ...
    def revoke(self, peer_id: str, *, reason: str, now: float, max_revoked: int) -> tuple[bool, int]: ...
    def unrevoke(self, peer_id: str, *, now: float) -> tuple[bool, int]: ...
    def revocation_serial(self) -> int: ...
    def revoked(self) -> tuple[int, frozenset[str]]: ...
    def is_revoked(self, peer_id: str) -> bool: ...
    def list_runs(self, *, limit: int, cursor: int | None, descending: bool) -> Page: ...
    def list_peers(self, *, run_id: str | None, peer_id: str | None, limit: int, cursor: int | None,
                   descending: bool) -> Page: ...
    def list_rounds(self, *, run_id: str | None, peer_id: str | None, limit: int, cursor: int | None,
                    descending: bool) -> Page: ...
    def list_metrics(self, *, run_id: str | None, peer_id: str | None, limit: int, cursor: int | None,
                     descending: bool) -> Page: ...
    def peers_online(self, since: float) -> int: ...
    def rounds_by_outcome(self) -> dict[str, int]: ...
    def tokens_total(self) -> int: ...
    def credited_tokens(self) -> int: ...
    def device_seconds(self, run_id: str | None = None) -> list[tuple[str, bool, float, float]]: ...
    def account_totals(self, run_id: str | None = None, *, online_since: float = 0.0) -> dict[str, float]: ...
    def certified_progress(self, run_id: str, limit: int) -> list[dict[str, Any]]: ...
    def certified_after(self, run_id: str, after: int, limit: int) -> list[str]: ...
    def online_peers(self, run_id: str, since: float) -> list[str]: ...
    def latest_checkpoint(self, run_id: str) -> dict[str, Any] | None: ...
    def save_checkpoint(self, run_id: str, value: dict[str, Any]) -> None: ...
    def round_duration_histogram(self, edges: Sequence[float]) -> tuple[list[int], int, float]: ...
    def counts(self) -> dict[str, int]: ...
    def integrity_check(self) -> str: ...
    def close(self) -> None: ...


def _ledger_body(body: dict[str, Any]) -> str:
    """The body as kept in the ledger: a certificate is kept once, with its round, and referenced by digest here."""
    if body.get("certificate"):
        body = {**body, "certificate": "sha256:" + hashlib.sha256(body["certificate"].encode()).hexdigest()}
    return json.dumps(body, separators=(",", ":"))


class SQLiteStore(AuthorityTables, CheckpointTables, AccountTables, Listings, Aggregates):
    """SQLite implementation of :class:`Store`; thread-safe through one connection guarded by a lock."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 10.0, group_commit: bool = True,
                 online_window_s: float = 60.0) -> None:
        self.path = Path(path)
        self.online_window_s = online_window_s  # who counts as online when a round is certified (missed rounds)
        self.group_commit = group_commit  # False: one transaction per report (the benchmark's baseline)
        self._lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queue: list[_Pending] = []  # reports waiting for the next group commit
        self.commits = 0  # group commits written (each one transaction, one fsync)
        try:
            self._conn = sqlite3.connect(
                str(self.path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as e:
            raise StoreError(f"cannot open database {self.path}: {e}") from None
        self._conn.row_factory = sqlite3.Row
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            result = self.integrity_check()
            if result != "ok":
                raise StoreError(f"database {self.path} failed PRAGMA integrity_check: {bounded(result, 500)}; "
                                 f"restore a backup or start with a new --db file")
            self._migrate()
        except sqlite3.Error as e:
            self._conn.close()
            raise StoreError(f"database {self.path} is unusable: {e}") from None
        except StoreError:
            self._conn.close()
            raise

    # -- lifecycle -------------------------------------------------------------------------------------------

    def _migrate(self) -> None:
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if version > len(MIGRATIONS):
            raise StoreError(f"database {self.path} has schema version {version}, this coordinator knows only "
                             f"up to {len(MIGRATIONS)}; upgrade swarmloco")
        for target, script in enumerate(MIGRATIONS[version:], start=version + 1):
            logger.info("migrating %s to schema version %d", self.path, target)
            # executescript commits first; the whole migration then runs as one transaction
            self._conn.executescript(f"BEGIN IMMEDIATE;\n{script}\nPRAGMA user_version={target};\nCOMMIT;")

    def integrity_check(self) -> str:
        with self._lock:
            rows = self._conn.execute("PRAGMA integrity_check").fetchall()
        return "\n".join(str(r[0]) for r in rows)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # -- ingest ----------------------------------------------------------------------------------------------

    def find_report(self, peer_id: str, nonce: str) -> StoredReport | None:
        with self._lock:
            return self._find(peer_id, nonce)

    def _find(self, peer_id: str, nonce: str) -> StoredReport | None:
        row = self._conn.execute(
            "SELECT content_hash, response FROM reports WHERE peer_id=? AND nonce=?", (peer_id, nonce)
        ).fetchone()
        if row is None:
            return None
        return StoredReport(content_hash=row["content_hash"], response=json.loads(row["response"]), created=False)

    def ensure_run(self, run_id: str, now: float) -> None:
        with self._lock:
            self._conn.execute("INSERT OR IGNORE INTO runs(run_id, created_at, last_seen) VALUES (?,?,?)",
                               (run_id, now, now))

    def has_run(self, run_id: str) -> bool:
        with self._lock:
            return self._conn.execute("SELECT 1 FROM runs WHERE run_id=?", (run_id,)).fetchone() is not None

    def run_count(self) -> int:
        return int(self._scalar("SELECT COUNT(*) FROM runs"))

    def add_report(self, report: Report, *, content_hash: str, received_at: float,
                   certificate: Certificate | None = None, uncredited: str = "",
                   keep_reports: int | None = None, prefer: Prefer | None = None) -> StoredReport:
        """Store a report and everything it implies atomically; a known (peer, nonce) is returned as is.

        A committed round report creates and credits its round only with ``certificate`` (verified by the caller,
        and matching the report); without one it is kept as the peer's claim, and ``uncredited`` says why. A round
        keeps its first certificate unless ``prefer(new, stored)`` says the new one outranks it: then the round's
        members and credit become the new certificate's. ``keep_reports`` bounds the ledger per peer and run: the
        oldest reports beyond it are pruned.

        Group commit: reports that arrive while another commit is being written wait for it, and are then
        committed together, in one transaction and one fsync. Each caller returns only once the commit that holds
        its report is durable. Each report runs in a savepoint of its own: one that fails leaves the others in."""
        item = _Pending(report, content_hash, received_at, certificate, uncredited, keep_reports, prefer)
        with self._queue_lock:
            self._queue.append(item)
        with self._lock:
            if not item.settled:  # nobody committed it while we waited: commit everything queued so far
                with self._queue_lock:
                    batch = self._queue if self.group_commit else [item]
                    self._queue = [] if self.group_commit else [q for q in self._queue if q is not item]
                self._commit(batch)
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def _commit(self, batch: list[_Pending]) -> None:
        c = self._conn
        try:
            c.execute("BEGIN IMMEDIATE")
            for item in batch:
                c.execute("SAVEPOINT report")
                try:
                    item.result = self._add_one(item)
                    c.execute("RELEASE report")
                except Exception as exc:  # this report's rows go; the batch goes on
                    c.execute("ROLLBACK TO report")
                    c.execute("RELEASE report")
                    item.error = exc
            c.execute("COMMIT")
            self.commits += 1
        except BaseException as exc:  # nothing of the batch is durable: every caller hears so
            if c.in_transaction:
                c.execute("ROLLBACK")
            for item in batch:
                item.result, item.error = None, item.error or exc
        finally:
            for item in batch:
                item.settled = True

    def _add_one(self, item: _Pending) -> StoredReport:
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

    def nonces(self) -> Iterable[tuple[str, str]]:
        """Every (peer_id, nonce) in the ledger; for tests and audits."""
        with self._lock:
            return [(r[0], r[1]) for r in self._conn.execute("SELECT peer_id, nonce FROM reports")]

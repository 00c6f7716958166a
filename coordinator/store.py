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

import logging
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from swarmloco.coordinator.migrations import MIGRATIONS
from swarmloco.coordinator.store_aggregates import Aggregates
from swarmloco.coordinator.store_authority import AuthorityTables, IssuedTicket
from swarmloco.coordinator.store_checkpoints import CheckpointTables
from swarmloco.coordinator.store_ingest import IngestTables, PendingReport, Prefer, StoredReport
from swarmloco.coordinator.store_listings import Listings, Page
from swarmloco.protocol.base.text import bounded
from swarmloco.protocol.trust.certificates import Certificate
from swarmloco.protocol.trust.reports import Report

__all__ = ["Page", "PendingReport", "Prefer", "SQLiteStore", "Store", "StoreBusy", "StoreError", "StoredReport"]

logger = logging.getLogger(__name__)


MAX_QUEUED = 10_000  # reports waiting for a group commit; more are refused with StoreBusy


class StoreError(RuntimeError):
    """The database cannot be used (damaged, newer schema, unwritable)."""


class StoreBusy(StoreError):
    """Too many reports wait for a commit already: retry later."""


class Store(Protocol):
    """What the coordinator needs from a database; an implementation must make :meth:`add_report` atomic."""

    def find_report(self, peer_id: str, nonce: str) -> StoredReport | None: ...
    def add_report(self, report: Report, *, content_hash: str, received_at: float,
                   certificate: Certificate | None = None, uncredited: str = "",
                   keep_reports: int | None = None, prefer: Prefer | None = None) -> StoredReport: ...
    def add_reports(self, items: Sequence[PendingReport]) -> None: ...
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


class SQLiteStore(AuthorityTables, CheckpointTables, IngestTables, Listings, Aggregates):
    """SQLite implementation of :class:`Store`; thread-safe through one connection guarded by a lock."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 10.0, group_commit: bool = True,
                 online_window_s: float = 60.0) -> None:
        self.path = Path(path)
        self.online_window_s = online_window_s  # who counts as online when a round is certified (missed rounds)
        self.group_commit = group_commit  # False: one transaction per report (the benchmark's baseline)
        self._lock = threading.Lock()
        self._queued = threading.Condition()  # guards the queue; callers wait on it for their report's commit
        self._queue: list[PendingReport] = []  # reports waiting for the next group commit, at most MAX_QUEUED
        self._writing = False  # a caller of add_report is committing a batch
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
        its report is durable. Each report runs in a savepoint of its own: one that fails leaves the others in.
        A caller whose report another caller committed is woken by that caller, without taking the store's lock."""
        item = PendingReport(report=report, content_hash=content_hash, received_at=received_at,
                             certificate=certificate, uncredited=uncredited, keep_reports=keep_reports, prefer=prefer)
        with self._queued:
            if len(self._queue) >= MAX_QUEUED:
                raise StoreBusy(f"{len(self._queue)} reports already wait for a commit; retry later")
            self._queue.append(item)
            while not item.settled and self._writing:  # another caller commits; ours goes in its next batch
                self._queued.wait()
            writer = not item.settled
            self._writing = self._writing or writer
        if writer:  # no commit in progress: this caller commits everything queued once it holds the lock
            try:
                with self._lock:
                    with self._queued:
                        batch = self._queue if self.group_commit else [item]
                        self._queue = [] if self.group_commit else [q for q in self._queue if q is not item]
                    self._commit(batch)
            finally:
                with self._queued:
                    self._writing = False
                    self._queued.notify_all()
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def add_reports(self, items: Sequence[PendingReport]) -> None:
        """Store reports together: one transaction and one fsync for all of them (one each without group commit),
        each in a savepoint of its own. Returns once they are durable; each item's ``result`` or ``error`` says
        what became of it. For a caller that batches reports itself (coordinator/ingest.py)."""
        with self._lock:
            if self.group_commit:
                self._commit(list(items))
            else:
                for item in items:
                    self._commit([item])

    def _commit(self, batch: list[PendingReport]) -> None:
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

    def nonces(self) -> Iterable[tuple[str, str]]:
        """Every (peer_id, nonce) in the ledger; for tests and audits."""
        with self._lock:
            return [(r[0], r[1]) for r in self._conn.execute("SELECT peer_id, nonce FROM reports")]

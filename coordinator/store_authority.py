"""The store's authority tables: tickets the coordinator issued and the peers it revoked.

Revocations are written by ``swarmloco coordinator revoke`` from another process while the server runs; both open
the same SQLite file (WAL), and every read here sees the latest committed state. Each revoke or unrevoke appends to
``revocation_events``, whose AUTOINCREMENT id therefore only grows: it is the signed list's serial, so a newer list
always outranks an older one.
"""
from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass

__all__ = ["AuthorityTables", "IssuedTicket"]


@dataclass(frozen=True, kw_only=True)
class IssuedTicket:
    """One row of the ticket ledger."""

    run_id: str
    peer_id: str
    role: str
    issued_at: float
    expires_at: float
    nonce: str
    request_hash: str
    client: str
    ticket: str


_TICKET_COLUMNS = "run_id, peer_id, role, issued_at, expires_at, nonce, request_hash, client, ticket"


class AuthorityTables:
    """Mixed into :class:`swarmloco.coordinator.store.SQLiteStore`, which owns the connection and its lock."""

    _conn: sqlite3.Connection
    _lock: threading.Lock

    # -- tickets ---------------------------------------------------------------------------------------------

    def add_ticket(self, ticket: IssuedTicket, *, prune_expired_before: float) -> None:
        """Record an issued ticket; tickets that expired before ``prune_expired_before`` are forgotten."""
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                c.execute(f"INSERT INTO tickets({_TICKET_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)",
                          (ticket.run_id, ticket.peer_id, ticket.role, ticket.issued_at, ticket.expires_at,
                           ticket.nonce, ticket.request_hash, ticket.client, ticket.ticket))
                c.execute("DELETE FROM tickets WHERE expires_at < ?", (prune_expired_before,))
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

    def _ticket_row(self, sql: str, args: tuple[object, ...]) -> IssuedTicket | None:
        with self._lock:
            row = self._conn.execute(f"SELECT {_TICKET_COLUMNS} FROM tickets {sql}", args).fetchone()
        return None if row is None else IssuedTicket(**dict(row))

    def find_ticket_request(self, peer_id: str, nonce: str) -> IssuedTicket | None:
        """The ticket issued for the request ``(peer_id, nonce)``, if any."""
        return self._ticket_row("WHERE peer_id=? AND nonce=?", (peer_id, nonce))

    def latest_ticket(self, run_id: str, peer_id: str) -> IssuedTicket | None:
        """The ticket of ``peer_id`` for ``run_id`` that expires last."""
        return self._ticket_row("WHERE run_id=? AND peer_id=? ORDER BY expires_at DESC LIMIT 1", (run_id, peer_id))

    def ticket_expiry(self, run_id: str, peer_id: str) -> float | None:
        """When the last ticket of ``peer_id`` for ``run_id`` expires (None: it never had one)."""
        with self._lock:
            row = self._conn.execute("SELECT MAX(expires_at) FROM tickets WHERE run_id=? AND peer_id=?",
                                     (run_id, peer_id)).fetchone()
        return None if row[0] is None else float(row[0])

    # -- revocations -----------------------------------------------------------------------------------------

    def _log_event(self, peer_id: str, action: str, reason: str, now: float) -> int:
        cur = self._conn.execute("INSERT INTO revocation_events(peer_id, action, reason, at) VALUES (?,?,?,?)",
                                 (peer_id, action, reason, now))
        return int(cur.lastrowid or 0)

    def revoke(self, peer_id: str, *, reason: str, now: float, max_revoked: int) -> tuple[bool, int]:
        """Revoke ``peer_id``; returns (whether it was not revoked before, the list's serial now).

        :raises ValueError: when ``max_revoked`` peers are revoked already
        """
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                known = c.execute("SELECT 1 FROM revoked WHERE peer_id=?", (peer_id,)).fetchone() is not None
                if not known and c.execute("SELECT COUNT(*) FROM revoked").fetchone()[0] >= max_revoked:
                    raise ValueError(f"{max_revoked} peers are revoked already, the most a signed list can hold")
                if known:
                    c.execute("UPDATE revoked SET reason=? WHERE peer_id=?", (reason, peer_id))
                    serial = self._serial()
                else:
                    c.execute("INSERT INTO revoked(peer_id, reason, revoked_at) VALUES (?,?,?)",
                              (peer_id, reason, now))
                    serial = self._log_event(peer_id, "revoke", reason, now)
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        return not known, serial

    def unrevoke(self, peer_id: str, *, now: float) -> tuple[bool, int]:
        """Lift the revocation of ``peer_id``; returns (whether it was revoked, the list's serial now)."""
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                known = c.execute("DELETE FROM revoked WHERE peer_id=?", (peer_id,)).rowcount > 0
                serial = self._log_event(peer_id, "unrevoke", "", now) if known else self._serial()
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        return known, serial

    def _serial(self) -> int:
        return int(self._conn.execute("SELECT COALESCE(MAX(id), 0) FROM revocation_events").fetchone()[0])

    def revocation_serial(self) -> int:
        with self._lock:
            return self._serial()

    def revoked(self) -> tuple[int, frozenset[str]]:
        """The list's serial and the revoked peer ids, read together."""
        with self._lock:
            c = self._conn
            c.execute("BEGIN")
            try:
                serial = self._serial()
                ids = frozenset(r[0] for r in c.execute("SELECT peer_id FROM revoked"))
            finally:
                c.execute("COMMIT")
        return serial, ids

    def is_revoked(self, peer_id: str) -> bool:
        with self._lock:
            return self._conn.execute("SELECT 1 FROM revoked WHERE peer_id=?", (peer_id,)).fetchone() is not None

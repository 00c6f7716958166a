"""The store's checkpoint tables: the certified rounds a checkpoint is built from, who is online, and the newest
checkpoint the authority signed (kept so that a restarted coordinator extends it rather than starting over)."""
from __future__ import annotations

import json
import sqlite3
import threading
from typing import Any

__all__ = ["CheckpointTables"]


class CheckpointTables:
    """Mixed into :class:`swarmloco.coordinator.store.SQLiteStore`, which owns the connection and its lock."""

    _conn: sqlite3.Connection
    _lock: threading.Lock

    def certified_after(self, run_id: str, after: int, limit: int) -> list[str]:
        """The certificates of certified rounds after round `after`, newest first, at most `limit`."""
        with self._lock:
            rows = self._conn.execute("SELECT certificate FROM rounds WHERE run_id=? AND round>? AND certificate IS "
                                      "NOT NULL ORDER BY round DESC LIMIT ?", (run_id, after, limit)).fetchall()
        return [r[0] for r in rows]

    def online_peers(self, run_id: str, since: float) -> list[str]:
        with self._lock:
            rows = self._conn.execute("SELECT peer_id FROM peers WHERE run_id=? AND last_seen>=? AND left_at IS NULL",
                                      (run_id, since)).fetchall()
        return [r[0] for r in rows]

    def latest_checkpoint(self, run_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM checkpoints WHERE run_id=?", (run_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def save_checkpoint(self, run_id: str, value: dict[str, Any]) -> None:
        with self._lock:
            self._conn.execute("INSERT INTO checkpoints(run_id, issued_at, value) VALUES (?,?,?) ON CONFLICT(run_id)"
                               " DO UPDATE SET issued_at=excluded.issued_at, value=excluded.value",
                               (run_id, value["issued_at"], json.dumps(value, separators=(",", ":"))))

"""The store's aggregates: counts and sums over the whole database, for `/metrics` and the tests."""
from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["Aggregates"]

_TABLES = ("runs", "peers", "reports", "metrics", "rounds", "round_reports", "tickets", "revoked")


class Aggregates:
    """Mixed into :class:`swarmloco.coordinator.store.SQLiteStore`, which owns the connection and its lock."""

    _conn: sqlite3.Connection
    _lock: threading.Lock

    def _scalar(self, sql: str, args: Sequence[Any] = ()) -> Any:
        with self._lock:
            return self._conn.execute(sql, args).fetchone()[0]

    def peers_online(self, since: float) -> int:
        return int(self._scalar("SELECT COUNT(*) FROM peers WHERE last_seen >= ? AND left_at IS NULL", (since,)))

    def rounds_by_outcome(self) -> dict[str, int]:
        with self._lock:
            rows = self._conn.execute("SELECT outcome, COUNT(*) FROM rounds GROUP BY outcome").fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def tokens_total(self) -> int:
        return int(self._scalar("SELECT TOTAL(tokens_total) FROM peers"))

    def credited_tokens(self) -> int:
        return int(self._scalar("SELECT TOTAL(tokens) FROM credits"))

    def round_duration_histogram(self, edges: Sequence[float]) -> tuple[list[int], int, float]:
        """Cumulative counts of per-peer round durations <= each edge, the total count and the sum."""
        cases = ", ".join("COALESCE(SUM(d <= ?), 0)" for _ in edges)
        sql = (f"SELECT {cases}{', ' if cases else ''}COUNT(*), COALESCE(SUM(d), 0.0) "
               "FROM (SELECT train_s + wait_s + average_s AS d FROM round_reports)")
        with self._lock:
            row = self._conn.execute(sql, list(edges)).fetchone()
        return [int(x) for x in row[:len(edges)]], int(row[len(edges)]), float(row[len(edges) + 1])

    def counts(self) -> dict[str, int]:
        return {t: int(self._scalar(f"SELECT COUNT(*) FROM {t}")) for t in _TABLES}

"""The store's listings: paged, filtered reads of runs, peers, rounds and metrics for the API and the dashboard."""
from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from typing import Any

from swarmloco.coordinator.store_accounts import ACCOUNT_COLUMNS, ACCOUNT_SELECT

__all__ = ["Listings", "Page"]


@dataclass(frozen=True, kw_only=True)
class Page:
    """One page of a listing, ordered by ``id``; pass ``next_cursor`` back as ``cursor`` for the next page."""

    items: list[dict[str, Any]]
    next_cursor: int | None


class Listings:
    """Mixed into :class:`swarmloco.coordinator.store.SQLiteStore`, which owns the connection and its lock."""

    _conn: sqlite3.Connection
    _lock: threading.Lock

    def _page(self, sql: str, where: list[str], args: list[Any], *, id_col: str, limit: int,
              cursor: int | None, descending: bool) -> list[sqlite3.Row]:
        if cursor is not None:
            where.append(f"{id_col} {'<' if descending else '>'} ?")
            args.append(cursor)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY {id_col} {'DESC' if descending else 'ASC'} LIMIT ?"
        args.append(limit)
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    @staticmethod
    def _finish(items: list[dict[str, Any]], limit: int) -> Page:
        return Page(items=items, next_cursor=items[-1]["id"] if len(items) == limit and items else None)

    @staticmethod
    def _filters(run_id: str | None, peer_id: str | None, prefix: str = "") -> tuple[list[str], list[Any]]:
        where, args = [], []
        if run_id is not None:
            where.append(f"{prefix}run_id = ?")
            args.append(run_id)
        if peer_id is not None:
            where.append(f"{prefix}peer_id = ?")
            args.append(peer_id)
        return where, args

    def list_runs(self, *, limit: int, cursor: int | None, descending: bool) -> Page:
        rows = self._page("SELECT rowid AS id, run_id, created_at, last_seen, (SELECT COUNT(*) FROM peers p "
                          "WHERE p.run_id = runs.run_id) AS peers FROM runs", [], [], id_col="rowid",
                          limit=limit, cursor=cursor, descending=descending)
        return self._finish([dict(r) for r in rows], limit)

    def list_peers(self, *, run_id: str | None, peer_id: str | None, limit: int, cursor: int | None,
                   descending: bool) -> Page:
        where, args = self._filters(run_id, peer_id)
        # credited_tokens: what certified rounds credited the peer as verified work; tokens_total is its own word
        # and what the peer's account says it contributed and cost (swarmloco.coordinator.store_accounts)
        rows = self._page(f"SELECT peers.rowid AS id, peers.*, COALESCE(k.tokens, 0) AS credited_tokens, "
                          f"COALESCE(k.rounds, 0) AS credited_rounds, {ACCOUNT_SELECT} FROM peers LEFT JOIN credits "
                          "k ON k.run_id = peers.run_id AND k.peer_id = peers.peer_id LEFT JOIN accounts a ON "
                          "a.run_id = peers.run_id AND a.peer_id = peers.peer_id",
                          [f"peers.{w}" for w in where], args, id_col="peers.rowid", limit=limit, cursor=cursor,
                          descending=descending)
        return self._finish([self._peer_item(r) for r in rows], limit)

    @staticmethod
    def _peer_item(row: sqlite3.Row) -> dict[str, Any]:
        item = dict(row)
        for col in ACCOUNT_COLUMNS:  # a peer with no account yet (it never said hello nor reported a round)
            if item[col] is None:
                item[col] = "other" if col == "device_kind" else 0
        return item

    def list_metrics(self, *, run_id: str | None, peer_id: str | None, limit: int, cursor: int | None,
                     descending: bool) -> Page:
        where, args = self._filters(run_id, peer_id)
        rows = self._page("SELECT id, run_id, peer_id, timestamp, step, train_loss, eval_loss, tokens_per_s,"
                          " tokens_total FROM metrics", where, args, id_col="id", limit=limit, cursor=cursor,
                          descending=descending)
        return self._finish([dict(r) for r in rows], limit)

    def list_rounds(self, *, run_id: str | None, peer_id: str | None, limit: int, cursor: int | None,
                    descending: bool) -> Page:
        where, args = self._filters(run_id, None)
        if peer_id is not None:
            where.append("id IN (SELECT round_id FROM round_reports WHERE peer_id = ?)")
            args.append(peer_id)
        rows = self._page("SELECT id, run_id, round, outcome, state_hash, members, tokens, first_reported_at, "
                          "certificate IS NOT NULL AS certificate FROM rounds", where, args, id_col="id",
                          limit=limit, cursor=cursor, descending=descending)
        items = [self._round_item(r) for r in rows]
        self._attach_round_reports(items)
        return self._finish(items, limit)

    @staticmethod
    def _round_item(r: sqlite3.Row) -> dict[str, Any]:
        tokens = json.loads(r["tokens"])
        return {"id": r["id"], "run_id": r["run_id"], "round": r["round"], "outcome": r["outcome"],
                "state_hash": r["state_hash"] or None, "members": json.loads(r["members"]), "tokens": tokens,
                "tokens_total": sum(tokens), "first_reported_at": r["first_reported_at"],
                "certified": bool(r["certificate"])}

    def _attach_round_reports(self, items: list[dict[str, Any]]) -> None:
        by_id = {it["id"]: it for it in items}
        if not by_id:
            return
        marks = ",".join("?" * len(by_id))
        with self._lock:
            rows = self._conn.execute(f"SELECT * FROM round_reports WHERE round_id IN ({marks}) ORDER BY id",
                                      list(by_id)).fetchall()
        for it in items:
            it.update(reporters=[], train_s=0.0, wait_s=0.0, average_s=0.0, eval_loss=None, failure_reasons=[])
        for row in rows:
            it = by_id[row["round_id"]]
            it["reporters"].append(row["peer_id"])
            for col in ("train_s", "wait_s", "average_s"):  # the slowest member's view of the round
                it[col] = max(it[col], row[col])
            if row["eval_loss"] is not None and it["eval_loss"] is None:
                it["eval_loss"] = row["eval_loss"]
            if row["failure_reason"] and row["failure_reason"] not in it["failure_reasons"]:
                it["failure_reasons"].append(row["failure_reason"])

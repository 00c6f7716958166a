"""The store's accounts: what each peer contributed to a run and what it cost.

Written while reports are stored (inside their transaction), read by the API, the dashboard and `/metrics`.

- Verified work is the `credits` table (certified rounds). Everything here besides `refused_tokens` and
  `rounds_missed` is the peer's own word, bounded so that no peer can claim more device time than passed: device
  seconds are the span of each *session*'s report timestamps (a session is one run of the peer's process), a new
  session starts no earlier than the last one ended, and compute and lost seconds never exceed device seconds.
- Wasted tokens: work a certified round weighed but did not credit (`refused_tokens`, from the signed certificate),
  local work the peer threw away when it adopted a newer state (`dropped`), and work a session still held when it
  ended (`exit_tokens`: a killed or restarted process) — or holds now, for a peer that is no longer online.
"""
from __future__ import annotations

import json
import sqlite3
import threading
from typing import Any

from swarmloco.protocol.trust.certificates import Statement
from swarmloco.protocol.trust.reports import Report

__all__ = ["ACCOUNT_COLUMNS", "ACCOUNT_SELECT", "AccountTables"]

# What `list_peers` adds to each peer, computed from its account by `ACCOUNT_SELECT`.
ACCOUNT_COLUMNS = ("device_kind", "device_s", "compute_s", "lost_s", "rounds_joined", "rounds_led", "rounds_failed",
                   "rounds_missed", "resyncs", "bytes_sent", "bytes_received", "refused_tokens", "dropped_tokens",
                   "exit_tokens", "pending_tokens")
_DEVICE_S = "(a.closed_s + a.session_end - a.session_start)"
ACCOUNT_SELECT = (
    f"a.device_kind, {_DEVICE_S} AS device_s, MIN(a.compute_s, {_DEVICE_S}) AS compute_s, "
    f"MIN(a.lost_s, {_DEVICE_S}) AS lost_s, a.rounds_joined, a.rounds_led, a.rounds_failed, a.rounds_missed, "
    "a.closed_resyncs + a.session_resyncs AS resyncs, a.bytes_sent, a.bytes_received, a.refused_tokens, "
    "a.closed_dropped + a.session_dropped AS dropped_tokens, a.exit_tokens, a.pending_tokens"
)
_FAILED = ("discarded", "mismatch")  # outcomes whose time is lost: nothing of the round was kept


class AccountTables:
    """Mixed into :class:`swarmloco.coordinator.store.SQLiteStore`, which owns the connection and its lock."""

    _conn: sqlite3.Connection
    _lock: threading.Lock
    online_window_s: float  # a peer seen within this many seconds counts as online (for missed rounds)

    # -- ingest (called inside the report's transaction) ---------------------------------------------------------

    def _account(self, r: Report, *, device_kind: str | None = None) -> None:
        """The peer's account, opened at this report's time if new; a hello naming another session than the
        account's starts a new session there (the previous process is gone: its unmerged work is counted lost)."""
        c, key, ts, b = self._conn, (r.run_id, r.peer_id), r.timestamp, r.body
        c.execute("INSERT OR IGNORE INTO accounts(run_id, peer_id, session, session_start, session_end, pending_at) "
                  "VALUES (?,?,?,?,?,?)", (*key, b.get("session", ""), ts, ts, ts))
        if device_kind is not None:
            c.execute("UPDATE accounts SET device_kind=? WHERE run_id=? AND peer_id=?", (device_kind, *key))
        session = b.get("session")
        if session:
            # Only a hello opens a session (a new process says hello first); other reports of an unknown session
            # are a dead process's leftovers, or a forger's: they change nothing below.
            resumed = b.get("pending_tokens", 0) if r.kind == "hello" else None
            if resumed is not None:
                c.execute(
                    "UPDATE accounts SET closed_s=closed_s+session_end-session_start, "
                    "session_start=MAX(session_end, ?), session_end=MAX(session_end, ?), "
                    "exit_tokens=exit_tokens+MAX(0, pending_tokens-?), closed_dropped=closed_dropped+session_dropped, "
                    "closed_resyncs=closed_resyncs+session_resyncs, session_dropped=0, session_resyncs=0, "
                    "pending_tokens=?, pending_at=?, session=? WHERE run_id=? AND peer_id=? AND session!=?",
                    (ts, ts, resumed, resumed, ts, session, *key, session))

    def _account_work(self, r: Report) -> None:
        """A report of the account's current session moves its end, its pending work (the newest report wins) and
        its cumulative counters (never backwards: reports may arrive out of order). One statement: it runs for
        every metrics report."""
        b = r.body
        if not b.get("session"):
            return
        ts, pending = r.timestamp, b.get("pending_tokens")
        self._conn.execute(
            "UPDATE accounts SET session_end=MAX(session_end, ?), pending_tokens=CASE WHEN ? >= pending_at THEN "
            "COALESCE(?, pending_tokens) ELSE pending_tokens END, pending_at=MAX(pending_at, ?), "
            "session_dropped=MAX(session_dropped, ?), session_resyncs=MAX(session_resyncs, ?) "
            "WHERE run_id=? AND peer_id=? AND session=?",
            (ts, ts, pending, ts, b.get("dropped_tokens", 0), b.get("resyncs", 0), r.run_id, r.peer_id, b["session"]))

    def _account_round(self, r: Report, *, first: bool, credited: bool) -> None:
        """A round report: its seconds and bytes count once per round and peer (`first`); `credited`: the round
        is certified, so a peer that says it led it is counted as its leader."""
        self._account(r)
        self._account_work(r)
        if not first:
            return
        b = r.body
        seconds = b["train_s"] + b["wait_s"] + b["average_s"]
        failed = b["outcome"] in _FAILED
        self._conn.execute(
            "UPDATE accounts SET rounds_joined=rounds_joined+1, compute_s=compute_s+?, lost_s=lost_s+?, "
            "rounds_failed=rounds_failed+?, rounds_led=rounds_led+?, bytes_sent=bytes_sent+?, "
            "bytes_received=bytes_received+? WHERE run_id=? AND peer_id=?",
            (b["train_s"], seconds if failed else 0.0, int(failed), int(credited and b.get("role") == "leader"),
             b.get("bytes_sent", 0), b.get("bytes_received", 0), r.run_id, r.peer_id))

    def _account_certified(self, run_id: str, round_id: int, statement: Statement, now: float, *,
                           at: float = 0.0, sign: int = 1) -> None:
        """A round was certified (`sign` -1: its certificate was replaced, take its effects back): the weight it
        did not credit is refused work; online peers outside it missed it; the work its members said they held
        before `at` (the certifying report's time) was merged by it, so it is pending no more (a member that is
        killed before its own round report arrives would otherwise be counted as losing it); and the device time
        of the peers holding credit is noted with it, for the run's cost over time."""
        c = self._conn
        marks = ",".join("?" * len(statement.members))
        if sign > 0:
            c.execute(f"UPDATE accounts SET pending_tokens=0 WHERE run_id=? AND peer_id IN ({marks}) AND "
                      "pending_at<=?", (run_id, *statement.members, at))
        refused = [(sign * (w - k), run_id, m) for m, w, k in
                   zip(statement.members, statement.weights, statement.credited, strict=True) if w > k]
        c.executemany("UPDATE accounts SET refused_tokens=refused_tokens+? WHERE run_id=? AND peer_id=?", refused)
        c.execute(f"UPDATE accounts SET rounds_missed=rounds_missed+? WHERE run_id=? AND peer_id NOT IN ({marks}) "
                  "AND peer_id IN (SELECT peer_id FROM peers WHERE run_id=? AND left_at IS NULL AND last_seen>=?)",
                  (sign, run_id, *statement.members, run_id, now - self.online_window_s))
        if sign > 0:
            billed = c.execute(f"SELECT a.device_kind, TOTAL({_DEVICE_S}) FROM accounts a JOIN credits k ON "
                               "k.run_id=a.run_id AND k.peer_id=a.peer_id WHERE a.run_id=? AND k.rounds>0 "
                               "GROUP BY a.device_kind", (run_id,)).fetchall()
            c.execute("UPDATE rounds SET billed=? WHERE id=?",
                      (json.dumps({kind: round(s, 3) for kind, s in billed}), round_id))

    # -- reads -------------------------------------------------------------------------------------------------

    def device_seconds(self, run_id: str | None = None) -> list[tuple[str, bool, float, float]]:
        """(device kind, whether the peers hold credit, device seconds, compute seconds), per kind and credit."""
        where, args = ("WHERE a.run_id=?", [run_id]) if run_id is not None else ("", [])
        with self._lock:
            rows = self._conn.execute(
                f"SELECT a.device_kind, COALESCE(k.rounds, 0) > 0 AS credited, TOTAL({_DEVICE_S}), "
                f"TOTAL(MIN(a.compute_s, {_DEVICE_S})) FROM accounts a LEFT JOIN credits k ON k.run_id=a.run_id AND "
                f"k.peer_id=a.peer_id {where} GROUP BY a.device_kind, credited", args).fetchall()
        return [(r[0], bool(r[1]), float(r[2] or 0.0), float(r[3] or 0.0)) for r in rows]

    def account_totals(self, run_id: str | None = None, *, online_since: float = 0.0) -> dict[str, float]:
        """Sums over the peers' accounts: verified (credited) tokens, bytes, rounds led/failed/missed, resyncs, the
        tokens wasted, the pending work of online peers, and when the first session started.

        Wasted: refused by certified rounds, plus — for peers some certified round credited, since a peer's own
        figures about its work must not let an identity that never did verified work inflate the run's — dropped,
        lost with ended sessions, and pending in peers no longer online (seen before `online_since`, or gone).
        TOTAL, not SUM: the peers' numbers are bounded one by one, and their sum must not overflow."""
        where, args = ("WHERE a.run_id=?", [run_id]) if run_id is not None else ("", [])
        with self._lock:
            row = self._conn.execute(
                "SELECT TOTAL(a.bytes_sent), TOTAL(a.bytes_received), TOTAL(a.rounds_led), TOTAL(a.rounds_failed), "
                "TOTAL(a.rounds_missed), TOTAL(a.closed_resyncs + a.session_resyncs), TOTAL(a.refused_tokens + CASE "
                "WHEN COALESCE(k.rounds, 0) > 0 THEN a.exit_tokens + a.closed_dropped + a.session_dropped + CASE WHEN "
                "p.online THEN 0 ELSE a.pending_tokens END ELSE 0 END), TOTAL(CASE WHEN p.online THEN "
                "a.pending_tokens ELSE 0 END), MIN(a.session_start) FROM accounts a LEFT JOIN (SELECT run_id, "
                "peer_id, left_at IS NULL AND last_seen >= ? AS online FROM peers) p ON p.run_id=a.run_id AND "
                "p.peer_id=a.peer_id LEFT JOIN credits k ON k.run_id=a.run_id AND k.peer_id=a.peer_id "
                f"{where}", [online_since, *args]).fetchone()
            credited = self._conn.execute(
                f"SELECT TOTAL(tokens) FROM credits {where.replace('a.', '')}", args).fetchone()[0]
        keys = ("bytes_sent", "bytes_received", "rounds_led", "rounds_failed", "rounds_missed", "resyncs",
                "wasted_tokens", "pending_tokens")
        totals: dict[str, float] = {k: int(v) for k, v in zip(keys, row[:-1], strict=True)}
        totals["verified_tokens"] = int(credited)
        totals["first_seen"] = float(row[-1]) if row[-1] is not None else 0.0
        return totals

    def certified_progress(self, run_id: str, limit: int) -> list[dict[str, Any]]:
        """The run's certified rounds in order (the newest `limit`): the credited tokens up to and including each,
        the first eval loss reported for its state, its time and the billed device seconds by kind."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT * FROM (SELECT round, at, billed, eval_loss, TOTAL(tokens) OVER (ORDER BY round, id) AS tokens "
                "FROM (SELECT r.id, r.round, r.first_reported_at AS at, r.billed, (SELECT TOTAL(value) FROM "
                "json_each(r.tokens)) AS tokens, (SELECT rr.eval_loss FROM round_reports rr WHERE rr.round_id=r.id "
                "AND rr.eval_loss IS NOT NULL ORDER BY rr.id LIMIT 1) AS eval_loss FROM rounds r WHERE r.run_id=? "
                "AND r.certificate IS NOT NULL) ORDER BY round DESC, tokens DESC LIMIT ?) ORDER BY round, tokens",
                (run_id, limit)).fetchall()
        return [{"round": r["round"], "at": r["at"], "tokens": int(r["tokens"] or 0),
                 "billed": json.loads(r["billed"]) if r["billed"] else {}, "eval_loss": r["eval_loss"]}
                for r in rows]

    @staticmethod
    def _kind_of(device: str) -> str:
        """A device kind for a hello that did not name one (an older peer)."""
        return "cpu" if device.startswith("cpu") else "other"

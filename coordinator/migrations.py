"""Versioned schema migrations for the SQLite store.

``MIGRATIONS[i]`` upgrades a database from ``PRAGMA user_version = i`` to ``i + 1``. Never edit a released entry:
append a new one. Each runs inside one transaction together with the ``user_version`` bump.
"""

from __future__ import annotations

__all__ = ["MIGRATIONS"]

_V1 = """
CREATE TABLE runs (
    run_id      TEXT PRIMARY KEY,
    created_at  REAL NOT NULL,
    last_seen   REAL NOT NULL
);
CREATE TABLE peers (
    run_id            TEXT NOT NULL REFERENCES runs(run_id),
    peer_id           TEXT NOT NULL,
    version           TEXT,
    device            TEXT,
    memory_bytes      INTEGER,
    tokens_per_s      REAL,
    joined_at         REAL NOT NULL,
    left_at           REAL,
    last_seen         REAL NOT NULL,
    tokens_total      INTEGER NOT NULL DEFAULT 0,
    rounds_committed  INTEGER NOT NULL DEFAULT 0,
    last_train_loss   REAL,
    last_tokens_per_s REAL,
    PRIMARY KEY (run_id, peer_id)
);
CREATE TABLE reports (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    peer_id       TEXT NOT NULL,
    nonce         TEXT NOT NULL,
    run_id        TEXT NOT NULL,
    kind          TEXT NOT NULL,
    timestamp     REAL NOT NULL,
    received_at   REAL NOT NULL,
    content_hash  TEXT NOT NULL,
    body          TEXT NOT NULL,
    response      TEXT NOT NULL,
    UNIQUE (peer_id, nonce)
);
CREATE TABLE metrics (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    report_id     INTEGER NOT NULL UNIQUE REFERENCES reports(id),
    run_id        TEXT NOT NULL,
    peer_id       TEXT NOT NULL,
    timestamp     REAL NOT NULL,
    step          INTEGER NOT NULL,
    train_loss    REAL,
    eval_loss     REAL,
    tokens_per_s  REAL NOT NULL,
    tokens_total  INTEGER NOT NULL
);
CREATE INDEX metrics_run_peer ON metrics(run_id, peer_id, id);
CREATE TABLE rounds (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id             TEXT NOT NULL,
    round              INTEGER NOT NULL,
    outcome            TEXT NOT NULL,
    state_hash         TEXT NOT NULL,
    members            TEXT NOT NULL,
    tokens             TEXT NOT NULL,
    first_reported_at  REAL NOT NULL,
    UNIQUE (run_id, round, outcome, state_hash)
);
CREATE TABLE round_reports (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    round_id        INTEGER NOT NULL REFERENCES rounds(id),
    report_id       INTEGER NOT NULL UNIQUE REFERENCES reports(id),
    peer_id         TEXT NOT NULL,
    timestamp       REAL NOT NULL,
    train_s         REAL NOT NULL,
    wait_s          REAL NOT NULL,
    average_s       REAL NOT NULL,
    eval_loss       REAL,
    failure_reason  TEXT
);
CREATE INDEX round_reports_round ON round_reports(round_id);
CREATE INDEX round_reports_peer ON round_reports(peer_id, round_id);
"""

MIGRATIONS: tuple[str, ...] = (_V1,)

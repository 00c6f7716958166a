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

# The coordinator as the run's authority: the tickets it issued, the peers it revoked (with an event log whose id is
# the revocation list's serial), rounds credited only with a commit certificate, and per-peer storage accounting.
_V2 = """
CREATE TABLE tickets (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id        TEXT NOT NULL,
    peer_id       TEXT NOT NULL,
    role          TEXT NOT NULL,
    issued_at     REAL NOT NULL,
    expires_at    REAL NOT NULL,
    nonce         TEXT NOT NULL,
    request_hash  TEXT NOT NULL,
    client        TEXT NOT NULL,
    ticket        TEXT NOT NULL,
    UNIQUE (peer_id, nonce)
);
CREATE INDEX tickets_run_peer ON tickets(run_id, peer_id, expires_at);
CREATE INDEX tickets_expiry ON tickets(expires_at);
CREATE TABLE revoked (
    peer_id     TEXT PRIMARY KEY,
    reason      TEXT NOT NULL,
    revoked_at  REAL NOT NULL
);
CREATE TABLE revocation_events (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    peer_id  TEXT NOT NULL,
    action   TEXT NOT NULL CHECK (action IN ('revoke', 'unrevoke')),
    reason   TEXT NOT NULL,
    at       REAL NOT NULL
);
ALTER TABLE rounds ADD COLUMN certificate TEXT;
ALTER TABLE peers ADD COLUMN stored_reports INTEGER NOT NULL DEFAULT 0;
CREATE INDEX reports_run_peer ON reports(run_id, peer_id, id);
UPDATE peers SET stored_reports = (SELECT COUNT(*) FROM reports r WHERE r.run_id = peers.run_id
                                   AND r.peer_id = peers.peer_id);
"""

# Credit for verified work, and the authority's newest checkpoint per run. `credits`: the tokens each peer's
# certified rounds credited it (a certificate's per-member credit, or its weights for a round that could not score
# contributions), added when a round is certified. Rounds certified before this table existed are counted from their
# stored tokens.
_V3 = """
CREATE TABLE credits (
    run_id   TEXT NOT NULL,
    peer_id  TEXT NOT NULL,
    tokens   INTEGER NOT NULL DEFAULT 0,
    rounds   INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, peer_id)
);
INSERT INTO credits(run_id, peer_id, tokens, rounds)
SELECT r.run_id, m.value, SUM(t.value), SUM(t.value > 0) FROM rounds r, json_each(r.members) m, json_each(r.tokens) t
WHERE r.certificate IS NOT NULL AND m.key = t.key GROUP BY r.run_id, m.value;
CREATE TABLE checkpoints (
    run_id     TEXT PRIMARY KEY,
    issued_at  REAL NOT NULL,
    value      TEXT NOT NULL
);
"""

# What each peer contributed and what it cost (swarmloco.coordinator.store_accounts). Times are kept per *session*
# (one run of the peer's process): device seconds are the span of a session's report timestamps, sessions never
# overlap, so no peer is billed for more time than passed. Counters a session reports cumulatively (dropped tokens,
# resyncs) are folded into the totals when the session ends. `rounds.billed`: device seconds by device kind of the
# peers holding credit when the round was certified, for the run's cost over time. Peers known before this table
# existed get their seconds and joined rounds from the round reports still kept.
_V4 = """
CREATE TABLE accounts (
    run_id           TEXT NOT NULL,
    peer_id          TEXT NOT NULL,
    device_kind      TEXT NOT NULL DEFAULT 'other',
    session          TEXT NOT NULL DEFAULT '',
    session_start    REAL NOT NULL,
    session_end      REAL NOT NULL,
    closed_s         REAL NOT NULL DEFAULT 0,
    compute_s        REAL NOT NULL DEFAULT 0,
    lost_s           REAL NOT NULL DEFAULT 0,
    rounds_joined    INTEGER NOT NULL DEFAULT 0,
    rounds_led       INTEGER NOT NULL DEFAULT 0,
    rounds_failed    INTEGER NOT NULL DEFAULT 0,
    rounds_missed    INTEGER NOT NULL DEFAULT 0,
    bytes_sent       INTEGER NOT NULL DEFAULT 0,
    bytes_received   INTEGER NOT NULL DEFAULT 0,
    refused_tokens   INTEGER NOT NULL DEFAULT 0,
    exit_tokens      INTEGER NOT NULL DEFAULT 0,
    closed_dropped   INTEGER NOT NULL DEFAULT 0,
    closed_resyncs   INTEGER NOT NULL DEFAULT 0,
    session_dropped  INTEGER NOT NULL DEFAULT 0,
    session_resyncs  INTEGER NOT NULL DEFAULT 0,
    pending_tokens   INTEGER NOT NULL DEFAULT 0,
    pending_at       REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, peer_id)
);
ALTER TABLE rounds ADD COLUMN billed TEXT;
CREATE INDEX rounds_certified ON rounds(run_id, round) WHERE certificate IS NOT NULL;
INSERT INTO accounts(run_id, peer_id, device_kind, session_start, session_end, compute_s, rounds_joined)
SELECT p.run_id, p.peer_id, CASE WHEN p.device LIKE 'cpu%' THEN 'cpu' ELSE 'other' END,
       COALESCE(x.first, p.joined_at), COALESCE(x.last, p.joined_at), COALESCE(x.train, 0), COALESCE(x.n, 0)
FROM peers p LEFT JOIN (
    SELECT r.run_id, rr.peer_id, MIN(rr.timestamp - rr.train_s - rr.wait_s - rr.average_s) AS first,
           MAX(rr.timestamp) AS last, SUM(rr.train_s) AS train, COUNT(*) AS n
    FROM round_reports rr JOIN rounds r ON r.id = rr.round_id GROUP BY r.run_id, rr.peer_id
) x ON x.run_id = p.run_id AND x.peer_id = p.peer_id;
"""

MIGRATIONS: tuple[str, ...] = (_V1, _V2, _V3, _V4)

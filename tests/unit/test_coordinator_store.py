"""SQLite store: pragmas, migrations, integrity check, atomic and idempotent ingest, pagination."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from _coordinator_helpers import hello_body, make_identities, metrics_body, round_body
from _ticket_helpers import certificate, certified_round_body

from swarmloco.coordinator.migrations import MIGRATIONS
from swarmloco.coordinator.store import SQLiteStore, StoreError
from swarmloco.protocol.trust.certificates import Certificate
from swarmloco.protocol.trust.reports import Report, build_report, content_hash

pytestmark = pytest.mark.timeout(30)


def _add(store: SQLiteStore, report: Report, cert: Certificate | None = None, **kw: Any) -> dict[str, Any]:
    """Store a report; `cert` stands for a certificate the service verified (the store trusts its caller)."""
    return store.add_report(report, content_hash=content_hash(report.to_json()), received_at=report.timestamp,
                            certificate=cert, **kw).response


def test_pragmas_and_migrations(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "db.sqlite")
    conn = store._conn
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert store.integrity_check() == "ok"
    store.close()
    SQLiteStore(tmp_path / "db.sqlite").close()  # reopening does not re-run migrations


def test_newer_schema_and_damaged_files_are_refused(tmp_path: Path) -> None:
    db = tmp_path / "new.sqlite"
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA user_version={len(MIGRATIONS) + 5}")
    conn.close()
    with pytest.raises(StoreError, match="upgrade swarmloco"):
        SQLiteStore(db)
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError):
        SQLiteStore(junk)


def test_ingest_is_idempotent_and_persistent(tmp_path: Path) -> None:
    (a, b) = make_identities(tmp_path / "ids", 2)
    store = SQLiteStore(tmp_path / "db.sqlite")
    cert = certificate([a, b], {}, run_id="run", round=1)
    committed = certified_round_body(round_body(1, [a.peer_id, b.peer_id]), cert)
    reports = [
        (build_report(a, "run", "hello", hello_body()), None),
        (build_report(a, "run", "metrics", metrics_body(1)), None),
        (build_report(a, "run", "round", committed), cert),
        (build_report(b, "run", "round", committed), cert),
        (build_report(b, "run", "round", round_body(2, [b.peer_id], outcome="discarded", failure_reason="x")), None),
    ]
    answers = [_add(store, r, c) for r, c in reports]
    again = [_add(store, r, c) for r, c in reports]
    assert answers == again
    counts = store.counts()
    assert counts["reports"] == 5 and counts["metrics"] == 1 and counts["rounds"] == 2
    assert counts["round_reports"] == 3 and counts["peers"] == 2
    store.close()
    store = SQLiteStore(tmp_path / "db.sqlite")
    rounds = store.list_rounds(run_id="run", peer_id=None, limit=10, cursor=None, descending=False).items
    assert [r["round"] for r in rounds] == [1, 2]
    assert sorted(rounds[0]["reporters"]) == sorted([a.peer_id, b.peer_id])
    assert rounds[1]["state_hash"] is None and rounds[1]["failure_reasons"] == ["x"]
    assert rounds[0]["certified"] and not rounds[1]["certified"]
    assert store.rounds_by_outcome() == {"committed": 1, "discarded": 1}
    assert store.round_duration_histogram([1.0, 4.75, 100.0]) == ([0, 3, 3], 3, 3 * 4.75)
    peers = {p["peer_id"]: p for p in store.list_peers(run_id="run", peer_id=None, limit=10, cursor=None,
                                                         descending=False).items}
    assert peers[a.peer_id]["device"] == "cpu" and peers[a.peer_id]["rounds_committed"] == 1
    assert peers[a.peer_id]["tokens_total"] == 256
    store.close()


def test_failed_ingest_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (a,) = make_identities(tmp_path / "ids", 1)
    store = SQLiteStore(tmp_path / "db.sqlite")
    before = store.counts()

    def boom(*_: object) -> None:
        raise RuntimeError("disk on fire")

    cert = certificate([a], {}, run_id="run", round=1)
    body = certified_round_body(round_body(1, [a.peer_id]), cert)
    monkeypatch.setattr(store, "_apply_round", boom)
    with pytest.raises(RuntimeError):
        _add(store, build_report(a, "run", "round", body), cert)
    assert store.counts() == before
    monkeypatch.undo()
    _add(store, build_report(a, "run", "round", body), cert)
    assert store.counts()["rounds"] == 1
    store.close()


def test_pagination_and_filters(tmp_path: Path) -> None:
    (a, b) = make_identities(tmp_path / "ids", 2)
    store = SQLiteStore(tmp_path / "db.sqlite")
    for step in range(25):
        for who in (a, b):
            _add(store, build_report(who, "run", "metrics", metrics_body(step)))
    _add(store, build_report(a, "other", "metrics", metrics_body(0)))
    seen, cursor = [], None
    while True:
        page = store.list_metrics(run_id="run", peer_id=a.peer_id, limit=10, cursor=cursor, descending=False)
        seen += page.items
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert [m["step"] for m in seen] == list(range(25))
    assert all(m["peer_id"] == a.peer_id and m["run_id"] == "run" for m in seen)
    desc = store.list_metrics(run_id=None, peer_id=None, limit=3, cursor=None, descending=True)
    assert desc.items[0]["run_id"] == "other" and desc.next_cursor == desc.items[-1]["id"]
    assert {r["run_id"] for r in store.list_runs(limit=10, cursor=None, descending=False).items} == {"run", "other"}
    store.close()


def test_migration_keeps_old_rounds_as_uncertified_claims(tmp_path: Path) -> None:
    (a,) = make_identities(tmp_path / "ids", 1)
    db = tmp_path / "old.sqlite"
    conn = sqlite3.connect(db)
    conn.executescript(f"{MIGRATIONS[0]}\nPRAGMA user_version=1;")
    conn.execute("INSERT INTO runs VALUES ('run', 1.0, 1.0)")
    conn.execute("INSERT INTO peers(run_id, peer_id, joined_at, last_seen) VALUES ('run', ?, 1.0, 1.0)", (a.peer_id,))
    conn.execute("INSERT INTO reports(peer_id, nonce, run_id, kind, timestamp, received_at, content_hash, body, "
                 "response) VALUES (?, 'ab', 'run', 'round', 1.0, 1.0, 'h', '{}', '{}')", (a.peer_id,))
    conn.execute("INSERT INTO rounds(run_id, round, outcome, state_hash, members, tokens, first_reported_at) "
                 "VALUES ('run', 1, 'committed', ?, ?, '[5]', 1.0)", ("ab" * 32, f'["{a.peer_id}"]'))
    conn.commit()
    conn.close()
    store = SQLiteStore(db)
    [old] = store.list_rounds(run_id="run", peer_id=None, limit=10, cursor=None, descending=False).items
    assert old["outcome"] == "committed" and not old["certified"]
    assert store._conn.execute("SELECT stored_reports FROM peers").fetchone()[0] == 1  # counted at migration
    # a certificate for that round later certifies the same row, with what its members signed
    cert = certificate([a], {}, run_id="run", round=1, new_hash="ab" * 32)
    _add(store, build_report(a, "run", "round", certified_round_body(round_body(1, [a.peer_id]), cert)), cert)
    [row] = store.list_rounds(run_id="run", peer_id=None, limit=10, cursor=None, descending=False).items
    assert row["id"] == old["id"] and row["certified"] and row["tokens"] == [1000]
    store.close()


def test_reports_that_arrive_together_share_one_commit_and_fail_alone(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Group commit: callers that queue while a commit is written are committed together; every caller returns
    only after its report is durable, and a report that fails takes only its own rows with it."""
    import threading

    (a,) = make_identities(tmp_path / "ids", 1)
    store = SQLiteStore(tmp_path / "db.sqlite")
    reports = [build_report(a, "run", "metrics", metrics_body(i)) for i in range(40)]
    bad = reports[7].nonce
    apply = store._apply

    def failing_apply(r: Report, *args: Any) -> None:
        if r.nonce == bad:
            raise sqlite3.IntegrityError("injected")
        apply(r, *args)

    monkeypatch.setattr(store, "_apply", failing_apply)
    results: dict[int, Any] = {}
    store._lock.acquire()  # a commit in progress: everyone queues behind it

    def send(i: int) -> None:
        try:
            results[i] = _add(store, reports[i])
        except sqlite3.IntegrityError as exc:
            results[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(reports))]
    for t in threads:
        t.start()
    while len(store._queue) < len(reports):
        threading.Event().wait(0.01)
    store._lock.release()
    for t in threads:
        t.join(10)
    assert store.commits == 1  # forty reports, one transaction
    assert isinstance(results[7], sqlite3.IntegrityError)
    assert all(results[i]["status"] == "stored" for i in range(len(reports)) if i != 7)
    store.close()
    reopened = SQLiteStore(tmp_path / "db.sqlite")  # durable: on disk, not just in this connection
    stored = {n for _, n in reopened.nonces()}
    assert stored == {r.nonce for r in reports} - {bad}
    reopened.close()

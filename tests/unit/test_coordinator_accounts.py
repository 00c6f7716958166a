"""Contribution and cost accounting: per-peer accounts, the run's goodput and cost, and their bounds.

Verified tokens come from certified rounds; everything a peer says about its own time, bytes and work is bounded so
that no identity can be billed for more device time than passed, and identities no certified round credited are
never billed."""
from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _coordinator_helpers import hello_body, make_identities, metrics_body, round_body
from _ticket_helpers import ServiceEnv, certificate, certified_round_body

from swarmloco.coordinator.accounting import parse_prices
from swarmloco.coordinator.migrations import MIGRATIONS
from swarmloco.coordinator.store import SQLiteStore
from swarmloco.protocol.trust.identity import Identity

pytestmark = pytest.mark.timeout(60)
PRICES = {"cuda": 2.0, "cpu": 0.5}


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    return make_identities(tmp_path_factory.mktemp("ids"), 8)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[ServiceEnv]:
    e = ServiceEnv(tmp_path / "db.sqlite", prices=PRICES)
    yield e
    e.close()


def _ok(answer: tuple[int, dict[str, Any]]) -> dict[str, Any]:
    status, body = answer
    assert status == 200, body
    return body


def _hello(env: ServiceEnv, who: Identity, session: str, *, kind: str = "cpu", resumed: int = 0) -> None:
    _ok(env.report(who, "hello", {**hello_body(), "device_kind": kind, "session": session, "pending_tokens": resumed}))


def _work(env: ServiceEnv, who: Identity, session: str, step: int, *, pending: int, dropped: int = 0,
          resyncs: int = 0) -> None:
    _ok(env.report(who, "metrics", {**metrics_body(step), "session": session, "pending_tokens": pending,
                                    "dropped_tokens": dropped, "resyncs": resyncs}))


def _round(env: ServiceEnv, who: Identity, session: str, cert: Any, *, role: str = "member",
           eval_loss: float | None = None, outcome: str = "committed") -> None:
    base = {**round_body(cert.statement.round if cert else 9, [who.peer_id], outcome=outcome, eval_loss=eval_loss),
            "session": session, "pending_tokens": 0, "role": role, "bytes_sent": 2**20, "bytes_received": 2**21}
    _ok(env.report(who, "round", certified_round_body(base, cert) if cert is not None else base))


def test_three_peers_and_a_kill_add_up(env: ServiceEnv, ids: list[Identity]) -> None:
    """Per-peer verified tokens add up to the tokens of the certified rounds; work refused by a round, and the work
    a killed peer held, show as wasted; seconds, bytes and roles land in each peer's account."""
    a, b, c = ids[:3]
    tickets = env.admit(a, b, c)
    members = sorted(i.peer_id for i in (a, b, c))
    by_id = {i.peer_id: i for i in (a, b, c)}
    sessions = {i.peer_id: f"{n + 1:02x}" * 8 for n, i in enumerate((a, b, c))}
    for who, kind in ((a, "cuda"), (b, "cuda"), (c, "cpu")):
        _hello(env, who, sessions[who.peer_id], kind=kind)
    losses = {1: 4.0, 2: 3.5, 3: 3.0}
    for rnd in (1, 2, 3):
        env.clock.now += 10
        weights, credit = [1000, 1000, 1000], [1000, 1000, 1000 if rnd < 3 else 400]  # the third: 600 refused
        cert = certificate([a, b, c], tickets, run_id="run", round=rnd, members=members, weights=weights,
                           credit=credit)
        for i, m in enumerate(members):
            _round(env, by_id[m], sessions[m], cert, role="leader" if i == rnd % 3 else "member",
                   eval_loss=losses[rnd])
    env.clock.now += 5
    killed = by_id[members[0]]
    _work(env, killed, sessions[killed.peer_id], 99, pending=700)  # then SIGKILL: it never reports again
    _round(env, by_id[members[1]], sessions[members[1]], None, outcome="discarded")  # a round that failed
    rounds = env.rounds()
    peers = {m: env.peer(by_id[m]) for m in members}
    assert sum(p["credited_tokens"] for p in peers.values()) == sum(r["tokens_total"] for r in rounds if r["certified"])
    assert peers[members[2]]["refused_tokens"] == 600 and peers[members[2]]["wasted_tokens"] == 600
    assert peers[killed.peer_id]["wasted_tokens"] == 0  # still online: its pending work may yet be merged
    assert [peers[m]["rounds_joined"] for m in members] == [3, 4, 3]
    assert [peers[m]["rounds_led"] for m in members] == [1, 1, 1]
    assert peers[members[1]]["rounds_failed"] == 1 and peers[members[1]]["lost_s"] == pytest.approx(4.75)
    assert peers[members[0]]["bytes_sent"] == 3 * 2**20 and peers[members[0]]["bytes_received"] == 3 * 2**21

    env.clock.now += 120  # past the online window: the killed peer's unmerged work is lost
    gone = env.peer(killed)
    assert not gone["online"] and gone["wasted_tokens"] == 700
    run = env.service.accounting()
    assert run["verified_tokens"] == 8400 and run["wasted_tokens"] == 600 + 700
    assert set(run["device_hours"]) == {"cuda", "cpu"} and run["cost"] == pytest.approx(
        2.0 * run["device_hours"]["cuda"] + 0.5 * run["device_hours"]["cpu"])
    assert [p["tokens"] for p in run["progress"]] == [3000, 6000, 8400]
    assert run["eval_loss_first"] == 4.0 and run["eval_loss_last"] == 3.0
    assert run["eval_loss_drop_per_mtoken"] == pytest.approx(1.0 / (5400 / 1e6))
    spent = run["progress"][-1]["cost"] - run["progress"][0]["cost"]
    assert spent > 0 and run["cost_per_eval_loss_point"] == pytest.approx(spent / 1.0)
    assert run["goodput_tokens_per_s"] == pytest.approx(8400 / run["wall_s"]) and run["wall_s"] > 0
    text = env.service.prometheus_text().decode()
    for family in ("swarmloco_device_seconds_total", "swarmloco_wasted_tokens_total 1300.0",
                   "swarmloco_averaging_bytes_total", "swarmloco_run_cost"):
        assert family in text


def test_work_a_certified_round_merged_is_not_pending_even_if_its_member_never_says_so(env: ServiceEnv,
                                                                                        ids: list[Identity]) -> None:
    """A member killed right after its round committed never sends its own round report: the certificate another
    member brings shows its earlier pending work merged; work it reports after the round stays pending."""
    a, b = ids[:2]
    tickets = env.admit(a, b)
    _hello(env, a, "aa" * 8)
    _hello(env, b, "bb" * 8)
    env.clock.now += 5
    _work(env, a, "aa" * 8, 1, pending=6000)  # then the round commits, and `a` dies before reporting it
    env.clock.now += 1
    cert = certificate([a, b], tickets, run_id="run", round=1, members=sorted([a.peer_id, b.peer_id]))
    _round(env, b, "bb" * 8, cert)
    assert env.peer(a)["pending_tokens"] == 0 and env.peer(a)["credited_tokens"] > 0
    env.clock.now += 1
    _work(env, a, "aa" * 8, 2, pending=300)  # trained after the round: not merged by it
    env.clock.now += 1
    _round(env, b, "bb" * 8, cert)  # the same certificate again changes nothing
    env.clock.now += 120
    assert env.peer(a)["wasted_tokens"] == 300


def test_a_restart_counts_the_work_the_old_process_took_with_it(env: ServiceEnv, ids: list[Identity]) -> None:
    who = ids[0]
    env.admit(who)
    _hello(env, who, "11" * 8)
    env.clock.now += 30
    _work(env, who, "11" * 8, 1, pending=500, dropped=40, resyncs=2)
    _work(env, who, "11" * 8, 2, pending=300, dropped=30, resyncs=1)  # out of order: counters never go back
    env.clock.now += 5
    _hello(env, who, "22" * 8, resumed=100)  # restarted from a checkpoint holding 100 of the 300 pending tokens
    _work(env, who, "11" * 8, 3, pending=9999)  # a dead process's leftover: changes nothing
    env.clock.now += 20
    _work(env, who, "22" * 8, 1, pending=150, dropped=5, resyncs=1)
    p = env.peer(who)
    assert p["exit_tokens"] == 200 and p["dropped_tokens"] == 45 and p["resyncs"] == 3
    assert p["pending_tokens"] == 150 and p["wasted_tokens"] == 245
    assert p["device_s"] == pytest.approx(30 + 20)  # two sessions, the gap between them not billed


def test_attack_no_identity_is_billed_for_time_that_did_not_pass(env: ServiceEnv, ids: list[Identity]) -> None:
    """A peer that claims huge round durations, or opens a new session with every report, is billed at most the
    time between its first and last report; identities no certified round credited are not billed at all, however
    many of them report (without these bounds the cost below grows with every sybil's claim)."""
    honest, sybils = ids[0], ids[1:6]
    tickets = env.admit(honest, *sybils)
    _hello(env, honest, "aa" * 8, kind="cuda")
    env.clock.now += 60
    cert = certificate([honest], tickets, run_id="run", round=1, members=[honest.peer_id])
    _round(env, honest, "aa" * 8, cert)
    before = env.service.accounting()
    assert before["device_hours"] == {"cuda": pytest.approx(60 / 3600)}
    for n, sybil in enumerate(sybils):
        for k in range(6):  # a fresh session each second, each claiming 3e7 s of rounds
            session = f"{n:02x}{k:02x}" * 4
            _hello(env, sybil, session, kind="cuda")
            env.clock.now += 1
            _ok(env.report(sybil, "round", {**round_body(1, [sybil.peer_id], outcome="discarded"), "train_s": 1e7,
                                            "wait_s": 1e7, "average_s": 1e7, "session": session}))
        p = env.peer(sybil)
        assert p["device_s"] == 6 and p["compute_s"] == 6 and p["lost_s"] == 6  # the seconds that passed
    after = env.service.accounting()
    assert after["device_hours"] == before["device_hours"] and after["cost"] == before["cost"]
    assert after["unbilled_device_hours"] == {"cuda": pytest.approx(5 * 6 / 3600)}


def test_attack_huge_claims_neither_overflow_the_sums_nor_count_as_the_runs_waste(env: ServiceEnv,
                                                                                 ids: list[Identity]) -> None:
    """Each field is bounded (2^48), but a stranger repeats its largest claims: the run's sums must still answer
    (SQLite's SUM raises on overflow) and its waste must not take the word of an identity no round credited."""
    honest, sybils = ids[0], ids[1:4]
    tickets = env.admit(honest, *sybils)
    _hello(env, honest, "aa" * 8)
    _round(env, honest, "aa" * 8, certificate([honest], tickets, run_id="run", round=1, members=[honest.peer_id]))
    big = 2**48
    for n, sybil in enumerate(sybils):
        for k in range(200):
            session = f"{n:02x}{k:04x}" + "0" * 10
            env.clock.now += 0.01  # within the per-client rate limit
            _hello(env, sybil, session)
            _ok(env.report(sybil, "round", {**round_body(1, [sybil.peer_id], outcome="discarded"),
                                            "session": session, "pending_tokens": big, "dropped_tokens": big,
                                            "bytes_sent": big, "bytes_received": big, "resyncs": 2**32}))
    assert env.peer(sybils[0])["exit_tokens"] == 199 * big  # its own row shows its claim...
    run = env.service.accounting()
    assert run["wasted_tokens"] == 0 and run["verified_tokens"] == 1000  # ...the run's waste does not
    assert run["bytes_sent"] == 3 * big + 2**20  # bytes count once per round and peer
    # As after 2^15 such sessions each: every row near 2^62, so their sum is past SQLite's 64-bit integers.
    env.store._conn.execute("UPDATE accounts SET exit_tokens=?, bytes_sent=?, rounds_missed=? WHERE peer_id!=?",
                            (2**62, 2**62, 2**62, honest.peer_id))
    run = env.service.accounting()
    assert run["bytes_sent"] >= 3 * 2**62 and run["wasted_tokens"] == 0
    assert "swarmloco_wasted_tokens_total 0.0" in env.service.prometheus_text().decode()


def test_prices_parse_or_refuse_in_one_line() -> None:
    assert parse_prices("cuda=2.1, cpu=0.05") == {"cuda": 2.1, "cpu": 0.05}
    for bad, says in (("cuda", "is not KIND=PRICE"), ("tpu=1", "unknown device kind 'tpu'"),
                      ("cuda=1,cuda=2", "priced twice"), ("cuda=1e9", r"in \[0, 1e\+06\]"), (" , ", "no prices")):
        with pytest.raises(ValueError, match=says):
            parse_prices(bad)


def test_migration_opens_accounts_for_peers_already_known(tmp_path: Path) -> None:
    """A database from before accounts: each known peer gets one, with the seconds and rounds its kept round reports
    hold."""
    db = tmp_path / "old.sqlite"
    conn = sqlite3.connect(db)
    conn.executescript("\n".join(MIGRATIONS[:3]) + "\nPRAGMA user_version=3;")
    conn.executescript("""
        INSERT INTO runs VALUES ('r', 0, 0);
        INSERT INTO peers(run_id, peer_id, device, joined_at, last_seen) VALUES ('r', 'p1', 'cpu (2 threads)', 5, 9);
        INSERT INTO peers(run_id, peer_id, device, joined_at, last_seen) VALUES ('r', 'p2', 'NVIDIA H100', 5, 9);
        INSERT INTO reports VALUES (1, 'p1', 'n1', 'r', 'round', 100, 100, 'h', '{}', '{}');
        INSERT INTO rounds(id, run_id, round, outcome, state_hash, members, tokens, first_reported_at)
            VALUES (1, 'r', 1, 'discarded', '', '["p1"]', '[5]', 100);
        INSERT INTO round_reports VALUES (1, 1, 1, 'p1', 100, 4.0, 1.0, 0.5, NULL, NULL);
    """)
    conn.commit()
    conn.close()
    store = SQLiteStore(db)
    try:
        rows = {r["peer_id"]: dict(r) for r in store._conn.execute("SELECT * FROM accounts")}
        assert rows["p1"]["device_kind"] == "cpu" and rows["p1"]["compute_s"] == 4.0
        assert rows["p1"]["rounds_joined"] == 1 and rows["p1"]["session_end"] - rows["p1"]["session_start"] == 5.5
        assert rows["p2"]["device_kind"] == "other" and rows["p2"]["rounds_joined"] == 0
    finally:
        store.close()

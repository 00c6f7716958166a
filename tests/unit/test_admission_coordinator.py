"""The coordinator as the run's authority: who gets a ticket under each policy, what a ticket request must prove,
how fast open admission mints identities, revocation, and reports refused without a ticket. Each attack test
names the defence it needs; without it the attack would succeed."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from _coordinator_helpers import TEST_WORK_BITS, hello_body, make_identities, metrics_body
from _ticket_helpers import ServiceEnv

from swarmloco.coordinator.authority import AuthorityConfig
from swarmloco.coordinator.limits import RateLimiter
from swarmloco.coordinator.store import SQLiteStore
from swarmloco.protocol.trust.admission import AdmissionPolicy, Revocations, Ticket
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.puzzle import solve
from swarmloco.protocol.trust.ticket_request import build_ticket_request

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    return make_identities(tmp_path_factory.mktemp("ids"), 4)


def _env(tmp_path: Path, mode: str = "open", **kw: object) -> ServiceEnv:
    policy_kw = {k: kw.pop(k) for k in ("invite_codes", "allowlist", "ticket_s") if k in kw}
    kw.setdefault("work_bits", TEST_WORK_BITS)  # env.ticket solves it (tests/unit/test_admission_puzzle.py)
    authority = AuthorityConfig(policy=AdmissionPolicy(mode=mode, **policy_kw), **kw)  # type: ignore[arg-type]
    return ServiceEnv(tmp_path / "db.sqlite", authority=authority)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[ServiceEnv]:
    e = _env(tmp_path)
    yield e
    e.close()


def _ticket_rows(env: ServiceEnv) -> list[tuple[object, ...]]:
    with env.store._lock:
        return [tuple(r) for r in env.store._conn.execute("SELECT peer_id, role, issued_at, expires_at FROM tickets")]


# -- policies --------------------------------------------------------------------------------------------------


def test_open_issues_a_ticket_signed_by_the_authority_and_records_it(env: ServiceEnv, ids: list[Identity]) -> None:
    status, body = env.ticket(ids[0], role="observer")
    assert status == 200, body
    ticket = Ticket.from_bytes(body["ticket"])
    assert ticket.problem(run_id="run", authority=env.authority, now=env.clock.now, peer_id=ids[0].peer_id,
                          role="observer") == ""
    assert body["expires_at"] == ticket.expires_at == pytest.approx(env.clock.now + 3600, abs=0.01)
    assert _ticket_rows(env) == [(ids[0].peer_id, "observer", ticket.issued_at, ticket.expires_at)]
    assert env.service.authority.info() == {"run_id": "run", "authority": env.authority, "admission": "open",
                                            "work_bits": TEST_WORK_BITS}


def test_invite_policy(tmp_path: Path, ids: list[Identity]) -> None:
    env = _env(tmp_path, "invite", invite_codes=frozenset({"sesame", "other"}))
    assert env.ticket(ids[0]) == (403, {"error": "invite code is missing or wrong"})
    assert env.ticket(ids[0], invite="sesam")[0] == 403
    assert env.ticket(ids[0], invite="sesame")[0] == 200
    assert _ticket_rows(env)[0][0] == ids[0].peer_id and len(_ticket_rows(env)) == 1
    env.close()


def test_allowlist_policy(tmp_path: Path, ids: list[Identity]) -> None:
    env = _env(tmp_path, "allowlist", allowlist=frozenset({ids[0].peer_id}))
    assert env.ticket(ids[0])[0] == 200
    assert env.ticket(ids[1]) == (403, {"error": "peer id is not on this run's allowlist"})
    env.close()


def test_none_issues_nothing_and_takes_every_report(tmp_path: Path, ids: list[Identity]) -> None:
    env = _env(tmp_path, "none")
    status, body = env.ticket(ids[0])
    assert status == 403 and "private swarm" in body["error"]
    assert env.report(ids[1], "hello", hello_body())[0] == 200  # no ticket needed
    env.close()


# -- what a ticket request must prove --------------------------------------------------------------------------


def test_attack_ticket_for_someone_elses_key_is_refused(env: ServiceEnv, ids: list[Identity]) -> None:
    """Defence: the request's signature by the key inlined in peer_id. Without it anyone could get (and spend an
    invite code on) a ticket naming a victim's id."""
    obj = build_ticket_request(ids[1], "run", timestamp=env.clock.now).to_json()
    obj["peer_id"] = ids[0].peer_id
    answer = env.service.request_ticket(json.dumps(obj).encode(), client="10.0.0.9")
    assert answer.status == 401 and "signature" in answer.body["error"]
    assert _ticket_rows(env) == []


def test_malformed_stale_and_wrong_run(env: ServiceEnv, ids: list[Identity]) -> None:
    assert env.service.request_ticket(b"{]", client="x").status == 400
    assert env.service.request_ticket(b"x" * 5000, client="x").status == 413
    assert env.ticket(ids[0], timestamp=env.clock.now - 400)[0] == 422
    assert env.ticket(ids[0], timestamp=env.clock.now + 400)[0] == 422
    status, body = env.ticket(ids[0], run_id="other-run")
    assert status == 403 and "'run'" in body["error"]
    assert _ticket_rows(env) == []


def test_replay_gets_the_same_ticket_and_a_reused_nonce_is_refused(env: ServiceEnv, ids: list[Identity]) -> None:
    work = solve("run", ids[0].peer_id, env.clock.now, TEST_WORK_BITS, max_s=10)
    raw = build_ticket_request(ids[0], "run", timestamp=env.clock.now, work=work).encode()
    first = env.service.request_ticket(raw, client="10.0.0.1")
    env.clock.now += 120  # past the reuse window: a new request would get a new ticket
    again = env.service.request_ticket(raw, client="10.0.0.2")
    assert first.status == again.status == 200 and first.body == again.body
    assert len(_ticket_rows(env)) == 1
    other = build_ticket_request(ids[0], "run", role="observer", timestamp=env.clock.now,
                                 nonce=json.loads(raw)["nonce"]).encode()
    assert env.service.request_ticket(other, client="10.0.0.1").status == 409


# -- open admission: the rate of new identities ----------------------------------------------------------------


def test_attack_sybil_flood_from_one_address_is_rate_limited(tmp_path: Path) -> None:
    """Defence: per-address and global buckets on new tickets. Without them one address mints a ticket for every
    key it generates."""
    env = _env(tmp_path, new_per_address_burst=5, new_per_address_per_h=1, new_global_burst=8, new_global_per_h=1)
    sybils = make_identities(tmp_path / "sybils", 12)
    statuses = [env.ticket(s, client="203.0.113.7")[0] for s in sybils[:7]]
    assert statuses == [200] * 5 + [429] * 2
    others = [env.ticket(s, client=f"198.51.100.{i}")[0] for i, s in enumerate(sybils[7:])]
    assert others == [200] * 3 + [429] * 2  # the global bucket holds across addresses
    assert len(_ticket_rows(env)) == 8
    env.clock.now += 3600  # buckets refill
    assert env.ticket(sybils[5], client="203.0.113.7")[0] == 200
    env.close()


def test_renewals_are_cheap_and_not_rate_limited(tmp_path: Path, ids: list[Identity]) -> None:
    env = _env(tmp_path, new_per_address_burst=1, new_per_address_per_h=1, new_global_burst=1, new_global_per_h=1)
    status, first = env.ticket(ids[0], client="203.0.113.7")
    assert status == 200
    assert env.ticket(ids[1], client="203.0.113.7")[0] == 429
    env.clock.now += 30  # a peer asking again at once gets its ticket back, and nothing is written
    assert env.ticket(ids[0], client="203.0.113.7") == (200, first)
    env.clock.now += 1800 - 30  # a renewal at half the lifetime: a new ticket although every bucket is empty
    status, renewed = env.ticket(ids[0], client="203.0.113.7")
    assert status == 200 and renewed["expires_at"] == pytest.approx(first["expires_at"] + 1800, abs=0.01)
    assert len(_ticket_rows(env)) == 2
    env.clock.now += 3600  # expired: a new ticket again, so it costs a token
    assert env.ticket(ids[0], client="203.0.113.7")[0] == 200
    env.close()


def test_rate_limiter_memory_is_bounded() -> None:
    limiter = RateLimiter(rate=1.0, burst=1.0, max_keys=100)
    for i in range(1000):
        limiter.allow(f"10.0.{i // 256}.{i % 256}", 0.0)
        assert len(limiter._buckets) <= 100
    assert not limiter.allow("10.0.3.231", 0.0) and limiter.wait_s("10.0.3.231", 0.0) == pytest.approx(1.0)


# -- revocation ------------------------------------------------------------------------------------------------


def test_revocation_refuses_tickets_and_reports_and_is_signed(env: ServiceEnv, ids: list[Identity]) -> None:
    env.admit(ids[0], ids[1])
    assert env.report(ids[0], "hello", hello_body())[0] == 200
    first = Revocations.parse(env.service.authority.revocations(), run_id="run", authority=env.authority)
    assert first.serial == 0 and first.peer_ids == ()
    other = SQLiteStore(env.store.path)  # `swarmloco coordinator revoke` writes from another process
    assert other.revoke(ids[0].peer_id, reason="spam", now=env.clock.now, max_revoked=10) == (True, 1)
    status, body = env.report(ids[0], "metrics", metrics_body(1))
    assert status == 403 and "revoked" in body["error"]
    assert env.ticket(ids[0]) == (403, {"error": "peer is revoked by the run's authority"})
    assert env.report(ids[1], "metrics", metrics_body(1))[0] == 200  # others are unaffected
    listed = Revocations.parse(env.service.authority.revocations(), run_id="run", authority=env.authority)
    assert listed.serial == 1 and listed.peer_ids == (ids[0].peer_id,)
    assert other.revoke(ids[0].peer_id, reason="again", now=env.clock.now, max_revoked=10) == (False, 1)
    with pytest.raises(ValueError, match="revoked already"):
        other.revoke(ids[2].peer_id, reason="", now=env.clock.now, max_revoked=1)
    assert other.unrevoke(ids[0].peer_id, now=env.clock.now) == (True, 2)
    assert other.unrevoke(ids[0].peer_id, now=env.clock.now) == (False, 2)
    other.close()
    lifted = Revocations.parse(env.service.authority.revocations(), run_id="run", authority=env.authority)
    assert lifted.serial == 2 and lifted.peer_ids == ()
    assert env.ticket(ids[0])[0] == 200 and env.report(ids[0], "metrics", metrics_body(2))[0] == 200


def test_attack_forged_revocation_list_is_not_the_authoritys(env: ServiceEnv, ids: list[Identity]) -> None:
    """Defence: the list is signed by the authority key; one signed by anyone else fails to parse."""
    forged = Revocations.issue(ids[3], run_id="run", serial=99, peer_ids=[ids[0].peer_id]).to_value()
    with pytest.raises(ValueError):
        Revocations.parse(forged, run_id="run", authority=env.authority)


# -- reports honour admission ----------------------------------------------------------------------------------


def test_attack_reports_without_a_ticket_are_refused(env: ServiceEnv, ids: list[Identity]) -> None:
    """Defence: reports need a ticket. Without it any fresh key fills the dashboard with fake peers."""
    status, body = env.report(ids[2], "hello", hello_body())
    assert status == 403 and "POST /api/tickets" in body["error"]
    assert env.store.counts()["peers"] == 0 and env.store.counts()["reports"] == 0


def test_reports_land_within_the_grace_after_expiry(env: ServiceEnv, ids: list[Identity]) -> None:
    env.admit(ids[0])
    env.clock.now += 3600 + 250  # expired, but a renewal may be in flight: buffered reports still land
    assert env.report(ids[0], "metrics", metrics_body(1))[0] == 200
    env.clock.now += 100
    status, body = env.report(ids[0], "metrics", metrics_body(2))
    assert status == 403 and "no valid ticket" in body["error"]
    env.admit(ids[0])
    assert env.report(ids[0], "metrics", metrics_body(2))[0] == 200


def test_reports_for_another_run_need_a_ticket_for_it(env: ServiceEnv, ids: list[Identity]) -> None:
    env.admit(ids[0])
    assert env.report(ids[0], "hello", hello_body(), run_id="elsewhere")[0] == 403


def test_known_report_is_answered_again_after_revocation(env: ServiceEnv, ids: list[Identity]) -> None:
    env.admit(ids[0])
    raw = env.report(ids[0], "metrics", metrics_body(1), nonce="ab" * 16)
    env.store.revoke(ids[0].peer_id, reason="", now=env.clock.now, max_revoked=10)
    assert env.report(ids[0], "metrics", metrics_body(1), nonce="ab" * 16) == raw  # stored before: same answer

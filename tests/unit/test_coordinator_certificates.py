"""Rounds are credited only with a commit certificate, and one peer can make the coordinator store only so much.

A committed round's members, weights and state come from what a majority of admitted members signed, never from the
first report. Forged certificates (bad signature, too few signers, a signer without a ticket or with a ticket from
another authority, a revoked signer, a certificate for another round) are kept as the reporter's claim and
credit nothing."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _coordinator_helpers import make_identities, metrics_body, round_body
from _ticket_helpers import ServiceEnv, certificate, certified_round_body

from swarmloco.coordinator.authority import AuthorityConfig
from swarmloco.protocol.trust.admission import AdmissionPolicy, Ticket
from swarmloco.protocol.trust.certificates import Certificate
from swarmloco.protocol.trust.identity import Identity

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    return make_identities(tmp_path_factory.mktemp("ids"), 5)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[ServiceEnv]:
    e = ServiceEnv(tmp_path / "db.sqlite")
    yield e
    e.close()


def _post(env: ServiceEnv, reporter: Identity, cert: Certificate | str | None, rnd: int = 1) -> dict[str, object]:
    base = round_body(rnd, [reporter.peer_id])
    if isinstance(cert, Certificate):
        body = certified_round_body(base, cert)
    else:
        body = {**base, "certificate": cert} if cert is not None else base
    status, answer = env.report(reporter, "round", body)
    assert status == 200, answer
    return answer


def test_valid_certificate_credits_with_the_certified_members(env: ServiceEnv, ids: list[Identity]) -> None:
    tickets = env.admit(*ids[:3])
    cert = certificate(ids[:2], tickets, run_id="run", round=1, members=[i.peer_id for i in ids[:3]], swarm=3)
    assert _post(env, ids[0], cert)["credited"] is True
    [row] = env.rounds()
    assert row["certified"] and row["state_hash"] == cert.statement.new_hash
    assert row["members"] == list(cert.statement.members) and row["tokens"] == list(cert.statement.weights)
    assert _post(env, ids[1], cert)["credited"] is True  # another member's report joins the same round
    assert _post(env, ids[1], cert)["credited"] is True  # ... and a second report of it is not a second credit
    assert [env.peer(i)["rounds_committed"] for i in ids[:2]] == [1, 1]
    [row] = env.rounds()
    assert sorted(row["reporters"]) == sorted([ids[0].peer_id, ids[1].peer_id, ids[1].peer_id])


def test_attack_a_free_riders_claims_earn_no_credit(env: ServiceEnv, ids: list[Identity]) -> None:
    """The ledger credits what certified rounds credited as verified work, never the tokens a peer reports: a
    free rider the round did not credit (its Δ did not lower the loss) shows 0 credited tokens, whatever it says."""
    tickets = env.admit(*ids[:3])
    members = sorted(i.peer_id for i in ids[:3])
    rider = next(i for i in ids[:3] if i.peer_id == members[2])
    credit = [1000, 1001, 0]  # merged at weight 4000 (its capped claim), credited nothing
    for rnd in (1, 2):
        cert = certificate(ids[:3], tickets, run_id="run", round=rnd, members=members,
                           weights=[1000, 1001, 4000], credit=credit)
        for reporter in ids[:3]:
            _post(env, reporter, cert, rnd)
    assert env.report(rider, "metrics", metrics_body(1, tokens_total=10**12))[0] == 200
    got = {i.peer_id: env.peer(i) for i in ids[:3]}
    assert [got[m]["credited_tokens"] for m in members] == [2000, 2002, 0]
    assert [got[m]["credited_rounds"] for m in members] == [2, 2, 0]
    assert got[rider.peer_id]["tokens_total"] == 10**12  # its own word, kept apart from credit
    assert [r["tokens"] for r in env.rounds()] == [credit, credit]
    assert env.store.credited_tokens() == 4002


def test_attack_first_report_no_longer_decides_the_round(env: ServiceEnv, ids: list[Identity]) -> None:
    """Defence: the round comes from the certificate. Before, the first report's members and tokens were the
    round's, so one peer could claim all the tokens, or a round that never happened."""
    tickets = env.admit(*ids[:3])
    liar = {**round_body(1, [ids[2].peer_id]), "tokens": [10**12]}
    answer = env.report(ids[2], "round", liar)[1]
    assert answer["credited"] is False and "claim" in str(answer["reason"])
    assert env.rounds() == [] and env.peer(ids[2])["rounds_committed"] == 0
    cert = certificate(ids[:2], tickets, run_id="run", round=1)
    _post(env, ids[0], cert)
    [row] = env.rounds()
    assert row["members"] == sorted(i.peer_id for i in ids[:2]) and row["tokens_total"] == 2001


def _tamper_weights(cert: Certificate) -> Certificate:
    s = cert.statement
    return Certificate(dataclasses.replace(s, weights=(10**9, *s.weights[1:]), work=10**10), cert.signatures,
                       cert.tickets)


def _wrong_types(cert: Certificate) -> str:
    value = json.loads(cert.to_bytes())
    value["statement"]["members"] = [[1], "x"]
    return json.dumps(value)


FORGERIES: dict[str, tuple[Callable[[list[Identity], dict[str, str], dict[str, str]], Certificate | str], str]] = {
    "weights changed after signing": (
        lambda ids, t, _: _tamper_weights(certificate(ids[:2], t, run_id="run", round=1)), "invalid"),
    "too few signatures for the swarm": (
        lambda ids, t, _: certificate(ids[:1], t, run_id="run", round=1, members=[i.peer_id for i in ids[:3]]),
        "needed"),
    "signer without a ticket": (
        lambda ids, t, _: certificate(ids[:2], {ids[0].peer_id: t[ids[0].peer_id]}, run_id="run", round=1),
        "not admitted"),
    "tickets from another authority": (lambda ids, _, fake: certificate(ids[:2], fake, run_id="run", round=1),
                                       "not admitted"),
    "certificate for another round": (lambda ids, t, _: certificate(ids[:2], t, run_id="run", round=2), "round 2"),
    "certificate for another run": (lambda ids, t, _: certificate(ids[:2], t, run_id="elsewhere", round=1), "run"),
    "reporter is not a member": (
        lambda ids, t, _: certificate(ids[1:3], t, run_id="run", round=1), "not a member"),
    "not JSON": (lambda ids, t, _: "{" * 40, "malformed"),
    "deeply nested": (lambda ids, t, _: "[" * 40_000, "malformed"),
    "members of the wrong type": (lambda ids, t, _: _wrong_types(certificate(ids[:2], t, run_id="run", round=1)),
                                  "malformed"),
}


@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_attack_forged_certificates_credit_nothing(env: ServiceEnv, ids: list[Identity], case: str) -> None:
    """Defence: Certificate.problem with this authority's gate, and the match with the report."""
    tickets = env.admit(*ids[:3])
    fake = {i.peer_id: Ticket.issue(ids[4], run_id="run", peer_id=i.peer_id).to_bytes().decode() for i in ids[:3]}
    make, reason = FORGERIES[case]
    answer = _post(env, ids[0], make(ids, tickets, fake))
    assert answer["credited"] is False and reason in str(answer["reason"]), answer
    assert env.rounds() == [] and env.peer(ids[0])["rounds_committed"] == 0
    assert env.store.counts()["reports"] == 1  # kept as the peer's claim


def test_revoked_signer_no_longer_certifies(env: ServiceEnv, ids: list[Identity]) -> None:
    tickets = env.admit(*ids[:3])
    cert = certificate(ids[:2], tickets, run_id="run", round=1)
    env.store.revoke(ids[1].peer_id, reason="", now=env.clock.now, max_revoked=10)
    answer = _post(env, ids[0], cert)
    assert answer["credited"] is False and "revoked" in str(answer["reason"])


def test_private_swarm_certificates_need_no_tickets(tmp_path: Path, ids: list[Identity]) -> None:
    env = ServiceEnv(tmp_path / "db.sqlite", authority=AuthorityConfig(policy=AdmissionPolicy(mode="none")))
    assert _post(env, ids[0], certificate(ids[:2], {}, run_id="run", round=1))["credited"] is True
    assert _post(env, ids[0], certificate(ids[:1], {}, run_id="run", round=2, swarm=3), rnd=2)["credited"] is False
    env.close()


def test_certificate_is_stored_once_with_its_round(env: ServiceEnv, ids: list[Identity]) -> None:
    tickets = env.admit(*ids[:2])
    cert = certificate(ids[:2], tickets, run_id="run", round=1)
    for reporter in ids[:2]:
        _post(env, reporter, cert)
    with env.store._lock:
        stored = env.store._conn.execute("SELECT certificate FROM rounds").fetchone()[0]
        bodies = [json.loads(r[0]) for r in env.store._conn.execute("SELECT body FROM reports")]
    assert Certificate.from_bytes(stored.encode()) == cert
    assert all(b["certificate"].startswith("sha256:") for b in bodies)  # not one copy per member in the ledger


def test_other_outcomes_are_recorded_as_before(env: ServiceEnv, ids: list[Identity]) -> None:
    env.admit(ids[0])
    body = round_body(3, [ids[0].peer_id], outcome="discarded", failure_reason="peer left")
    assert env.report(ids[0], "round", body)[0] == 200
    [row] = env.rounds()
    assert row["outcome"] == "discarded" and not row["certified"] and row["failure_reasons"] == ["peer left"]


# -- storage bounds --------------------------------------------------------------------------------------------


def test_attack_one_peer_cannot_grow_the_database_without_bound(tmp_path: Path, ids: list[Identity]) -> None:
    """Defence: the newest `keep_reports_per_peer` reports per peer and run are kept, with their rows."""
    env = ServiceEnv(tmp_path / "db.sqlite", keep_reports_per_peer=20)
    tickets = env.admit(ids[0], ids[1])
    cert = certificate(ids[:1], tickets, run_id="run", round=1)
    _post(env, ids[0], cert)
    for step in range(60):
        assert env.report(ids[0], "metrics", metrics_body(step))[0] == 200
        if step % 10 == 0:
            discarded = round_body(100 + step, [ids[0].peer_id], outcome="discarded", failure_reason="x")
            assert env.report(ids[0], "round", discarded)[0] == 200
        assert env.store.counts()["reports"] <= 22
    assert env.report(ids[1], "metrics", metrics_body(0))[0] == 200
    metrics = env.service.metrics(run_id="run", peer_id=ids[0].peer_id, limit=100, cursor=None, descending=False)
    steps = [m["step"] for m in metrics["items"]]
    assert steps == list(range(60 - len(steps), 60)) and 10 <= len(steps) <= 22  # the newest are kept
    rounds = env.rounds()
    assert rounds[0]["certified"] and rounds[0]["round"] == 1  # certified history stays, its reports pruned or not
    assert all(r["reporters"] for r in rounds[1:])  # uncertified rows nobody reports any more are gone
    assert len(rounds) < 7
    assert len(env.service.metrics(run_id="run", peer_id=ids[1].peer_id, limit=10, cursor=None,
                                   descending=False)["items"]) == 1  # another peer's rows are untouched
    env.close()


def test_attack_report_flood_from_one_peer_gets_429(tmp_path: Path, ids: list[Identity]) -> None:
    """Defence: the per-peer bucket, independent of the client address."""
    env = ServiceEnv(tmp_path / "db.sqlite", peer_rate_burst=5, peer_rate_per_s=0.01)
    env.admit(ids[0], ids[1])
    statuses = [env.report(ids[0], "metrics", metrics_body(s))[0] for s in range(7)]
    assert statuses == [200] * 5 + [429] * 2
    assert env.report(ids[1], "metrics", metrics_body(0))[0] == 200
    env.clock.now += 200  # refilled
    assert env.report(ids[0], "metrics", metrics_body(8))[0] == 200
    env.close()


def test_private_swarm_bounds_the_number_of_runs(tmp_path: Path, ids: list[Identity]) -> None:
    private = AuthorityConfig(policy=AdmissionPolicy(mode="none"))
    env = ServiceEnv(tmp_path / "db.sqlite", max_runs=3, authority=private)
    statuses = [env.report(ids[0], "metrics", metrics_body(0), run_id=f"r{i}")[0] for i in range(4)]
    assert statuses == [200, 200, 403, 403]  # the coordinator's own run "run" is the third
    assert env.report(ids[0], "metrics", metrics_body(1), run_id="r1")[0] == 200  # a known run still takes reports
    env.close()


def test_service_config_validates_bounds() -> None:
    from swarmloco.coordinator.service import ServiceConfig

    for bad in ({"keep_reports_per_peer": 1}, {"peer_rate_per_s": 0}, {"max_runs": 0}):
        with pytest.raises(ValueError):
            ServiceConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AuthorityConfig(new_global_burst=0)

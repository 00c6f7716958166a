"""Admission that costs something: the proof of work a new identity brings to an ``open`` run (protocol/trust/
puzzle.py), how the authority checks it (coordinator/authority.py), how a peer solves it (peer/ticket_client.py,
peer/tickets.py), and the coordinator's invite-only default with its generated code (coordinator/cli.py). The
authority runs on an injected clock; the tests' puzzles are TEST_WORK_BITS small."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from _coordinator_helpers import TEST_WORK_BITS, make_identities
from _ticket_helpers import ServiceEnv

from swarmloco.coordinator.authority import DEFAULT_WORK_BITS, AuthorityConfig
from swarmloco.coordinator.cli import INVITE_SUFFIX, add_coordinator_arguments, generated_invite, public_join
from swarmloco.peer import ticket_client, tickets
from swarmloco.protocol.trust import puzzle
from swarmloco.protocol.trust.admission import AdmissionPolicy, Ticket
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.ticket_request import (
    TicketRequest,
    TicketRequestError,
    build_ticket_request,
    parse_ticket_request,
)

pytestmark = pytest.mark.timeout(60)
PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
OTHER = "12D3KooWGjEaPBd3sRZdsyrNpvWDRFHdR3QX4cRAdWyTspxw87Yb"
BITS = 12  # the pure puzzle tests: a few thousand hashes


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    return make_identities(tmp_path_factory.mktemp("ids"), 3)


def _env(tmp_path: Path, mode: str = "open", **kw: Any) -> ServiceEnv:
    policy_kw = {k: kw.pop(k) for k in ("invite_codes", "allowlist") if k in kw}
    kw.setdefault("work_bits", TEST_WORK_BITS)
    tmp_path.mkdir(parents=True, exist_ok=True)
    return ServiceEnv(tmp_path / "db.sqlite", authority=AuthorityConfig(policy=AdmissionPolicy(mode=mode, **policy_kw),
                                                                        **kw))


def _not_a_proof(run_id: str, peer_id: str, timestamp: float, bits: int, work: str) -> str:
    """``work`` itself when it does not check here (nearly always); otherwise the next counter that does not."""
    n = int(work)
    while puzzle.check(run_id, peer_id, timestamp, str(n), bits):
        n += 1
    return str(n)


# -- the puzzle --------------------------------------------------------------------------------------------------


def test_a_solved_puzzle_checks_and_binds_run_peer_and_timestamp() -> None:
    work = puzzle.solve("run", PEER, 1000.5, BITS, max_s=30)
    assert puzzle.check("run", PEER, 1000.5, work, BITS)
    digest = puzzle.hashlib.sha256(puzzle.challenge("run", PEER, 1000.5) + work.encode()).digest()
    assert int.from_bytes(digest, "big") >> (256 - BITS) == 0  # BITS leading zero bits, as promised
    assert puzzle.check("run", PEER, 1000, puzzle.solve("run", PEER, 1000, BITS, max_s=30), BITS)  # int == float
    for run_id, peer_id, timestamp in (("other", PEER, 1000.5), ("run", OTHER, 1000.5), ("run", PEER, 1000.25)):
        assert not puzzle.check(run_id, peer_id, timestamp, _not_a_proof(run_id, peer_id, timestamp, BITS, work),
                                BITS)
    for junk in ("", "-1", "1e3", " 1", "x", "1" * (puzzle.MAX_WORK_CHARS + 1), None, 7):
        assert not puzzle.check("run", PEER, 1000.5, junk, BITS)  # type: ignore[arg-type]
    assert puzzle.solve("run", PEER, 1000.5, 0, max_s=1) == "" and puzzle.check("run", PEER, 1000.5, "", 0)


def test_the_solver_is_bounded_and_bits_are_bounded() -> None:
    with pytest.raises(puzzle.PuzzleTimeout, match="found no proof within 0.01s") as e:
        puzzle.solve("run", PEER, 1000.5, puzzle.MAX_BITS, max_s=0.01)
    assert e.value.hashes > 0
    calls = iter(range(10**6))
    with pytest.raises(puzzle.PuzzleTimeout, match="was stopped"):
        puzzle.solve("run", PEER, 1000.5, puzzle.MAX_BITS, max_s=60, stop=lambda: next(calls) >= 2)
    for bad in (-1, puzzle.MAX_BITS + 1, True, 8.0, "8"):
        assert not puzzle.valid_bits(bad)
        with pytest.raises(ValueError, match="bits must be an int"):
            puzzle.check("run", PEER, 1.0, "1", bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="work_bits must be an int"):
            AuthorityConfig(work_bits=bad)  # type: ignore[arg-type]
    assert AuthorityConfig().work_bits == DEFAULT_WORK_BITS == 27 and puzzle.hash_rate(0.01) > 0


# -- the request carries it --------------------------------------------------------------------------------------


def test_work_is_signed_bounded_and_optional(ids: list[Identity]) -> None:
    request = build_ticket_request(ids[0], "run", timestamp=1000.5, work="123")
    assert parse_ticket_request(request.encode()).work == "123" and b'"work":"123"' in request.signed_bytes()
    with pytest.raises(TicketRequestError) as e:  # a proof swapped in transit breaks the signature
        parse_ticket_request(json.dumps({**request.to_json(), "work": "124"}))
    assert e.value.status == 401
    for bad in ("1" * (puzzle.MAX_WORK_CHARS + 1), "12a", " 1", 12, None):
        with pytest.raises(TicketRequestError, match="work must be at most") as e:
            parse_ticket_request(json.dumps({**request.to_json(), "work": bad}))
        assert e.value.status == 400
    # without work the request is the format from before the field: no "work" key sent, none signed
    plain = build_ticket_request(ids[0], "run", timestamp=1000.5)
    assert "work" not in plain.to_json() and b"work" not in plain.signed_bytes()
    assert parse_ticket_request(plain.encode()) == plain and plain.work == ""
    assert TicketRequest(**{**plain.to_json(), "work": ""}).signed_bytes() == plain.signed_bytes()


# -- the authority checks it -------------------------------------------------------------------------------------


def _proved(env: ServiceEnv, identity: Identity, *, peer_id: str | None = None, run_id: str = "run",
            timestamp: float | None = None) -> str:
    """A proof solved for the given (by default: this identity's own) run, peer id and timestamp."""
    ts = env.clock.now if timestamp is None else timestamp
    return puzzle.solve(run_id, peer_id or identity.peer_id, ts, env.service.authority.work_bits, max_s=10)


def test_a_new_identity_needs_a_proof_in_open_mode(tmp_path: Path, ids: list[Identity]) -> None:
    env = _env(tmp_path, new_per_address_burst=1, new_per_address_per_h=1)
    status, body = env.ticket(ids[0], work="", client="203.0.113.7")
    assert status == 428 and body["work_bits"] == TEST_WORK_BITS
    assert f"must prove {TEST_WORK_BITS} bits of work" in body["error"] and "carries no proof" in body["error"]
    now, me = env.clock.now, ids[0].peer_id
    wrong = {  # proofs, but for another identity, another run, another timestamp, or no proof at all
        "another peer": _proved(env, ids[0], peer_id=ids[1].peer_id),
        "another run": _proved(env, ids[0], run_id="other-run"),
        "another timestamp": _proved(env, ids[0], timestamp=now - 1),
        "a wrong one": "0",
    }
    for what, work in wrong.items():
        work = _not_a_proof("run", me, now, TEST_WORK_BITS, work)
        status, body = env.ticket(ids[0], work=work, client="203.0.113.7")
        assert status == 428 and "does not check" in body["error"], what
    assert env.store.latest_ticket("run", me) is None
    # none of the refusals spent the address's only token: the proven request gets its ticket
    status, body = env.ticket(ids[0], work=_proved(env, ids[0]), client="203.0.113.7")
    assert status == 200 and Ticket.from_bytes(body["ticket"]).peer_id == me
    assert env.service.authority.info()["work_bits"] == TEST_WORK_BITS
    env.close()


def test_renewals_need_no_proof_but_an_expired_ticket_does(tmp_path: Path, ids: list[Identity]) -> None:
    env = _env(tmp_path)
    assert env.ticket(ids[0])[0] == 200  # env.ticket solves the puzzle unless given work
    env.clock.now += 1800  # half-life: the peer renews while it holds a valid ticket
    status, renewed = env.ticket(ids[0], work="")
    assert status == 200 and renewed["expires_at"] == pytest.approx(env.clock.now + 3600, abs=0.01)
    env.clock.now += 3601  # expired: a new identity again, as far as the authority knows
    assert env.ticket(ids[0], work="")[0] == 428
    assert env.ticket(ids[0])[0] == 200
    env.close()


@pytest.mark.parametrize("mode,extra", [("invite", {"invite_codes": frozenset({"sesame"})}),
                                        ("allowlist", None)])
def test_invite_and_allowlist_runs_ask_no_work(tmp_path: Path, ids: list[Identity], mode: str,
                                               extra: dict[str, Any] | None) -> None:
    kw = extra if extra is not None else {"allowlist": frozenset({ids[0].peer_id})}
    env = _env(tmp_path, mode, work_bits=DEFAULT_WORK_BITS, **kw)  # a minute's work, were it asked for
    assert env.service.authority.work_bits == 0 and env.service.authority.info()["work_bits"] == 0
    assert env.ticket(ids[0], work="", invite="sesame")[0] == 200
    env.close()


def test_zero_bits_turn_the_puzzle_off(tmp_path: Path, ids: list[Identity]) -> None:
    env = _env(tmp_path, work_bits=0)
    assert env.ticket(ids[0], work="")[0] == 200 and env.service.authority.info()["work_bits"] == 0
    env.close()


def test_attack_minting_identities_from_one_address_costs_work_for_each(tmp_path: Path) -> None:
    """Defence: the proof of work per new identity. Without it (work_bits=0, the open run before this change) one
    address gets a ticket for every key it generates as fast as it can ask, up to the rate limits' burst."""
    sybils = make_identities(tmp_path / "sybils", 12)
    generous = {"new_per_address_burst": 100.0, "new_global_burst": 100.0}
    free = _env(tmp_path / "free", work_bits=0, **generous)
    assert [free.ticket(s, work="", client="203.0.113.7")[0] for s in sybils] == [200] * 12
    free.close()
    costly = _env(tmp_path / "costly", **generous)
    assert [costly.ticket(s, work="", client="203.0.113.7")[0] for s in sybils] == [428] * 12  # zero tickets
    hashes = 0
    for s in sybils:  # each identity needs its own proof: about 2**bits hashes apiece
        work = _proved(costly, s)
        hashes += int(work) + 1
        assert costly.ticket(s, work=work, client="203.0.113.7")[0] == 200
    assert hashes > len(sybils)  # work was done (the mean is len(sybils) * 2**TEST_WORK_BITS)
    costly.close()


# -- the peer solves it --------------------------------------------------------------------------------------------


def test_a_peer_solves_for_its_first_ticket_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 ids: list[Identity]) -> None:
    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(ticket_client, "fetch_authority", lambda url, timeout: {
        "run_id": "run", "authority": ids[2].peer_id, "admission": "open", "work_bits": 9})

    def fake_request(url: str, identity: Identity, run_id: str, **kw: Any) -> Ticket:
        asked.append(kw)
        return Ticket.issue(ids[2], run_id=run_id, peer_id=identity.peer_id)

    monkeypatch.setattr(ticket_client, "request_ticket", fake_request)
    admission = tickets.Admission(tickets.AdmissionConfig(), ids[0], "run", "http://127.0.0.1:9")
    renewed = admission._obtain()
    assert renewed.peer_id == ids[0].peer_id
    assert [(a["work_bits"], a["renewal"]) for a in asked] == [(9, False), (9, True)]  # first ticket, then renewal
    assert asked[0]["stop"]() is False  # solving ends when the peer stops


# -- the coordinator's default: invite-only ------------------------------------------------------------------------


def test_the_coordinator_defaults_to_invite_with_a_kept_generated_code(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_coordinator_arguments(parser)
    args = parser.parse_args([])
    assert args.admission == "invite" and args.work_bits is None
    path = tmp_path / ("runs.sqlite" + INVITE_SUFFIX)
    code = generated_invite(path)
    assert len(code) >= 20 and path.stat().st_mode & 0o777 == 0o600
    assert generated_invite(path) == code  # a restarted coordinator accepts the code its peers were given
    path.write_text("x" * 300)
    with pytest.raises(ValueError, match="one invite code of at most 256"):
        generated_invite(path)
    info = {"url": "http://127.0.0.1:8000", "port": 8000, "run_id": "r", "dht_maddrs": []}
    assert public_join(info, host="127.0.0.1", dht_host="127.0.0.1", invite=code)[0].endswith(f"--invite {code}")

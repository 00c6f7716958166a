"""The coordinator as the run's authority, end to end on 127.0.0.1: the peer's ticket client against a real
coordinator (and against a lying one), the admission flags, `revoke`/`unrevoke` from another process while the
server runs, and the signed revocation list published to the DHT."""
from __future__ import annotations

import argparse
import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from _coordinator_helpers import (
    ROOT,
    TEST_WORK_BITS,
    child_env,
    hello_body,
    kill,
    make_identities,
    spawn_coordinator,
    start_server,
)

from swarmloco.coordinator.authority import AuthorityConfig
from swarmloco.coordinator.cli import add_coordinator_arguments, admission_policy, run_coordinator
from swarmloco.coordinator.server import CoordinatorConfig, CoordinatorServer
from swarmloco.coordinator.service import ServiceConfig
from swarmloco.peer.ticket_client import TicketError, fetch_authority, fetch_revocations, request_ticket
from swarmloco.protocol.trust.admission import AdmissionPolicy, Revocations, Ticket
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.reports import build_report

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    return make_identities(tmp_path_factory.mktemp("ids"), 3)


def test_ticket_client_against_a_real_coordinator(tmp_path: Path, ids: list[Identity]) -> None:
    policy = AdmissionPolicy(mode="invite", invite_codes=frozenset({"sesame"}))
    server = start_server(tmp_path / "db.sqlite", run_id="run", authority=AuthorityConfig(policy=policy))
    try:
        info = fetch_authority(server.url, timeout=10)
        assert info == {"run_id": "run", "authority": server.identity.peer_id, "admission": "invite", "work_bits": 0}
        with pytest.raises(TicketError, match="^coordinator refused a ticket: 403 invite code is missing or wrong$"):
            request_ticket(server.url, ids[0], "run", timeout=10)
        ticket = request_ticket(server.url, ids[0], "run", invite="sesame", timeout=10)
        assert ticket.peer_id == ids[0].peer_id and ticket.authority == server.identity.peer_id
        with pytest.raises(TicketError, match="403 this coordinator issues tickets for run 'run'"):
            request_ticket(server.url, ids[0], "other", invite="sesame", timeout=10)
        with pytest.raises(TicketError, match="does not admit us"):  # we pinned an authority; this is not it
            request_ticket(server.url, ids[0], "run", invite="sesame", timeout=10, authority=ids[2].peer_id)
        listed = Revocations.parse(fetch_revocations(server.url, timeout=10), run_id="run",
                                   authority=info["authority"])
        assert listed.serial == 0
        report = build_report(ids[0], "run", "hello", hello_body())
        assert requests.post(server.url + "/api/reports", data=report.encode(), timeout=10).status_code == 200
        big = requests.post(server.url + "/api/tickets", data=b"x" * 10_000, timeout=10)
        assert big.status_code == 413 and big.json()["error"]
    finally:
        server.stop()
    with pytest.raises(TicketError, match="unreachable"):
        fetch_authority(server.url, timeout=2)


class _LyingCoordinator(http.server.BaseHTTPRequestHandler):
    """Names one authority and hands out tickets signed by another key (or garbage)."""

    authority = ""
    forger: Identity
    answer = "forged"

    def _send(self, status: int, body: object) -> None:
        blob = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(blob)))
        self.end_headers()
        self.wfile.write(blob)

    def do_GET(self) -> None:
        self._send(200, {"run_id": "run", "authority": self.authority, "admission": "open"})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.answer == "garbage":
            return self._send(200, {"ticket": "not a ticket"})
        ticket = Ticket.issue(self.forger, run_id="run", peer_id=request["peer_id"])
        self._send(200, {"ticket": ticket.to_bytes().decode(), "expires_at": ticket.expires_at})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def liar(ids: list[Identity]) -> Iterator[str]:
    _LyingCoordinator.authority, _LyingCoordinator.forger = ids[1].peer_id, ids[2]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LyingCoordinator)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def test_attack_ticket_client_refuses_a_ticket_not_signed_by_the_authority(liar: str, ids: list[Identity]) -> None:
    """Defence: the client checks the ticket against the authority it fetched. Without it, a man in the middle
    hands the peer a ticket every honest peer refuses, or one from an authority of its own."""
    with pytest.raises(TicketError, match="does not admit us: ticket is signed by"):
        request_ticket(liar, ids[0], "run", timeout=10)
    _LyingCoordinator.answer = "garbage"
    try:
        with pytest.raises(TicketError, match="malformed ticket"):
            request_ticket(liar, ids[0], "run", timeout=10)
    finally:
        _LyingCoordinator.answer = "forged"


def test_ticket_client_solves_the_admission_puzzle(tmp_path: Path, ids: list[Identity]) -> None:
    server = start_server(tmp_path / "db.sqlite", run_id="run")  # open, with a TEST_WORK_BITS puzzle
    try:
        assert fetch_authority(server.url, timeout=10)["work_bits"] == TEST_WORK_BITS
        assert request_ticket(server.url, ids[0], "run", timeout=10).peer_id == ids[0].peer_id  # solved first
        # a client that believed no work was needed is told how much (428), solves it and asks again
        assert request_ticket(server.url, ids[1], "run", timeout=10, work_bits=0).peer_id == ids[1].peer_id
        assert request_ticket(server.url, ids[0], "run", timeout=10, renewal=True).peer_id == ids[0].peer_id
        with pytest.raises(TicketError, match="40-bit proof of work, about .* more than the 1s we give it"):
            request_ticket(server.url, ids[2], "run", timeout=10, work_bits=40, max_work_s=1)
    finally:
        server.stop()


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_coordinator_arguments(parser)
    return parser.parse_args(list(argv))


def test_admission_flags(tmp_path: Path, ids: list[Identity], capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "codes").write_text("alpha\n\n  beta  \n")
    (tmp_path / "allow").write_text(f"# lab machines\n{ids[0].peer_id}\n")
    policy = admission_policy(_args("--admission", "invite", "--invite-file", str(tmp_path / "codes"),
                                    "--invite-code", "gamma", "--ticket-lifetime", "600"))
    assert policy.invite_codes == {"alpha", "beta", "gamma"} and policy.ticket_s == 600
    assert admission_policy(_args("--admission", "allowlist", "--allowlist", str(tmp_path / "allow"))).allowlist \
        == {ids[0].peer_id}
    default = admission_policy(_args(), generated="made-up")  # invite-only, with the code the CLI generates
    assert default.mode == "invite" and default.invite_codes == {"made-up"}
    assert admission_policy(_args("--invite-code", "x"), generated="made-up").invite_codes == {"x"}
    db = str(tmp_path / "db.sqlite")
    for argv, message in [
        (["--admission", "invite", "--invite-code", " "], "needs at least one invite code"),
        (["--work-bits", "8"], "--work-bits needs --admission open"),
        (["--admission", "open", "--work-bits", "41"], "work_bits must be an int in [0, 40]"),
        (["--admission", "open", "--invite-code", "x"], "need --admission invite"),
        (["--admission", "allowlist"], "needs an allowlist"),
        (["--admission", "allowlist", "--allowlist", str(tmp_path / "missing")], "No such file"),
        (["--allowlist", str(tmp_path / "allow")], "needs --admission allowlist"),
        (["--ticket-lifetime", "5"], "ticket lifetime"),
    ]:
        assert run_coordinator(_args("--db", db, "--no-dht", "--port", "0", *argv)) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_private_swarm_warns_at_start(tmp_path: Path) -> None:
    proc, info = spawn_coordinator(tmp_path / "db.sqlite", tmp_path / "ready.json", "--no-dht", "--admission", "none")
    try:
        assert info["admission"] == "none" and info["authority"].startswith("12D3KooW")
        assert (tmp_path / "db.sqlite.key").exists()  # the authority key exists without a DHT node too
    finally:
        kill(proc)
    assert "private swarm: anyone who can reach the peers takes part" in (tmp_path / "ready.log").read_text()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarmloco.coordinator", *argv], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=60, check=False)


def test_revoke_from_another_process_while_the_server_runs(tmp_path: Path, ids: list[Identity]) -> None:
    db = tmp_path / "db.sqlite"
    server = start_server(db, run_id="run")
    try:
        request_ticket(server.url, ids[0], "run", timeout=10)

        def hello() -> int:
            report = build_report(ids[0], "run", "hello", hello_body())
            return requests.post(server.url + "/api/reports", data=report.encode(), timeout=10).status_code

        assert hello() == 200
        done = _cli("revoke", "--db", str(db), ids[0].peer_id, "--reason", "sent garbage")
        assert done.returncode == 0 and "revocation list serial 1" in done.stdout, done.stderr
        assert hello() == 403
        with pytest.raises(TicketError, match="403 peer is revoked"):
            request_ticket(server.url, ids[0], "run", timeout=10)
        listed = Revocations.parse(fetch_revocations(server.url, timeout=10), run_id="run",
                                   authority=server.identity.peer_id)
        assert listed.serial == 1 and listed.peer_ids == (ids[0].peer_id,)
        done = _cli("--db", str(db), "unrevoke", ids[0].peer_id)  # --db before the action works too
        assert done.returncode == 0 and "serial 2" in done.stdout, done.stderr
        assert hello() == 200
        assert fetch_revocations(server.url, timeout=10)["serial"] == 2
        bad = _cli("revoke", "--db", str(db), "not-a-peer-id")
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1
        missing = _cli("revoke", "--db", str(tmp_path / "nope.sqlite"), ids[1].peer_id)
        assert missing.returncode == 2 and "does not exist" in missing.stderr
    finally:
        server.stop()


@pytest.mark.integration
def test_revocation_list_is_published_to_the_dht(tmp_path: Path, ids: list[Identity]) -> None:
    import hivemind

    from swarmloco.protocol.base.records import revocations_key

    config = CoordinatorConfig(db=tmp_path / "db.sqlite", port=0, dht=True, service=ServiceConfig(run_id="run"))
    server = CoordinatorServer(config).start(timeout=60)
    client = None
    try:
        client = hivemind.DHT(initial_peers=server.dht_maddrs, start=True, client_mode=True)

        def published() -> Revocations:
            found = client.get(revocations_key("run"), latest=True)
            assert found is not None, "nothing under the revocations key"
            entry = found.value[server.identity.peer_id]
            return Revocations.parse(entry.value, run_id="run", authority=server.identity.peer_id)

        assert published().serial == 0  # published at start
        server.store.revoke(ids[0].peer_id, reason="", now=0.0, max_revoked=10)
        assert server.publish_revocations() is True
        assert published().peer_ids == (ids[0].peer_id,) and published().serial == 1
    finally:
        if client is not None:
            client.shutdown()
        server.stop()

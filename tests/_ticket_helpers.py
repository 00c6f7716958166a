"""Helpers for tests that need admission: tickets from a coordinator, and commit certificates signed by real keys."""
from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _coordinator_helpers import open_authority

from swarmloco.coordinator.server import CoordinatorServer
from swarmloco.coordinator.service import CoordinatorService, ServiceConfig
from swarmloco.coordinator.store import SQLiteStore
from swarmloco.peer.ticket_client import request_ticket
from swarmloco.protocol.trust.admission import Ticket
from swarmloco.protocol.trust.certificates import Certificate, Statement
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.puzzle import solve
from swarmloco.protocol.trust.reports import build_report
from swarmloco.protocol.trust.ticket_request import build_ticket_request


def admit(server: CoordinatorServer | str, identity: Identity, run_id: str, *, invite: str = "") -> Ticket:
    """A ticket for ``identity`` from a running coordinator, over HTTP, as a peer gets it."""
    url = server if isinstance(server, str) else server.url
    return request_ticket(url, identity, run_id, invite=invite, timeout=10)


def admit_all(server: CoordinatorServer | str, identities: Sequence[Identity], run_id: str, *,
              invite: str = "") -> dict[str, str]:
    """Tickets for every identity, as ``{peer_id: ticket text}`` (what a certificate carries)."""
    return {i.peer_id: admit(server, i, run_id, invite=invite).to_bytes().decode() for i in identities}


def service_ticket(service: CoordinatorService, identity: Identity, *, invite: str = "", client: str = "10.0.0.1",
                   **request: Any) -> tuple[int, dict[str, Any]]:
    """Ask the service (no HTTP) for a ticket; returns the status and body. The request carries the proof of work
    the service's authority asks for, solved here, unless ``work`` is given."""
    run_id = request.pop("run_id", service.config.run_id)
    request.setdefault("timestamp", time.time())
    if "work" not in request:
        request["work"] = solve(run_id, identity.peer_id, request["timestamp"], service.authority.work_bits, max_s=10)
    raw = build_ticket_request(identity, run_id, invite=invite, **request).encode()
    answer = service.request_ticket(raw, client=client)
    return answer.status, answer.body


def state_hash(round: int) -> str:
    """The 64-hex state hash `_coordinator_helpers.round_body` reports for a committed `round`."""
    return f"{round:08x}" * 8


def certificate(signers: Sequence[Identity], tickets: dict[str, str], *, run_id: str, round: int,
                members: Sequence[str] | None = None, weights: Sequence[int] | None = None, swarm: int | None = None,
                new_hash: str | None = None, credit: Sequence[int] | None = None) -> Certificate:
    """A commit certificate for `round` signed by `signers` (members default to the signers, weights to
    1000, 1001, ... like `round_body`; credit, in the members' order, to none: an unscored round)."""
    ids = sorted(members if members is not None else [s.peer_id for s in signers])
    statement = Statement(
        run_id=run_id, round=round, prev_hash=hashlib.sha256(f"prev{round}".encode()).hexdigest(),
        new_hash=new_hash or state_hash(round), members=tuple(ids),
        weights=tuple(weights if weights is not None else [1000 + i for i in range(len(ids))]),
        swarm=swarm if swarm is not None else len(ids), work=10**9, credit=None if credit is None else tuple(credit))
    return Certificate(statement, {s.peer_id: Certificate.sign(s, statement) for s in signers},
                       {s.peer_id: tickets[s.peer_id] for s in signers if s.peer_id in tickets})


def certified_round_body(base: dict[str, Any], cert: Certificate) -> dict[str, Any]:
    """A round report body that carries `cert`, with the members and tokens it certifies."""
    s = cert.statement
    return {**base, "members": list(s.members), "tokens": list(s.weights), "state_hash": s.new_hash,
            "certificate": cert.to_bytes().decode()}


class Clock:
    """A settable clock for the service: tickets expire and buckets refill only when a test says so."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class ServiceEnv:
    """A coordinator service on a fresh database with a fake clock; reports and ticket requests without HTTP."""

    def __init__(self, db: Path, identity: Identity | None = None, **config: Any) -> None:
        self.clock = Clock(time.time())
        self.store = SQLiteStore(db)
        self.config = ServiceConfig(**{"run_id": "run", "authority": open_authority(), **config})
        self.service = CoordinatorService(self.store, self.config, identity=identity, clock=self.clock)

    @property
    def authority(self) -> str:
        return self.service.authority.peer_id

    def ticket(self, identity: Identity, **kw: Any) -> tuple[int, dict[str, Any]]:
        return service_ticket(self.service, identity, timestamp=kw.pop("timestamp", self.clock.now), **kw)

    def admit(self, *identities: Identity) -> dict[str, str]:
        tickets = {}
        for i in identities:
            status, body = self.ticket(i)
            assert status == 200, body
            tickets[i.peer_id] = body["ticket"]
        return tickets

    def report(self, identity: Identity, kind: str, body: dict[str, Any], *, run_id: str | None = None,
               nonce: str | None = None) -> tuple[int, dict[str, Any]]:
        raw = build_report(identity, run_id or self.config.run_id, kind, body, timestamp=self.clock.now,
                           nonce=nonce).encode()
        answer = self.service.ingest(raw, client="10.0.0.1")
        return answer.status, answer.body

    def rounds(self) -> list[dict[str, Any]]:
        return self.service.rounds(run_id=None, peer_id=None, limit=1000, cursor=None, descending=False)["items"]

    def peer(self, identity: Identity) -> dict[str, Any]:
        return self.service.peers(run_id=None, peer_id=identity.peer_id, limit=1, cursor=None,
                                  descending=False)["items"][0]

    def close(self) -> None:
        self.store.close()

"""Helpers for round tests on the in-memory transport: peers, records, applies that can be rolled back, and one
whole round run the way peers run it (each peer on its own thread)."""
from __future__ import annotations

import concurrent.futures
import hashlib
from collections.abc import Callable, Collection

import torch

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.base.records import PROTOCOL_VERSION, PeerRecord
from swarmloco.protocol.chain.state_sync import ServedState, StateServer
from swarmloco.protocol.round.averager import Averager, Contribution, RoundResult
from swarmloco.protocol.round.config import LocalModel, RoundConfig
from swarmloco.protocol.round.groups import Group, RoundAborted
from swarmloco.protocol.round.schedule import view_leader, view_rank
from swarmloco.protocol.testing.fake import FakeNetwork, FakeTransport
from swarmloco.protocol.trust.admission import Gate, Ticket
from swarmloco.protocol.trust.certificates import Head
from swarmloco.protocol.trust.identity import Identity

H0 = "0" * 64  # θ_0 of the fake run
NUMEL = 1000  # several quantisation blocks, not a whole number of them: shards of unequal size
MODEL = LocalModel(fingerprint="fp", config={"numel": NUMEL}, numel=NUMEL)
Probe = Callable[[bytes], torch.Tensor]  # the credit probe: audit seed -> g
FAST = dict(
    grace_min_s=0.0, grace_max_s=0.2, round_timeout_s=5, exchange_timeout_s=1, control_timeout_s=1, codec="fp32"
)


def averager_for(transport: FakeTransport, *, quorum: int, hooks: Hooks | None = None,
                 gate: Gate | None = None, model: LocalModel = MODEL, probe: Probe | None = None,
                 **cfg: object) -> Averager:
    settings = {**FAST, **cfg}
    averager = Averager(transport, RoundConfig(quorum=quorum, **settings), model,  # type: ignore[arg-type]
                        credentials=transport.credentials, gate=gate or Gate(transport.run_id, None),
                        genesis_hash=H0, hooks=hooks, probe=probe)
    averager.start()
    averager.set_state(Head(0, H0))
    return averager


def peers(net: FakeNetwork, n: int, *, quorum: int, hooks: dict[int, Hooks] | None = None,
          probe: Probe | None = None, **cfg: object) -> list[Averager]:
    out = []
    for i in range(n):
        averager = averager_for(net.peer(), quorum=quorum, hooks=(hooks or {}).get(i), probe=probe, **cfg)
        announce(averager.transport)  # type: ignore[arg-type]
        out.append(averager)
    return out


def by_rank(averagers: list[Averager], state_hash: str = H0) -> list[Averager]:
    """The averagers in leader order for a round starting from `state_hash` (the first one leads)."""
    return sorted(averagers, key=lambda a: view_rank(state_hash, 0, a.transport.peer_id))


def view_0_only_leader(net: FakeNetwork, ids: list[str]) -> FakeTransport:
    """A new peer (not announced yet) that, among `ids` and itself, leads view 0 of θ_0 and not view 1."""
    transport = net.peer()
    while view_leader(H0, 0, [*ids, transport.peer_id]) != transport.peer_id or \
            view_leader(H0, 1, [*ids, transport.peer_id]) == transport.peer_id:
        transport = net.peer()
    return transport


def announce(transport: FakeTransport, round_number: int = 0, state_hash: str = H0, *, work: int = 0,
             ready: bool = True, **extra: object) -> None:
    record = PeerRecord.announce(fingerprint="fp", config_json="{}", round=round_number, state_hash=state_hash,
                                 work=work, ready=ready, now=transport.clock.time())
    transport.update_record(**{**record.to_value(), **extra})


def join_request(transport: FakeTransport) -> pb.JoinRequest:
    return pb.JoinRequest(protocol_version=PROTOCOL_VERSION, run_id=transport.run_id, fingerprint="fp", round=0,
                          state_hash=H0, ticket=transport.credentials.ticket)


def delta(i: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.full((numel,), float(i + 1))


class Applied:
    """An outer step that records what it was given and returns a hash of it (equal averages, equal hashes), and
    a rollback that records that it was undone."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []
        self.rolled_back = 0

    def __call__(self, average: torch.Tensor) -> str:
        self.calls.append(average.clone())
        return hashlib.sha256(average.numpy().tobytes()).hexdigest()

    def rollback(self) -> None:
        self.rolled_back += 1

    @property
    def holds_new_state(self) -> bool:
        return len(self.calls) > self.rolled_back


def run(averager: Averager, group: Group, i: int, applied: Applied, tokens: int = 100) -> RoundResult:
    return averager.run_round(group, Contribution(delta=delta(i, averager.model.numel), tokens=tokens), apply=applied,
                              rollback=applied.rollback)


def _pool(averagers: list[Averager]) -> concurrent.futures.Executor:
    """A thread per averager, driving it as its training thread would (on the network's clock)."""
    return averagers[0].transport.net.pool(len(averagers))  # type: ignore[attr-defined]


def whole_round(
    averagers: list[Averager], tokens: Callable[[int], int] = lambda i: 100
) -> tuple[list[RoundResult], list[Applied]]:
    """Every averager finds its group and runs the round, each on its own thread, as peers do."""
    applied = [Applied() for _ in averagers]

    def one(i: int) -> RoundResult:
        found = averagers[i].find_group(0, H0).result(timeout=10)
        assert isinstance(found, Group), found
        return run(averagers[i], found, i, applied[i], tokens(i))

    with _pool(averagers) as pool:
        results = list(pool.map(one, range(len(averagers))))
    return results, applied


def serve_state(averager: Averager, *, blob: bytes = b"") -> StateServer:
    """A state server for a fake peer, serving its head (and the head's certificate), as a real peer does."""
    t = averager.transport
    server = StateServer(t, MODEL.fingerprint, gate=averager.gate, credentials=averager.credentials,
                         control_timeout_s=1)
    t.call(server.register(), timeout=5)
    publish(averager, server, blob=blob)
    return server


def publish(averager: Averager, server: StateServer, *, blob: bytes = b"", ready: bool = True) -> None:
    """Announce and serve the averager's head, as `SwarmSync.publish_state` does."""
    head = averager.head
    cert = head.certificate.to_bytes() if head.certificate is not None else b""
    server.publish(ServedState(round=head.round, state_hash=head.state_hash, blob=blob, certificate=cert))
    announce(averager.transport, head.round, head.state_hash, work=head.work, ready=ready)  # type: ignore[arg-type]


def round_from_heads(averagers: list[Averager], *, offset: int = 0, attempts: int = 1,
                     may_miss: Collection[int] = ()) -> tuple[list[RoundResult], list[Applied]]:
    """One round for `averagers`, each from the head it holds (they must hold the same); peer i contributes
    delta(i + offset), so rounds with different offsets reach different states. `attempts`: how many times a peer
    looks for a group before giving up, as SwarmSync looks again after a look that formed none (the views go on
    where they were, so a view that is longer than one look's deadline is still used in full). `may_miss`: peers
    that may find no group at all (one the others may rightly close without, such as a peer that stalled and is
    ready again only after their group closed); such a peer's result is then a discarded round."""
    applied = [Applied() for _ in averagers]

    def one(i: int) -> RoundResult:
        head = averagers[i].head
        averagers[i].transport.update_record(ready=True)  # done with its budget, as SwarmSync marks itself
        for attempt in range(attempts):
            try:
                found = averagers[i].find_group(head.round, head.state_hash).result(timeout=30)
                break
            except RoundAborted as e:
                if attempt < attempts - 1:
                    continue
                if i not in may_miss:
                    raise
                return RoundResult(outcome=Outcome.DISCARDED, round=head.round, leader="", role="member",
                                   reason=f"no group: {e}")
        assert isinstance(found, Group), found
        return run(averagers[i], found, i + offset, applied[i])

    with _pool(averagers) as pool:
        results = list(pool.map(one, range(len(averagers))))
    return results, applied


def ticketed(transport: FakeTransport, authority: Identity) -> FakeTransport:
    """The transport's peer, admitted by `authority`: its credentials carry a ticket that authority signed."""
    transport.credentials.ticket = Ticket.issue(authority, run_id=transport.run_id,
                                                peer_id=transport.peer_id).to_bytes()
    return transport


def admitted_round_one(net: FakeNetwork, authority: Identity, *,
                       ready: bool) -> tuple[list[Averager], list[StateServer]]:
    """Three peers admitted by `authority` certify round 1 at quorum 3 (each of them is in the group) and publish
    it, ready for the next round or not; returns them and their state servers."""
    honest = []
    for _ in range(3):
        t = ticketed(net.peer(), authority)
        honest.append(averager_for(t, quorum=3, gate=Gate(t.run_id, authority.peer_id)))
        announce(t)
    servers = [serve_state(a) for a in honest]
    results, _ = round_from_heads(honest)
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3, [r.reason for r in results]
    for a, s in zip(honest, servers, strict=True):
        publish(a, s, ready=ready)
    return honest, servers


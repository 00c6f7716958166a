"""The protocol over real hivemind nodes on 127.0.0.1 (p2pd included): split groups merging, the DHT refusing forged
records. State downloads from real nodes are in tests/integration/test_state_transfer_nodes.py."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from hivemind.utils import get_dht_time

from swarmloco.protocol.base.records import PeerRecord, peers_key
from swarmloco.protocol.network.config import NetworkConfig
from swarmloco.protocol.network.node import SwarmNode
from swarmloco.protocol.round.averager import Averager
from swarmloco.protocol.round.config import LocalModel, RoundConfig
from swarmloco.protocol.round.groups import Group
from swarmloco.protocol.round.schedule import view_leader, view_rank
from swarmloco.protocol.trust.admission import Credentials, Gate, Ticket
from swarmloco.protocol.trust.certificates import Head
from swarmloco.protocol.trust.identity import Identity, load_or_create_identity
from swarmloco.protocol.trust.signed_records import seal

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
H1 = "1" * 64


def _node(directory: Path, name: str, *, run_id: str, initial: tuple[str, ...] = (),
          authority: Identity | None = None, **net: Any) -> SwarmNode:
    """A real node with its own identity; with `authority`, a member of a permissioned run holding a ticket."""
    identity = load_or_create_identity(directory / f"{name}.key")
    credentials = Credentials(identity)
    if authority is not None:
        credentials.ticket = Ticket.issue(authority, run_id=run_id, peer_id=identity.peer_id).to_bytes()
    gate = Gate(run_id, authority.peer_id if authority is not None else None)
    config = NetworkConfig(run_id=run_id, host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=initial,
                           identity=str(directory / f"{name}.key"), **net)
    node = SwarmNode(config, credentials=credentials, gate=gate)
    node.start()
    return node


def test_split_groups_below_quorum_meet_around_the_views_leader(tmp_path: Path) -> None:
    """Peers that saw different records formed two groups of 2 with quorum 4. Once they read the same records they
    compute the same leader for their view: the other leader releases its member and both join it."""
    nodes: list[SwarmNode] = []
    visible: dict[str, set[str]] = {}

    def partitioned(node: SwarmNode):  # wraps the node's own fetch_records
        real = node.fetch_records

        async def fetch(**kw: float) -> dict[str, PeerRecord]:
            records = await real(**kw)
            allowed = visible.get(node.peer_id)
            return records if allowed is None else {p: r for p, r in records.items() if p in allowed}
        return fetch

    try:
        for i in range(4):
            initial = tuple(nodes[0].visible_maddrs()) if nodes else ()
            nodes.append(_node(tmp_path, f"n{i}", run_id="split", initial=initial, heartbeat_s=0.5))
        cfg = RoundConfig(quorum=4, grace_min_s=0.0, grace_max_s=0.0, round_timeout_s=45)
        model = LocalModel(fingerprint="fp", config={}, numel=10)
        averagers = [Averager(n, cfg, model, credentials=n.credentials, gate=n.gate, genesis_hash=H1) for n in nodes]
        ids = sorted((n.peer_id for n in nodes), key=lambda p: view_rank(H1, 0, p))
        halves = [set(ids[0::2]), set(ids[1::2])]  # each half holds one of the two best-ranked ids: two leaders
        for n, averager in zip(nodes, averagers, strict=False):
            n.fetch_records = partitioned(n)  # type: ignore[method-assign]
            visible[n.peer_id] = next(h for h in halves if n.peer_id in h)
            averager.start()
            averager.set_state(Head(0, H1))
            record = PeerRecord.announce(fingerprint="fp", config_json="{}", round=0, state_hash=H1, ready=True)
            n.update_record(**record.to_value())
        futures = [a.find_group(0, H1) for a in averagers]
        deadline = time.monotonic() + 30
        while sum(1 for a in averagers if a.matchmaker._collect is not None and a.matchmaker._collect.members) < 2:
            assert time.monotonic() < deadline, "the two halves did not each form a group"
            time.sleep(0.1)
        visible.clear()  # the partition heals: everyone sees everyone
        groups = [f.result(timeout=60) for f in futures]
        assert all(isinstance(g, Group) for g in groups)
        leaders = {g.leader for g in groups}
        (view,) = {a.matchmaker.views.current for a in averagers}  # type: ignore[union-attr]
        assert len(leaders) == 1 and leaders.pop() == view_leader(H1, view, ids)
        assert all(sorted(g.members) == sorted(ids) for g in groups if g.is_leader)
        for a, g in zip(averagers, groups, strict=False):
            if g.is_leader:
                a.transport.call(a.steps.abort(g, "test over"), timeout=30)  # type: ignore[union-attr]
    finally:
        for node in nodes:
            node.shutdown()
        time.sleep(0.5)


def test_a_record_stored_under_another_peers_subkey_is_refused_by_the_dht(tmp_path: Path) -> None:
    """The overwrite attack on real nodes: an admitted peer stores a forged round under an honest peer's subkey with
    an hour's expiry. Every node of the run refuses the store, and everyone still reads the victim's own record."""
    authority = Identity(path=tmp_path / "authority", private_key=Identity.generate())
    nodes: list[SwarmNode] = []
    try:
        victim = _node(tmp_path, "victim", run_id="rw", authority=authority, heartbeat_s=0.5)
        nodes.append(victim)
        attacker = _node(tmp_path, "attacker", run_id="rw", authority=authority,
                         initial=tuple(victim.visible_maddrs()))
        reader = _node(tmp_path, "reader", run_id="rw", authority=authority, initial=tuple(victim.visible_maddrs()))
        nodes += [attacker, reader]
        record = PeerRecord.announce(fingerprint="fp", config_json="{}", round=3, state_hash=H1, work=30)
        victim.update_record(**record.to_value())
        _wait(lambda: victim.peer_id in reader.call(reader.fetch_records(timeout=5), timeout=10), "victim's record")
        forged = dataclasses.replace(record, round=1001, work=10**12)
        envelope = seal(attacker.credentials.identity, "rw", forged, attacker.credentials.ticket.decode(),
                        get_dht_time() + 3600)
        assert attacker.dht is not None
        stored = attacker.dht.store(peers_key("rw"), envelope, get_dht_time() + 3600, subkey=victim.peer_id)
        assert stored is False  # the attacker's own node refuses it already; so does every other node
        time.sleep(2)
        seen = reader.call(reader.fetch_records(timeout=5), timeout=10)
        assert seen[victim.peer_id].round == 3 and seen[victim.peer_id].work == 30
        assert victim.store_failures == 0  # the victim's own publishing still succeeds
    finally:
        for node in nodes:
            node.shutdown()


def _wait(predicate: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


class _Unanswered(concurrent.futures.Future):  # type: ignore[type-arg]
    """A DHT answer that never comes; counts the waits on it, and the threads waiting now."""

    calls = waiting = 0

    def result(self, timeout: float | None = None) -> Any:
        self.calls += 1
        self.waiting += 1
        try:
            return super().result(timeout)
        finally:
            self.waiting -= 1


def test_a_dht_call_the_stopped_dht_never_answers_does_not_hold_the_process_at_exit(tmp_path: Path) -> None:
    """A record store or lookup in flight when the node shuts down waits on an executor thread, which the interpreter
    joins at exit: the wait must end with the shutdown, not after its own timeout (a peer took 20 s to exit on
    SIGTERM this way)."""
    node = _node(tmp_path, "a", run_id="exit")
    never = _Unanswered()
    node.submit(node._dht_call(lambda: never, 120.0))
    _wait(lambda: never.waiting == 1, "an executor thread waiting on the DHT call", timeout=10)
    node.shutdown()
    _wait(lambda: never.waiting == 0, "the wait on the DHT call to end after shutdown", timeout=10)
    calls = never.calls
    time.sleep(1.0)  # ended for good: nobody waits on it again
    assert never.waiting == 0 and never.calls == calls, (never.waiting, never.calls - calls)

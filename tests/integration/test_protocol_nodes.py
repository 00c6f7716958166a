"""The protocol over real hivemind nodes on 127.0.0.1 (p2pd included): split groups merging, a lying state donor."""
from __future__ import annotations

import time

import pytest
import torch

from protocol.averager import Averager
from protocol.hashing import hash_tensors
from protocol.hooks import Hooks
from protocol.matchmaking import Group
from protocol.node import NetworkConfig, SwarmNode
from protocol.records import PeerRecord
from protocol.rounds import LocalModel, RoundConfig
from protocol.state_sync import ServedState, StateServer, StateSyncError, download_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
H1 = "1" * 64


class _Liar(Hooks):
    def served_state(self, blob: bytes) -> bytes:
        return bytes(len(blob))


def test_split_groups_below_quorum_merge() -> None:
    """Peers that saw different records formed two groups of 2 with quorum 4. Before, neither leader ever gave up
    its members and the round timed out on all four; now the weaker leader merges into the stronger one."""
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
        for _ in range(4):
            initial = tuple(nodes[0].visible_maddrs()) if nodes else ()
            n = SwarmNode(
                NetworkConfig(
                    run_id="split", host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=initial, heartbeat_s=0.5
                )
            )
            n.start()
            nodes.append(n)
        cfg = RoundConfig(quorum=4, grace_min_s=0.0, grace_max_s=0.0, round_timeout_s=45)
        averagers = [Averager(n, cfg, LocalModel(fingerprint="fp", config={}, numel=10)) for n in nodes]
        ids = sorted(n.peer_id for n in nodes)
        halves = [set(ids[0::2]), set(ids[1::2])]  # each half holds one of the two smallest ids: two leaders
        for n, averager in zip(nodes, averagers, strict=False):
            n.fetch_records = partitioned(n)  # type: ignore[method-assign]
            visible[n.peer_id] = next(h for h in halves if n.peer_id in h)
            averager.start()
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
        assert len(leaders) == 1 and leaders.pop() == ids[0]
        assert all(sorted(g.members) == ids for g in groups if g.is_leader)
        for a, g in zip(averagers, groups, strict=False):
            if g.is_leader:
                a.transport.call(a._abort(g, "test over"), timeout=30)
    finally:
        for node in nodes:
            node.shutdown()
        time.sleep(0.5)


def test_download_rejects_lying_donor_and_uses_honest_one() -> None:
    """A poisoned state download fails the hash check; the joiner moves to another donor."""
    blob = torch.arange(50_000, dtype=torch.float32).numpy().tobytes()

    def verify(b: bytes) -> str:
        return hash_tensors({"blob": torch.frombuffer(bytearray(b), dtype=torch.uint8)})

    good_hash = verify(blob)
    nodes: list[SwarmNode] = []
    try:
        first = SwarmNode(NetworkConfig(run_id="t", host_maddrs=("/ip4/127.0.0.1/tcp/0",)))
        first.start()
        nodes.append(first)
        for _ in range(2):
            n = SwarmNode(
                NetworkConfig(
                    run_id="t", host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=tuple(first.visible_maddrs())
                )
            )
            n.start()
            nodes.append(n)
        liar, honest, joiner = nodes
        for node, hooks in ((liar, _Liar()), (honest, None)):
            server = StateServer(node, "fp", hooks=hooks)
            node.call(server.register(), timeout=30)
            server.publish(ServedState(round=7, state_hash=good_hash, blob=blob))
        kw = dict(round_number=7, state_hash=good_hash, total_bytes=len(blob), fingerprint="fp", verify=verify)
        got, bad = joiner.call(
            download_state(joiner, donors=[liar.peer_id, honest.peer_id], max_parallel=1, **kw), timeout=60
        )
        assert bytes(got) == blob and bad == [liar.peer_id]
        got, bad = joiner.call(download_state(joiner, donors=[liar.peer_id, honest.peer_id], **kw), timeout=60)
        assert bytes(got) == blob and bad == ["parallel-assembly", liar.peer_id]
        with pytest.raises(StateSyncError, match="no donor served verified state"):
            joiner.call(download_state(joiner, donors=[liar.peer_id], **kw), timeout=60)
        # a donor at another round is not trusted for this one
        with pytest.raises(StateSyncError):
            joiner.call(download_state(joiner, donors=[honest.peer_id], **{**kw, "round_number": 8}), timeout=60)
    finally:
        for node in nodes:
            node.shutdown()
        time.sleep(0.5)

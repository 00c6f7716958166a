"""State downloads between real hivemind nodes on 127.0.0.1 (p2pd for the sessions, TCP data planes for the bulk):
liars are caught chunk by chunk and reported, a donor whose TCP address is dead is served over libp2p, and a donor
that goes silent mid-transfer costs only its in-flight chunks. One set of nodes serves every assertion."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from swarmloco.protocol.base.hashing import LEAF_BYTES, pack_state, state_hash, state_layout
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.chain.config import FetchConfig
from swarmloco.protocol.chain.state_sync import ServedState, StateServer, StateSyncError, download_state
from swarmloco.protocol.network.data_plane import DataPlane
from swarmloco.protocol.network.node import SwarmNode
from tests.integration.test_protocol_nodes import _node

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
SHAPES = {"w": torch.Size([6 * LEAF_BYTES // 8]), "b": torch.Size([1000])}  # θ + m: 6 leaves and a bit
NAMES = list(SHAPES)
CFG = FetchConfig(chunk_timeout_s=2.0, control_timeout_s=5.0, connect_timeout_s=1.0)


class _FlipBits(Hooks):
    def served_state(self, blob: bytes) -> bytes:
        bad = bytearray(blob)
        for start in range(0, len(bad), LEAF_BYTES):
            bad[start] ^= 0x80
        return bytes(bad)


class _Donor(StateServer):
    delay_s = 0.0
    dead_tcp = False
    silent_after: int | None = None  # after serving this many chunks, never answer again
    sent = 0

    def _data_addrs(self) -> list[str]:
        return ["127.0.0.1:1"] if self.dead_tcp else super()._data_addrs()  # nothing listens on port 1

    async def _on_chunk(self, index: int, view: memoryview) -> memoryview:
        if self.silent_after is not None and self.sent >= self.silent_after:
            await asyncio.sleep(3600)  # silent: the session stays open and nothing more comes
        await asyncio.sleep(self.delay_s)
        self.sent += 1
        return view


@dataclass
class Swarm:
    nodes: dict[str, SwarmNode]
    servers: dict[str, _Donor]
    blob: bytes
    root: str

    def fetch(self, donors: list[str], **kw: object) -> tuple[bytearray, list[str]]:
        joiner = self.nodes["joiner"]
        ids = [self.nodes[d].peer_id for d in donors]
        job = download_state(joiner, donors=ids, round_number=5, state_hash=self.root,
                             layout=state_layout(SHAPES, NAMES), fingerprint="fp", config=CFG, timeout=30, **kw)
        return joiner.call(job, timeout=40)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    tmp: Path = tmp_path_factory.mktemp("state")
    g = torch.Generator().manual_seed(3)
    params = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    momentum = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    blob, root = pack_state(params, momentum, NAMES), state_hash(params, momentum, NAMES)
    nodes: dict[str, SwarmNode] = {}
    planes: list[tuple[SwarmNode, DataPlane]] = []
    try:
        nodes["joiner"] = _node(tmp, "joiner", run_id="st")
        servers = {}
        for name in ("honest", "liar", "no-tcp", "silent"):
            node = nodes[name] = _node(tmp, name, run_id="st", initial=tuple(nodes["joiner"].visible_maddrs()))
            plane = DataPlane(bind_host="127.0.0.1", advertise_hosts=["127.0.0.1"])
            node.call(plane.start(), timeout=10)
            planes.append((node, plane))
            server = _Donor(node, "fp", gate=node.gate, credentials=node.credentials, data_plane=plane,
                            hooks=_FlipBits() if name == "liar" else None)
            node.call(server.register(), timeout=30)
            server.publish(ServedState(round=5, state_hash=root, blob=blob))
            servers[name] = server
        servers["no-tcp"].dead_tcp = True
        yield Swarm(nodes, servers, blob, root)
    finally:
        for node, plane in planes:
            if node.loop.is_running():
                node.call(plane.close(), timeout=10)
        for node in nodes.values():
            node.shutdown()
        time.sleep(0.5)


def test_liar_is_caught_by_the_leaf_check_and_reported(swarm: Swarm) -> None:
    got, bad = swarm.fetch(["liar", "honest"])
    assert bytes(got) == swarm.blob and bad == [swarm.nodes["liar"].peer_id]
    assert swarm.servers["honest"].stats.via_data_plane >= 1
    with pytest.raises(StateSyncError, match="no donor served verified state"):
        swarm.fetch(["liar"])
    with pytest.raises(StateSyncError):  # a donor at another round is not trusted for this one
        joiner = swarm.nodes["joiner"]
        joiner.call(download_state(joiner, donors=[swarm.nodes["honest"].peer_id], round_number=6,
                                   state_hash=swarm.root, layout=state_layout(SHAPES, NAMES), fingerprint="fp",
                                   config=CFG, timeout=10), timeout=20)


def test_dead_tcp_address_falls_back_to_the_libp2p_stream(swarm: Swarm) -> None:
    server = swarm.servers["no-tcp"]
    before = server.sent
    got, bad = swarm.fetch(["no-tcp"])
    assert bytes(got) == swarm.blob and bad == [] and server.sent - before == state_layout(SHAPES, NAMES).leaves


def test_donor_going_silent_mid_transfer_costs_only_its_in_flight_chunks(swarm: Swarm) -> None:
    """The faster donor serves two chunks, then answers nothing more with its session open: the joiner's chunk
    deadline finds it out, and its chunks come from the other donor. (Stopping the donor's node instead raced the
    node's own shutdown on a busy machine: the donor could serve every chunk before its loop stopped.)"""
    silent, honest = swarm.servers["silent"], swarm.servers["honest"]
    quiet_at = silent.sent + 2
    silent.delay_s, honest.delay_s, silent.silent_after = 0.05, 0.3, quiet_at
    joiner = swarm.nodes["joiner"]
    ids = [swarm.nodes[n].peer_id for n in ("silent", "honest")]
    job = joiner.submit(download_state(joiner, donors=ids, round_number=5, state_hash=swarm.root,
                                       layout=state_layout(SHAPES, NAMES), fingerprint="fp", config=CFG, timeout=30))
    deadline = time.monotonic() + 20
    while silent.sent < quiet_at and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    got, bad = job.result(timeout=30)
    assert silent.sent == quiet_at
    assert bytes(got) == swarm.blob and bad == [ids[0]]
    assert time.monotonic() - started < CFG.chunk_timeout_s + 5

"""Our side of `bench join` (re-exported by `scripts.bench_hooks`, where the harness looks hooks up by name).

join_seconds: `donors` processes, each a real SwarmNode with a TCP data plane serving a preset's θ + m (its state
hash computed as a peer's outer step computes it, so its leaf digests are at hand); the joiner's download_state,
timed from its first state request until it holds a blob whose every chunk matched the certified root's leaves.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import time
from typing import Any

from scripts.bench_nodes import bench_node

logger = logging.getLogger(__name__)
RUN_ID = "bench-join"


def _join_donor(preset: str, bootstrap: list[str], out: Any, stop: Any) -> None:
    import torch

    from swarmloco.peer.model import GPT, PRESETS
    from swarmloco.protocol.base.hashing import pack_state, state_hash
    from swarmloco.protocol.chain.state_sync import ServedState, StateServer
    from swarmloco.protocol.network.data_plane import DataPlane

    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    params = {n: p.detach().float() for n, p in model.named_parameters()}
    momentum = {n: torch.full_like(p, 0.5) for n, p in params.items()}
    root = state_hash(params, momentum)
    blob = pack_state(params, momentum, list(params))
    node = bench_node(0, RUN_ID, bootstrap)
    plane = DataPlane(bind_host="127.0.0.1", advertise_hosts=["127.0.0.1"])
    try:
        node.call(plane.start(), timeout=30)
        server = StateServer(node, RUN_ID, gate=node.gate, credentials=node.credentials, data_plane=plane)
        node.call(server.register(), timeout=30)
        server.publish(ServedState(round=1, state_hash=root, blob=blob))
        out.put({"peer_id": node.peer_id, "maddrs": node.visible_maddrs(), "hash": root, "bytes": len(blob)})
        stop.wait(1800)
        logger.info("donor served %s", server.stats)
    finally:
        node.call(plane.close(), timeout=10)
        node.shutdown()


def join_seconds(preset: str, donors: int) -> float:
    """Seconds from the joiner's first request to holding the donors' state, every chunk hash-verified."""
    from swarmloco.peer.model import GPT, PRESETS
    from swarmloco.protocol.base.hashing import state_layout
    from swarmloco.protocol.chain.config import FetchConfig
    from swarmloco.protocol.chain.state_sync import download_state

    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_join_donor, args=(preset, [], queue, stop)) for _ in range(donors)]
    node = None
    try:
        for p in procs:
            p.start()
        infos = [queue.get(timeout=600) for _ in procs]
        shapes = {n: p.shape for n, p in GPT(PRESETS[preset]).named_parameters()}
        layout = state_layout(shapes, list(shapes))
        if layout.total_bytes != infos[0]["bytes"]:
            raise RuntimeError("donors serve a blob of another size than the model's layout")
        node = bench_node(99, RUN_ID, [m for i in infos for m in i["maddrs"]])
        started = time.perf_counter()
        blob, bad = node.call(
            download_state(node, donors=[i["peer_id"] for i in infos], round_number=1, state_hash=infos[0]["hash"],
                           layout=layout, fingerprint=RUN_ID, config=FetchConfig(max_donors=donors), timeout=600),
            timeout=1200,
        )
        elapsed = time.perf_counter() - started
        if bad:
            raise RuntimeError(f"download needed fallbacks: {bad}")
        if len(blob) != layout.total_bytes:
            raise RuntimeError("download returned a blob of the wrong size")
        return elapsed
    finally:
        stop.set()
        if node is not None:
            node.shutdown()
        for p in procs:
            if p.pid is None:
                continue
            p.join(30)
            if p.is_alive():
                p.kill()

"""Building blocks the benchmark hooks share (scripts.bench_allreduce_hooks, scripts.bench_join_hooks): a started
SwarmNode of a private benchmark swarm, the fixed state hash its rounds run on, and where an exception arose.

Kept apart from scripts.bench_hooks, which re-exports the hooks themselves: the hook modules import this one, and
nothing here imports a hook module back.
"""
from __future__ import annotations

import tempfile
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The benchmark chain's genesis and every state it certifies: a round benchmark measures averaging, not training,
# so every rep starts from (and commits) this same hash.
HASH = "0" * 64


def where(exc: BaseException) -> str:
    """The innermost frame of our own code an exception passed through (a bare TimeoutError() says nothing alone)."""
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if str(ROOT) in f.filename and ".venv" not in f.filename
    ]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"


def bench_node(index: int, run_id: str, bootstrap: list[str], *, host: str = "127.0.0.1") -> Any:
    """A started SwarmNode of a private benchmark swarm, with a throwaway identity of its own.

    The protocol is imported here, not at module level, so a benchmark's parent process that only reads tables
    never pays for torch and hivemind.
    """
    from swarmloco.protocol.network.config import NetworkConfig
    from swarmloco.protocol.network.node import SwarmNode
    from swarmloco.protocol.trust.admission import Credentials, Gate
    from swarmloco.protocol.trust.identity import load_or_create_identity

    path = Path(tempfile.mkdtemp(prefix="swarmloco-bench-")) / f"peer-{index}.key"
    net = NetworkConfig(run_id=run_id, initial_peers=tuple(bootstrap), host_maddrs=(f"/ip4/{host}/tcp/0",),
                        heartbeat_s=0.5, identity=str(path))
    node = SwarmNode(net, credentials=Credentials(load_or_create_identity(path)), gate=Gate(run_id, None))
    node.start()
    return node

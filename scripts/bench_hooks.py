"""Our side of the benchmarks (`scripts/bench.py` loads these lazily): real processes, real libp2p streams.

- ours_allreduce_seconds: N processes, each a SwarmNode + GroupAverager on one flat fp32 tensor; one timed rep is
  "group closed → every peer holds the decoded average" (matchmaking excluded, as gloo's rendezvous is).
- measured_round_bytes: the wire bytes our averaging writes per peer per round (frame headers + payloads).
- join_seconds: donors serve a preset's θ+m; the joiner's download_state until the blob is hash-verified.
- utilisation: a real swarm of peer processes with per-peer slowdowns; compute vs wall time per peer.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HASH = "0" * 64


def _where(exc: BaseException) -> str:
    """The innermost frame of our own code an exception passed through (a bare TimeoutError() says nothing alone)."""
    import traceback

    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if str(ROOT) in f.filename and ".venv" not in f.filename
    ]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"


def _bench_node(index: int, run_id: str, bootstrap: list[str]) -> Any:
    """A started SwarmNode of a private benchmark swarm, with a throwaway identity of its own."""
    from protocol.admission import Credentials, Gate
    from protocol.identity import load_or_create_identity
    from protocol.node import NetworkConfig, SwarmNode

    path = Path(tempfile.mkdtemp(prefix="swarmloco-bench-")) / f"peer-{index}.key"
    net = NetworkConfig(run_id=run_id, initial_peers=tuple(bootstrap), host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                        heartbeat_s=0.5, identity=str(path))
    node = SwarmNode(net, credentials=Credentials(load_or_create_identity(path)), gate=Gate(run_id, None))
    node.start()
    return node


def _allreduce_worker(
    index: int, bootstrap: list[str], numel: int, peers: int, reps: int, codec: str, out: Any
) -> None:
    import torch

    from protocol.averager import Averager, Contribution
    from protocol.certificates import Head
    from protocol.records import PeerRecord
    from protocol.rounds import LocalModel, Outcome, RoundConfig

    torch.set_num_threads(1)
    node = _bench_node(index, "bench", bootstrap)
    try:
        model = LocalModel(fingerprint="bench", config={"numel": numel}, numel=numel)
        cfg = RoundConfig(
            quorum=peers, grace_min_s=0.0, grace_max_s=0.0, codec=codec, exchange_timeout_s=300, round_timeout_s=300
        )
        averager = Averager(node, cfg, model, credentials=node.credentials, gate=node.gate, genesis_hash=HASH)
        averager.start()
        averager.set_state(Head(0, HASH))
        delta = torch.randn(numel, generator=torch.Generator().manual_seed(index))
        results = []
        for rep in range(reps):
            head = averager.head  # certified by the previous rep: every rep is one more round of the same chain
            node.update_record(**PeerRecord.announce(fingerprint="bench", config_json="{}", round=head.round,
                                                     state_hash=HASH, work=head.work, ready=True).to_value())
            # outlives round_timeout_s, so a matchmaking stall surfaces as form_group's own RoundAborted message
            group = averager.find_group(head.round, HASH).result(timeout=cfg.round_timeout_s + 30)
            t0 = time.time()
            # The timed part is the same call a peer makes; "apply" keeps the state, so every rep starts from HASH.
            result = averager.run_round(group, Contribution(delta=delta, tokens=1000), apply=lambda average: HASH)
            if result.outcome != Outcome.COMMITTED:
                raise RuntimeError(f"rep {rep}: round ended {result.outcome}: {result.reason}")
            results.append(
                {
                    "rep": rep,
                    "t0": t0,
                    "t1": time.time(),
                    "leader": group.is_leader,
                    "sent": result.bytes_sent,
                    "received": result.bytes_received,
                    "members": len(group.members),
                    "direct": result.direct,
                    "certify_s": result.certify_s,
                }
            )
        out.put({"index": index, "results": results, "error": None})
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the measurement
        out.put({"index": index, "results": [], "error": f"{exc!r} at {_where(exc)}"})
    finally:
        node.shutdown()


def _run_allreduce(numel: int, peers: int, reps: int, codec: str, timeout: float = 900) -> list[dict[str, Any]]:
    import hivemind

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    bootstrap_dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    procs = []
    try:
        bootstrap = [str(m) for m in bootstrap_dht.get_visible_maddrs()]
        procs = [
            ctx.Process(target=_allreduce_worker, args=(i, bootstrap, numel, peers, reps, codec, queue), daemon=False)
            for i in range(peers)
        ]
        for p in procs:
            p.start()
        outputs = [queue.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            if p.pid is None:
                continue
            p.join(30)
            if p.is_alive():
                p.kill()
        bootstrap_dht.shutdown()
    errors = [o["error"] for o in outputs if o["error"]]
    if errors:
        raise RuntimeError(f"averaging workers failed: {errors}")
    return outputs


def ours_allreduce_seconds(size_mb: int, peers: int, reps: int, codec: str) -> list[float]:
    """Per rep: from the earliest peer's 'group closed' to the last peer holding the average (same clock)."""
    numel = int(size_mb * 2**20 // 4)
    outputs = _run_allreduce(numel, peers, reps, codec)
    times = []
    for rep in range(reps):
        rows = [o["results"][rep] for o in outputs]
        if any(r["members"] != peers for r in rows):
            raise RuntimeError(f"rep {rep}: a group of {[r['members'] for r in rows]} formed, expected {peers}")
        times.append(max(r["t1"] for r in rows) - min(r["t0"] for r in rows))
    if any(r["direct"] != peers - 1 for o in outputs for r in o["results"]):
        raise RuntimeError("some shard connections fell back to libp2p streams; the measurement would mix transports")
    return times


def measured_round_bytes(codec: str, peers: int) -> dict[str, Any]:
    """Wire bytes per peer per round for a 1 MiB-parameter tensor; `params` lets the caller scale per parameter."""
    numel = 2**18
    outputs = _run_allreduce(numel, peers, 1, codec)
    rows = [o["results"][0] for o in outputs]
    return {
        "params": numel,
        "sent_bytes": sum(r["sent"] for r in rows) / peers,
        "received_bytes": sum(r["received"] for r in rows) / peers,
        "leader_sent_bytes": sum(r["sent"] for r in rows if r["leader"]),
        "topology": "star (leader-reduce)",
        "codec": codec,
    }


def _join_donor(preset: str, bootstrap: list[str], out: Any, stop: Any) -> None:
    import torch

    from peer.model import GPT, PRESETS
    from protocol.hashing import pack_state, state_hash
    from protocol.state_sync import ServedState, StateServer

    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    params = {n: p.detach().float() for n, p in model.named_parameters()}
    momentum = {n: torch.full_like(p, 0.5) for n, p in params.items()}
    blob = pack_state(params, momentum, list(params))
    node = _bench_node(0, "bench-join", bootstrap)
    try:
        server = StateServer(node, "bench-join", gate=node.gate, credentials=node.credentials, max_concurrent=8)
        node.call(server.register(), timeout=30)
        server.publish(ServedState(round=1, state_hash=state_hash(params, momentum), blob=blob))
        out.put(
            {
                "peer_id": node.peer_id,
                "maddrs": node.visible_maddrs(),
                "hash": state_hash(params, momentum),
                "bytes": len(blob),
            }
        )
        stop.wait(1800)
    finally:
        node.shutdown()


def join_seconds(preset: str, donors: int) -> float:
    """Seconds from the joiner's first request to holding the donors' state, hash-verified."""
    from peer.model import GPT, PRESETS
    from protocol.hashing import blob_hash
    from protocol.state_sync import download_state

    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_join_donor, args=(preset, [], queue, stop)) for _ in range(donors)]
    node = None
    try:
        for p in procs:
            p.start()
        infos = [queue.get(timeout=600) for _ in procs]
        shapes = {n: p.shape for n, p in GPT(PRESETS[preset]).named_parameters()}
        names = list(shapes)

        def verify(blob: bytes) -> str:
            return blob_hash(blob, shapes, names)

        node = _bench_node(99, "bench-join", [m for i in infos for m in i["maddrs"]])
        started = time.perf_counter()
        _, bad = node.call(
            download_state(
                node,
                donors=[i["peer_id"] for i in infos],
                round_number=1,
                state_hash=infos[0]["hash"],
                total_bytes=infos[0]["bytes"],
                fingerprint="bench-join",
                verify=verify,
            ),
            timeout=1200,
        )
        elapsed = time.perf_counter() - started
        if bad:
            raise RuntimeError(f"download needed fallbacks: {bad}")
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


def utilisation(
    slowdowns: list[float],
    mode: str,
    shaped: bool,
    netns: list[tuple[str, str]] | None = None,
    rounds: int = 4,
    preset: str = "tiny",
) -> dict[str, Any]:
    """Run len(slowdowns) real peers and report compute/wait/wall seconds per peer.

    async: our decoupled rounds — quorum 2, a *time* budget per round (slow peers run fewer inner steps) and
           training continues while the group forms.
    sync:  wait-for-everyone DiLoCo — quorum = all peers, H inner steps each, idle while waiting.
    """
    if shaped and not netns:
        raise RuntimeError("shaped runs need network namespaces (netns=[(name, address), ...])")
    n = len(slowdowns)
    common = [
        "--preset",
        preset,
        "--max-rounds",
        str(rounds),
        "--threads",
        "1",
        "--log-format",
        "json",
        "--linger",
        "3",
        "--checkpoint-every",
        "0",
        "--eval-every",
        "1000",
        "--grace-max",
        "5",
        "--round-timeout",
        "120",
        "--codec",
        "int8",
    ]
    if mode == "async":
        common += ["--quorum", "2", "--round-seconds", "6", "--train-while-waiting"]
    elif mode == "sync":
        common += [
            "--quorum",
            str(n),
            "--inner-steps",
            "40",
            "--no-train-while-waiting",
            "--no-close-early",
            "--grace-min",
            "0",
        ]
    else:
        raise ValueError(f"mode: got {mode!r}, allowed async, sync")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory(prefix="swarmloco-util-") as tmp:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            bootstrap: list[str] = []
            for i, slow in enumerate(slowdowns):
                host = netns[i][1] if netns else "127.0.0.1"
                workdir = Path(tmp) / f"peer-{i}"
                workdir.mkdir()
                argv = [
                    sys.executable,
                    "-m",
                    "scripts.cli",
                    "peer",
                    *common,
                    "--slowdown",
                    str(slow),
                    "--workdir",
                    str(workdir),
                    "--shard-index",
                    str(i),
                    "--num-shards",
                    str(n),
                    "--summary-json",
                    str(workdir / "summary.json"),
                    "--host-maddr",
                    f"/ip4/{host}/tcp/0",
                ]
                for maddr in bootstrap:
                    argv += ["--initial-peer", maddr]
                if netns:
                    argv = ["ip", "netns", "exec", netns[i][0], *argv]
                with open(workdir / "log.jsonl", "wb") as log, open(workdir / "stderr.log", "wb") as err:
                    procs.append(subprocess.Popen(argv, stdout=log, stderr=err, env=env, start_new_session=True))
                if i == 0:
                    bootstrap = _wait_joined(workdir / "log.jsonl", procs[0])
            for p in procs:
                p.wait(900)
            peers = []
            for i in range(n):
                path = Path(tmp) / f"peer-{i}" / "summary.json"
                if not path.exists():
                    raise RuntimeError(
                        f"peer {i} wrote no summary; see its stderr:\n"
                        f"{(Path(tmp) / f'peer-{i}' / 'stderr.log').read_text()[-2000:]}"
                    )
                s = json.loads(path.read_text())
                committed = [h for h in s["history"] if h.get("outcome") == "committed"]
                peers.append(
                    {
                        "slowdown": slowdowns[i],
                        "compute_s": s["compute_s"],
                        "wall_s": s["wall_s"],
                        "wait_s": max(0.0, s["wall_s"] - s["compute_s"]),
                        "rounds_committed": len(committed),
                        "tokens": s["tokens"],
                        "final_eval_loss": s["final_eval_loss"],
                    }
                )
            return {"mode": mode, "shaped": shaped, "peers": peers}
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _wait_joined(log: Path, proc: subprocess.Popen[bytes], timeout: float = 120) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"peer 0 exited with {proc.returncode} before joining")
        for line in log.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "joined":
                return list(event["maddrs"])
        time.sleep(0.3)
    raise RuntimeError("peer 0 did not join within the timeout")


def round_phases(size_mb: float, peers: int, reps: int, codec: str) -> list[dict[str, float]]:
    """Per rep: the whole round (earliest 'group closed' to the last peer done, certificate included) and, of it, the
    certification phase (statement signed, votes gathered, certificate sent and verified; slowest peer)."""
    numel = int(size_mb * 2**20 // 4)
    outputs = _run_allreduce(numel, peers, reps, codec)
    rows = []
    for rep in range(reps):
        got = [o["results"][rep] for o in outputs]
        rows.append({"round_s": max(r["t1"] for r in got) - min(r["t0"] for r in got),
                     "certify_s": max(r["certify_s"] for r in got)})
    return rows

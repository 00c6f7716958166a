"""Our side of the round benchmarks (`bench allreduce`, and `comm` and `trust` through scripts.bench_hooks): N real
peer processes, each a SwarmNode + Averager on one flat fp32 tensor, making the same `find_group` + `run_round`
calls a peer makes, on 127.0.0.1 or each in its own network namespace (`netns`, see scripts.bench_net).

One timed rep: every peer's group has formed (matchmaking excluded, as gloo's rendezvous is); all peers pass one
barrier together (t0, the release); each runs `run_round`; the rep's time is the slowest peer's "average held"
(the moment `apply` receives it) minus the release. The round's certification follows and is reported separately.
Every peer checks its average against the true weighted mean (regenerating every peer's Δ from its seed), and the
parent checks that all peers hold bit-identical averages and that every shard connection ran on TCP.

The codec is wrapped (here, never in protocol/) to time each encode, decode and decode_accumulate call; with the
uplink time the round reports (`steps.bandwidth` = bytes sent / seconds of sending parts), that splits a rep into
plan, parts, reduce and result phases.
"""
from __future__ import annotations

import ctypes
import hashlib
import multiprocessing as mp
import os
import queue
import resource
import threading
import time
from typing import Any

from scripts.bench_common import kill_processes
from scripts.bench_nodes import HASH, bench_node, where

CLONE_NEWNET = 0x40000000
WAIT_S = 330.0  # any single blocking wait: outlives round_timeout_s (300), so a stall surfaces as its own error
# ‖average − true mean‖ / ‖true mean‖ allowed: the vector is quantised twice (parts, then the reduced shard)
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.5e-2, "int8": 3e-2, "int4": 0.35}


def _enter_netns(name: str) -> None:
    """Move this process (before it opens any socket or starts p2pd) into the named network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)


class _TimedCodec:
    """The round's codec, recording (kind, start, end) of every call; calls run on executor threads."""

    def __init__(self, codec: Any) -> None:
        self._codec = codec
        self.calls: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._codec, name)

    def _timed(self, kind: str, fn: Any, *args: Any) -> Any:
        start = time.time()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.calls.append((kind, start, time.time()))

    def encode(self, flat: Any) -> Any:
        return self._timed("encode", self._codec.encode, flat)

    def decode(self, data: Any, numel: int) -> Any:
        return self._timed("decode", self._codec.decode, data, numel)

    def decode_with_norm(self, data: Any, numel: int) -> Any:
        return self._timed("decode", self._codec.decode_with_norm, data, numel)

    def decode_accumulate(self, data: Any, numel: int, out: Any, weight: float) -> None:
        self._timed("accumulate", self._codec.decode_accumulate, data, numel, out, weight)


def _delta(index: int, numel: int) -> Any:
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(index))


def _phases(calls: list[tuple[str, float, float]], t0: float, t_avg: float, send_s: float) -> dict[str, float]:
    """One peer's round, in seconds since the release: when it started encoding (plan in hand and every pipe open),
    finished sending its parts, had reduced its own shard (it then encodes the result: the last encode), held the
    average; and its codec CPU seconds (`decode` includes parts decoded before a separate weighted sum)."""
    first = min((s for _, s, _ in calls), default=t_avg)
    result_encode = max((s for k, s, _ in calls if k == "encode"), default=first)
    return {
        "plan_s": first - t0,
        "parts_s": first - t0 + send_s,
        "reduced_s": result_encode - t0,
        "average_s": t_avg - t0,
        "encode_cpu_s": sum(e - s for k, s, e in calls if k == "encode"),
        "accumulate_cpu_s": sum(e - s for k, s, e in calls if k == "accumulate"),
        "decode_cpu_s": sum(e - s for k, s, e in calls if k == "decode"),
    }


def _allreduce_worker(index: int, peers: int, numel: int, reps: int, codec: str, netns: tuple[str, str] | None,
                      boot: Any, barrier: Any, out: Any, rounds: dict[str, Any] | None = None) -> None:
    if netns is not None:
        _enter_netns(netns[0])
    import torch

    from swarmloco.protocol.base.outcome import Outcome
    from swarmloco.protocol.base.records import PeerRecord
    from swarmloco.protocol.round.averager import Averager, Contribution
    from swarmloco.protocol.round.config import LocalModel, RoundConfig
    from swarmloco.protocol.trust.certificates import Head

    torch.set_num_threads(1)
    node = None
    try:
        bootstrap = [] if index == 0 else list(boot.get(timeout=WAIT_S))
        node = bench_node(index, "bench", bootstrap, host=netns[1] if netns else "127.0.0.1")
        if index == 0:
            for _ in range(peers - 1):
                boot.put(node.visible_maddrs())
        model = LocalModel(fingerprint="bench", config={"numel": numel}, numel=numel)
        cfg = RoundConfig(**{  # type: ignore[arg-type]
            "quorum": peers, "grace_min_s": 0.0, "grace_max_s": 0.0, "codec": codec, "exchange_timeout_s": 300,
            "round_timeout_s": 300, **(rounds or {}),
        })
        averager = Averager(node, cfg, model, credentials=node.credentials, gate=node.gate, genesis_hash=HASH)
        averager.start()
        averager.set_state(Head(0, HASH))
        assert averager.steps is not None
        timed = _TimedCodec(averager.steps.codec)
        averager.codec = averager.steps.codec = timed  # type: ignore[assignment]
        delta = _delta(index, numel)
        expected = delta.clone()  # every peer claims the same tokens, so the true average is the plain mean
        for other in range(peers):
            if other != index:
                expected.add_(_delta(other, numel))
        expected.div_(peers)
        results = []
        for rep in range(reps):
            head = averager.head  # certified by the previous rep: every rep is one more round of the same chain
            node.update_record(**PeerRecord.announce(fingerprint="bench", config_json="{}", round=head.round,
                                                     state_hash=HASH, work=head.work, ready=True).to_value())
            group = averager.find_group(head.round, HASH).result(timeout=WAIT_S)
            held: dict[str, Any] = {}

            def apply(average: torch.Tensor, held: dict[str, Any] = held) -> str:
                held["t"], held["average"] = time.time(), average
                return HASH  # keeps the state, so every rep starts from HASH

            barrier.wait(WAIT_S)
            t0 = time.time()
            timed.calls.clear()
            before = resource.getrusage(resource.RUSAGE_SELF)
            result = averager.run_round(group, Contribution(delta=delta, tokens=1000), apply=apply)
            t1 = time.time()
            after = resource.getrusage(resource.RUSAGE_SELF)
            if result.outcome != Outcome.COMMITTED:
                raise RuntimeError(f"rep {rep}: round ended {result.outcome}: {result.reason}")
            if len(set(result.weights)) != 1:
                raise RuntimeError(f"rep {rep}: unequal weights {result.weights} for equal token claims")
            average = held["average"]
            err = float((average - expected).norm() / expected.norm())
            if not err <= TOLERANCE[codec]:
                raise RuntimeError(f"rep {rep}: {codec} average is off by {err:.3g} (allowed {TOLERANCE[codec]})")
            bandwidth = averager.steps.bandwidth
            results.append({
                "rep": rep, "t0": t0, "t_avg": held["t"], "t1": t1, "leader": group.is_leader,
                "sent": result.bytes_sent, "received": result.bytes_received, "members": len(result.members),
                "direct": result.direct, "pipes": result.pipes, "certify_s": result.certify_s, "error": err,
                "audit_s": result.audit_s, "user_cpu_s": after.ru_utime - before.ru_utime,
                "sys_cpu_s": after.ru_stime - before.ru_stime, "page_faults": after.ru_minflt - before.ru_minflt,
                "digest": hashlib.sha256(average.numpy().tobytes()).hexdigest(),
                **_phases(list(timed.calls), t0, held["t"], result.bytes_sent / bandwidth if bandwidth else 0.0),
            })
            del average, held  # as a peer's outer step does: the next round's buffers reuse this one's memory
        out.put({"index": index, "results": results, "error": None,
                 "encoded_bytes": averager.steps.codec.encoded_size(numel)})
    except Exception as exc:  # reported to the parent, which fails the measurement
        out.put({"index": index, "results": [], "error": f"peer {index}: {exc!r} at {where(exc)}"})
    finally:
        if node is not None:
            node.shutdown()


def _run_allreduce(numel: int, peers: int, reps: int, codec: str, *, netns: list[tuple[str, str]] | None = None,
                   timeout: float = 900, rounds: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every peer's results, by index; raises RuntimeError with the first peer's failure (the rest are killed)."""
    if netns is not None and len(netns) < peers:
        raise ValueError(f"netns: {len(netns)} namespaces for {peers} peers")
    ctx = mp.get_context("spawn")
    boot, out, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(peers)
    procs = [
        ctx.Process(target=_allreduce_worker, daemon=False,
                    args=(i, peers, numel, reps, codec, netns[i] if netns else None, boot, barrier, out, rounds))
        for i in range(peers)
    ]
    outputs: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(outputs) < peers:
            try:
                o = out.get(timeout=5.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (0, None) and i not in outputs]
                if dead or time.monotonic() > deadline:
                    why = f"peers {dead} died without reporting" if dead else f"no result within {timeout:.0f} s"
                    raise RuntimeError(f"averaging workers failed: {why}") from None
                continue
            if o["error"]:
                raise RuntimeError(f"averaging workers failed: {o['error']}")
            outputs[o["index"]] = o
        for p in procs:  # let each peer shut its node down cleanly; kill_processes below ends any straggler
            p.join(max(1.0, min(30.0, deadline - time.monotonic())))
    finally:
        barrier.abort()  # peers still waiting at the barrier fail at once instead of at WAIT_S
        kill_processes([p for p in procs if p.pid is not None])
    return [outputs[i] for i in range(peers)]


def _rep_rows(outputs: list[dict[str, Any]], peers: int, reps: int) -> list[list[dict[str, Any]]]:
    """Per rep, every peer's row, after the checks that make the rep a valid measurement."""
    per_rep = []
    for rep in range(reps):
        rows = [o["results"][rep] for o in outputs]
        if any(r["members"] != peers for r in rows):
            raise RuntimeError(f"rep {rep}: a group of {[r['members'] for r in rows]} formed, expected {peers}")
        if len({r["digest"] for r in rows}) != 1:
            raise RuntimeError(f"rep {rep}: peers hold different averages")
        if any(r["direct"] != peers - 1 for r in rows):
            raise RuntimeError("some shard connections fell back to libp2p streams; the measurement would mix "
                               "transports")
        per_rep.append(rows)
    return per_rep


def ours_allreduce(size_mb: float, peers: int, reps: int, codec: str,
                   netns: list[tuple[str, str]] | None = None, rounds: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per rep after one warm-up: `seconds` (release → the slowest peer holds the average), `round_s` (→ the last
    peer holds the certificate), bytes sent per peer (max, mean) and the slowest peer's phases; plus the encoded
    vector's size. `rounds`: RoundConfig fields to override (the aggregator, the audit)."""
    numel = int(size_mb * 2**20 // 4)
    outputs = _run_allreduce(numel, peers, reps + 1, codec, netns=netns, rounds=rounds)
    out: dict[str, Any] = {"encoded_bytes": outputs[0]["encoded_bytes"], "numel": numel, "reps": []}
    for rows in _rep_rows(outputs, peers, reps + 1)[1:]:  # rep 0 is a warm-up, as for gloo and hivemind
        t0 = min(r["t0"] for r in rows)
        sent = [r["sent"] for r in rows]
        rep = {
            "seconds": max(r["t_avg"] for r in rows) - t0,
            "round_s": max(r["t1"] for r in rows) - t0,
            "release_spread_s": max(r["t0"] for r in rows) - t0,
            "sent_max": max(sent), "sent_mean": sum(sent) / peers,
            "received_max": max(r["received"] for r in rows),
            "error_max": max(r["error"] for r in rows),
        }
        for key in ("plan_s", "parts_s", "reduced_s", "average_s", "audit_s"):  # the slowest peer reaching each
            rep[key] = max(r[key] for r in rows)
        for key in ("encode_cpu_s", "accumulate_cpu_s", "decode_cpu_s", "user_cpu_s", "sys_cpu_s", "page_faults"):
            rep[key] = sum(r[key] for r in rows) / peers
        out["reps"].append(rep)
    return out


def measured_round_bytes(codec: str, peers: int) -> dict[str, Any]:
    """Wire bytes per peer per round for a 1 MiB-parameter tensor; `params` lets the caller scale per parameter."""
    numel = 2**18
    rows = _rep_rows(_run_allreduce(numel, peers, 1, codec), peers, 1)[0]
    return {
        "params": numel,
        "sent_bytes": sum(r["sent"] for r in rows) / peers,
        "received_bytes": sum(r["received"] for r in rows) / peers,
        "leader_sent_bytes": sum(r["sent"] for r in rows if r["leader"]),
        "topology": "sharded reduce",
        "codec": codec,
    }


def round_phases(size_mb: float, peers: int, reps: int, codec: str) -> list[dict[str, float]]:
    """Per rep: the whole round (the release to the last peer done, certificate included) and, of it, the
    certification phase (statement signed, votes gathered, certificate sent and verified; slowest peer)."""
    numel = int(size_mb * 2**20 // 4)
    per_rep = _rep_rows(_run_allreduce(numel, peers, reps, codec), peers, reps)
    return [{"round_s": max(r["t1"] for r in rows) - min(r["t0"] for r in rows),
             "certify_s": max(r["certify_s"] for r in rows)} for rows in per_rep]

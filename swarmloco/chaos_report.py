"""What a chaos run measured: per-peer resources sampled from /proc, the rounds the peers agree on, goodput, and a
small PNG of committed tokens over time drawn without any plotting library (zlib + struct on a raster).
"""
from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmloco.proc_memory import descendants
from swarmloco.protocol.base.text import short_hash
from swarmloco.swarm_procs import PeerProc


def is_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _status(pid: int) -> tuple[float, int]:
    """(RSS in MB, threads) of one process."""
    rss, threads = 0.0, 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return rss, threads


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


@dataclass(kw_only=True)
class PeerPeak:
    rss_mb: float = 0.0
    fds: int = 0
    threads: int = 0


@dataclass(kw_only=True)
class ProcSampler:
    """Peak RSS, open fds and threads of each peer's process tree (the peer, its DHT child, p2pd), and every pid
    seen under a peer, so that cleanup can tell whether any of them outlived the run."""

    peaks: dict[str, PeerPeak] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)

    def sample(self, roots: dict[str, int]) -> None:
        for name, root in roots.items():
            pids = [root, *descendants(root)]
            self.seen.update(pids)
            rss = threads = fds = 0
            for pid in pids:
                r, t = _status(pid)
                rss, threads, fds = rss + r, threads + t, fds + _fds(pid)
            peak = self.peaks.setdefault(name, PeerPeak())
            peak.rss_mb, peak.fds, peak.threads = max(peak.rss_mb, rss), max(peak.fds, fds), max(peak.threads, threads)

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {name: {"peak_rss_mb": round(p.rss_mb, 1), "peak_fds": p.fds, "peak_threads": p.threads}
                for name, p in sorted(self.peaks.items())}


@dataclass(kw_only=True)
class Agreed:
    """The certified rounds every reporting peer agrees on: round -> (first commit time, tokens merged)."""

    rounds: dict[int, tuple[float, int]]
    split: list[int]

    @property
    def tokens(self) -> int:
        return sum(tokens for _, tokens in self.rounds.values())


def agreed_rounds(peers: dict[str, PeerProc]) -> Agreed:
    """Rounds committed with one state hash by every peer that reports them; tokens are the plan's bounded token
    weights (what the average was weighted by), as each member's round event lists them."""
    hashes: dict[int, set[str]] = {}
    info: dict[int, tuple[float, int]] = {}
    for p in peers.values():
        for e in p.events:
            if e.get("event") != "round" or e.get("outcome") not in ("committed", "mismatch"):
                continue
            rnd = int(e["round"])
            hashes.setdefault(rnd, set()).add(str(e.get("state_hash_full") or e.get("state_hash")))
            t, tokens = info.get(rnd, (float(e.get("time", 0.0)), 0))
            weights = e.get("weights") or []
            info[rnd] = (min(t, float(e.get("time", t))), max(tokens, int(sum(weights))))
    split = sorted(r for r, hs in hashes.items() if len(hs) > 1)
    return Agreed(rounds={r: info[r] for r in sorted(hashes) if r not in split}, split=split)


def views_per_round(peers: dict[str, PeerProc]) -> float | None:
    """Views each committed round took: its group formed in view v of the round's schedule, so the round used v + 1
    views (v = 0: the first leader's group committed). The mean over every peer's committed rounds."""
    views = [int(e.get("view", 0)) + 1 for p in peers.values() for e in p.events
             if e.get("event") == "round" and e.get("outcome") == "committed"]
    return round(sum(views) / len(views), 3) if views else None


def second_passes(peers: dict[str, PeerProc]) -> int:
    """Committed rounds that needed a second pass of the reduce (a reduced shard was lost, and the round was reduced
    again without its reducer): distinct round numbers over every peer's events."""
    return len({int(e["round"]) for p in peers.values() for e in p.events
                if e.get("event") == "round" and e.get("outcome") == "committed" and int(e.get("passes", 1)) > 1})


def newest_state(p: PeerProc) -> tuple[int, str] | None:
    """The newest (round, short state hash) this peer reached, committed or fetched (resync), from its events."""
    best: tuple[int, str] | None = None
    for e in p.events:
        kind, outcome = e.get("event"), e.get("outcome")
        if (kind == "round" and outcome == "committed") or kind == "resync":
            state = (int(e["round"]), short_hash(str(e.get("state_hash_full") or e.get("state_hash"))))
            if best is None or state[0] >= best[0]:
                best = state
    return best


def agreement(live: dict[str, PeerProc], since: float) -> dict[str, str] | None:
    """Each live peer's short hash if they all hold one newest state and some peer committed a round after `since`
    (the last fault), else None.

    A chaos run compares the peers' states at this moment, not the summaries they write when stopped: a round in
    flight at SIGTERM may commit on the members that received its results and not on the others, so their states at
    exit can differ although the swarm agreed."""
    states = {name: newest_state(p) for name, p in live.items()}
    after = any(e.get("event") == "round" and e.get("outcome") == "committed" and float(e.get("time", 0)) > since
                for p in live.values() for e in p.events)
    if not after or None in states.values() or len(set(states.values())) != 1:
        return None
    return {name: state[1] for name, state in states.items() if state is not None}


def final_hash(p: PeerProc, since: float) -> str | None:
    """The state a peer ended on: its summary's hash when it wrote one in this run, else its newest from events."""
    import json

    path = p.workdir / "summary.json"
    if path.exists() and path.stat().st_mtime >= since:
        try:
            value = json.loads(path.read_text()).get("state_hash")
        except (OSError, ValueError):
            value = None
        if value:
            return short_hash(str(value))
    state = newest_state(p)
    return state[1] if state else None


# --- the plot -------------------------------------------------------------------------------------------------------
BLACK, RED, GREY, WHITE = (0, 0, 0), (220, 30, 30), (200, 200, 200), (255, 255, 255)


def _png(width: int, height: int, pixels: list[bytearray]) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _line(pixels: list[bytearray], a: tuple[int, int], b: tuple[int, int], color: Sequence[int]) -> None:
    (x0, y0), (x1, y1) = a, b
    steps = max(abs(x1 - x0), abs(y1 - y0), 1)
    for i in range(steps + 1):
        x, y = round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps)
        if 0 <= y < len(pixels) and 0 <= x < len(pixels[0]) // 3:
            pixels[y][3 * x: 3 * x + 3] = bytes(color)


def write_plot(path: Path, points: Iterable[tuple[float, int]], faults: Iterable[float], duration: float,
               *, width: int = 640, height: int = 320) -> None:
    """Cumulative committed tokens over time (black steps) with the faults' times as red vertical lines; axes grey.
    No labels (there is no font here): the JSON beside it holds the numbers."""
    pts = sorted(points)
    top = max((tok for _, tok in pts), default=0) or 1
    span = max(duration, max((t for t, _ in pts), default=0.0), 1e-6)
    margin = 10
    pixels = [bytearray(WHITE * width) for _ in range(height)]

    def xy(t: float, tok: float) -> tuple[int, int]:
        return (margin + round((width - 2 * margin) * t / span),
                height - margin - round((height - 2 * margin) * tok / top))

    _line(pixels, xy(0, 0), xy(span, 0), GREY)
    _line(pixels, xy(0, 0), xy(0, top), GREY)
    for t in faults:
        _line(pixels, xy(t, 0), xy(t, top), RED)
    last = (0.0, 0)
    for t, tok in pts:
        _line(pixels, xy(last[0], last[1]), xy(t, last[1]), BLACK)
        _line(pixels, xy(t, last[1]), xy(t, tok), BLACK)
        last = (t, tok)
    _line(pixels, xy(last[0], last[1]), xy(span, last[1]), BLACK)
    path.write_bytes(_png(width, height, pixels))


def token_curve(agreed: Agreed, t0: float) -> list[tuple[float, int]]:
    """(seconds since t0, cumulative tokens) at each agreed round's first commit."""
    total, out = 0, []
    for _, (t, tokens) in sorted(agreed.rounds.items(), key=lambda kv: kv[1][0]):
        total += tokens
        out.append((max(0.0, t - t0), total))
    return out


def summary_fields(peers: dict[str, PeerProc], t0: float, t1: float) -> dict[str, Any]:
    """rounds_committed, tokens and goodput over the wall time [t0, t1] (unix seconds)."""
    agreed = agreed_rounds(peers)
    in_window = {r: v for r, v in agreed.rounds.items() if t0 <= v[0] <= t1}
    tokens = sum(tok for _, tok in in_window.values())
    wall = max(t1 - t0, 1e-9)
    return {
        "rounds_committed": len(in_window),
        "rounds_split": agreed.split,
        "tokens_committed": tokens,
        "wall_s": round(wall, 2),
        "goodput_tokens_per_s": round(tokens / wall, 3),
        "views_per_round": views_per_round(peers),
        "rounds_reduced_twice": second_passes(peers),
        # when each of those rounds committed, in seconds from the fault window's start (as faults' `t` are)
        "committed_at_s": sorted(round(t - t0, 2) for t, _ in in_window.values()),
    }


def run_notes(scenario: str, fields: dict[str, Any]) -> list[str]:
    """What the numbers of a chaos run's JSON mean, and what is special about this scenario's."""
    notes = [
        "views_per_round: the mean over committed round events of (the view the group formed in + 1)",
        "tokens: the certified plans' bounded token weights summed over the rounds all reporting peers agree on, "
        "within the fault window plus settling; goodput divides them by that wall time",
        "peak_rss_mb sums RSS over each peer's process tree (shared pages counted in every process)",
    ]
    if scenario == "sigstop-leader":
        notes.append("the stopped peer is the leader of the newest committed round (the next round's leader seed is "
                     "in the certificate, which the event logs do not carry)")
    if scenario == "reducer-withholder":
        notes.append("peer-3 withholds its reduced shard in every round: rounds_reduced_twice counts the committed "
                     "rounds that were reduced again without it")
    if scenario == "partition-2-2":
        notes.append("each peer runs in a network namespace of its own; the split cuts the one link between the two "
                     "halves' bridges, so no half holds a quorum of a majority while it lasts")
    if fields["views_per_round"] is None:
        notes.append("views_per_round is null: no peer committed a round")
    return notes

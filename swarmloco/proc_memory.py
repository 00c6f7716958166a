"""Memory of a process tree read from /proc: what one peer (its Python process, its DHT child, its p2pd daemons)
costs the machine. RSS counts pages shared between a forked parent and child twice; PSS splits each shared page
between its users, so the PSS of all peers adds up to what they take from the machine together.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


def descendants(pid: int) -> list[int]:
    """Live descendants of pid, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


@dataclass
class ProcMemory:
    pid: int
    name: str
    rss_mb: float
    pss_mb: float


@dataclass
class TreeMemory:
    """One process and its descendants."""

    procs: list[ProcMemory] = field(default_factory=list)

    @property
    def rss_mb(self) -> float:
        return sum(p.rss_mb for p in self.procs)

    @property
    def pss_mb(self) -> float:
        return sum(p.pss_mb for p in self.procs)

    def by_kind(self) -> dict[str, float]:
        """PSS per kind of process: the peer itself, its forked DHT child, its p2pd daemons."""
        out: dict[str, float] = {}
        for i, p in enumerate(self.procs):
            kind = "peer" if i == 0 else ("p2pd" if "p2pd" in p.name else "dht child")
            out[kind] = out.get(kind, 0.0) + p.pss_mb
        return out


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def proc_memory(pid: int) -> ProcMemory | None:
    """RSS and PSS of one process in MB (smaps_rollup: no page walk per mapping), or None if it is gone."""
    rss = pss = 0.0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return ProcMemory(pid, _name(pid), rss, pss)


def tree_memory(pid: int) -> TreeMemory:
    tree = TreeMemory()
    for p in [pid, *descendants(pid)]:
        m = proc_memory(p)
        if m is not None:
            tree.procs.append(m)
    return tree


@dataclass
class SwarmMemory:
    """Peak memory of a local swarm over repeated samples: the peers' trees plus what they share (a fork server)."""

    peak_total_pss_mb: float = 0.0
    peak_peer_pss_mb: float = 0.0
    peak_peer_rss_mb: float = 0.0
    at_peak: dict[str, float] = field(default_factory=dict)  # PSS by kind of process, summed, at the peak
    samples: int = 0

    def sample(self, peer_pids: list[int], shared_pids: list[int]) -> float:
        trees = [tree_memory(pid) for pid in peer_pids]
        shared = [m for m in (proc_memory(pid) for pid in shared_pids) if m is not None]
        total = sum(t.pss_mb for t in trees) + sum(m.pss_mb for m in shared)
        self.samples += 1
        for t in trees:
            self.peak_peer_pss_mb = max(self.peak_peer_pss_mb, t.pss_mb)
            self.peak_peer_rss_mb = max(self.peak_peer_rss_mb, t.rss_mb)
        if total > self.peak_total_pss_mb:
            self.peak_total_pss_mb = total
            kinds: dict[str, float] = {"fork server": sum(m.pss_mb for m in shared)} if shared else {}
            for t in trees:
                for kind, mb in t.by_kind().items():
                    kinds[kind] = kinds.get(kind, 0.0) + mb
            self.at_peak = {k: round(v, 1) for k, v in kinds.items()}
        return total

    def to_dict(self, peers: int) -> dict[str, object]:
        if not self.samples:
            return {}
        return {"peak_total_pss_mb": round(self.peak_total_pss_mb, 1),
                "per_peer_pss_mb": round(self.peak_total_pss_mb / max(peers, 1), 1),
                "peak_peer_tree_pss_mb": round(self.peak_peer_pss_mb, 1),
                "peak_peer_tree_rss_mb": round(self.peak_peer_rss_mb, 1),
                "pss_by_kind_at_peak": self.at_peak, "samples": self.samples}


def cmdline(pid: int) -> str:
    """The process's command line, spaces between its arguments ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

"""Fork choice: which certified states outrank ours, decided by every peer the same way from the records it reads.

A record's claim is only a pointer: `swarmloco.protocol.chain.chain` adopts a claimed state only once its commit
certificate verifies.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from swarmloco.protocol.base.records import PeerRecord


@dataclass(frozen=True)
class Behind:
    """The swarm holds a certified state that outranks ours: fetch it from these donors. `certificate` is the
    verified `swarmloco.protocol.trust.certificates.Certificate` of that state."""

    round: int
    state_hash: str
    donors: list[str]
    work: int = 0
    certificate: Any = None


def active_past_genesis(records: Mapping[str, PeerRecord]) -> int:
    """Us and every peer that holds a certified state (past θ_0): what a certificate must speak for."""
    return 1 + sum(1 for r in records.values() if r.round >= 1)


@dataclass(frozen=True)
class StateClaim:
    """A state some peers say they hold, and the certified work they say leads to it."""

    round: int
    state_hash: str
    work: int
    donors: tuple[str, ...]


def outranks(a: tuple[int, int, str], b: tuple[int, int, str]) -> bool:
    """Fork choice, applied by every peer the same way: more certified work wins, then the higher round, then the
    smaller hash."""
    return (a[0], a[1]) > (b[0], b[1]) or ((a[0], a[1]) == (b[0], b[1]) and a[2] < b[2])


def better_claims(records: Mapping[str, PeerRecord], *, round_number: int, state_hash: str, work: int,
                  genesis_hash: str) -> list[StateClaim]:
    """Claims that outrank the state we hold, best first. θ_0 needs no claim: every peer computes it, so any other
    round-0 hash is refused outright."""
    groups: dict[tuple[int, int, str], list[str]] = {}
    for peer, rec in records.items():
        if rec.round == 0 and rec.state_hash != genesis_hash:
            continue
        groups.setdefault((rec.work, rec.round, rec.state_hash), []).append(peer)
    ours = (work, round_number, state_hash)
    found = [StateClaim(round=k[1], state_hash=k[2], work=k[0], donors=tuple(sorted(v)))
             for k, v in groups.items() if outranks(k, ours)]
    found.sort(key=lambda c: (-c.work, -c.round, c.state_hash))
    return found

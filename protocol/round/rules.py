"""The rules of one averaging round, as plain functions on plain data: no sockets, no asyncio, no clocks.

Everything a peer decides about a round lives here, so that every peer decides it the same way and the rules are
unit-tested without a network:
- which peers may average together (`compatible`), and the swarm a group must be a majority of (`active_count`);
- how long a leader waits for peers that are about to be ready (`grace_over`);
- which contributions are admissible (`check_contribution`), how much each weighs (`token_weights`) and their
  weighted average (`weighted_average`).
Who leads which view of a round is in `swarmloco.protocol.round.schedule`; the round's configuration and deadlines
are in `swarmloco.protocol.round.config`; the fork choice between certified states in
`swarmloco.protocol.chain.forks`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any

import torch

from swarmloco.protocol.base.records import PROTOCOL_VERSION, PeerRecord, describe_difference
from swarmloco.protocol.round.config import MAX_TOKENS, RoundConfig


def compatible(records: Mapping[str, PeerRecord], fingerprint: str) -> dict[str, PeerRecord]:
    """The records of peers that speak our protocol version and train our model (the only ones we average with)."""
    return {p: r for p, r in records.items() if r.version == PROTOCOL_VERSION and r.fingerprint == fingerprint}


def compatibility_problem(records: Mapping[str, PeerRecord], *, fingerprint: str, config: dict[str, Any]) -> str | None:
    """Why this peer cannot join the swarm described by `records`, or None. A swarm is joinable as soon as one
    record speaks our protocol version and trains our model; otherwise the message names what differs."""
    if not records or compatible(records, fingerprint):
        return None
    rec = next(iter(records.values()))
    if rec.version != PROTOCOL_VERSION:
        return (f"the swarm speaks protocol version {rec.version}, this peer {PROTOCOL_VERSION}; "
                "install the matching swarmloco")
    return f"the swarm trains a different model: {describe_difference(config, rec.config())}"


def active_peers(records: Mapping[str, PeerRecord], round_number: int) -> set[str]:
    """The peers a group for round r must be a majority of (with us): every peer at round r − 1 or later (a peer one
    round behind is catching up; a joiner still at an old state is not training with us yet)."""
    return {p for p, r in records.items() if r.round >= round_number - 1}


def active_count(records: Mapping[str, PeerRecord], round_number: int) -> int:
    """The size of that swarm, us included."""
    return 1 + len(active_peers(records, round_number))


def group_forming(records: Mapping[str, PeerRecord], round_number: int, state_hash: str) -> bool:
    """Whether some peer at our (round, state) is ready to average: a group for our round is about to close."""
    return any(r.round == round_number and r.state_hash == state_hash and r.ready
               for r in records.values())


def grace_over(*, waited: float, etas: Sequence[float | None], cfg: RoundConfig) -> bool:
    """Whether a leader that reached quorum `waited` seconds ago stops waiting for more members.

    `etas` holds, for every compatible peer at our round that has not joined yet, how many seconds from now it
    expects to be ready (None: it is ready already). The leader waits for peers expected before the window ends, and
    at least `grace_min_s` when nobody is expected; it never waits past `grace_max_s`.
    """
    if waited >= cfg.grace_max_s:
        return True
    expected = [e for e in etas if e is None or e <= cfg.grace_max_s - waited]
    return not expected and waited >= cfg.grace_min_s


def check_contribution(
    *, codec: str, numel: int, tokens: int, staleness: int, expect_codec: str, expect_numel: int, max_staleness: int
) -> str:
    """Why a contribution's header is refused ("" when it is admissible); checked before its tensor is decoded."""
    if codec != expect_codec:
        return f"codec {codec!r}, round uses {expect_codec!r}"
    if numel != expect_numel:
        return f"{numel} elements, model has {expect_numel}"
    if not 0 < tokens <= MAX_TOKENS:
        return f"token weight {tokens} outside 1 .. {MAX_TOKENS}"
    if staleness > max_staleness:
        return f"staleness {staleness} > {max_staleness}"
    return ""


def token_weights(claims: Mapping[str, tuple[int, int]], *, cfg: RoundConfig,
                  cut: Set[str] = frozenset()) -> dict[str, int]:
    """Merge weight per contributor from its (claimed tokens, staleness): claims are capped at `weight_cap_factor`
    × the group's (lower) median claim, so one peer's inflated count buys at most that multiple of a typical
    member's weight however few honest peers there are, and discounted by `stale_discount` per round of staleness.
    A peer in `cut` (its last certified contribution earned no credit: `swarmloco.protocol.round.credit`) weighs 1.
    Whole numbers, at least 1: every member re-derives them from the signed claims and must get the same."""
    counts = sorted(max(t, 1) for t, _ in claims.values())
    cap = cfg.weight_cap_factor * counts[(len(counts) - 1) // 2]
    return {peer: 1 if peer in cut else max(1, round(min(max(tokens, 1), cap) * cfg.stale_discount**stale))
            for peer, (tokens, stale) in sorted(claims.items())}


def weighted_average(tensors: Mapping[str, torch.Tensor], weights: Mapping[str, float]) -> torch.Tensor:
    """Σ w_i x_i / Σ w_i over peers in sorted order (the same float operations everywhere), one pass per tensor."""
    peers = sorted(tensors)
    total = sum(weights[p] for p in peers)
    if not peers or total <= 0:
        raise ValueError("weighted_average needs at least one contribution with a positive weight")
    acc = torch.mul(tensors[peers[0]], weights[peers[0]] / total)
    for peer in peers[1:]:
        acc.add_(tensors[peer], alpha=weights[peer] / total)
    return acc

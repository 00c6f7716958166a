"""The rules of one averaging round, as plain functions on plain data: no sockets, no asyncio, no clocks.

Everything a peer decides about a round lives here, so that every peer decides it the same way and the rules are
unit-tested without a network:
- which peers may average together (`compatible`), and whom to gather around (`pick_leader`);
- the leader order nobody controls (`leader_rank`), the swarm a group must be a majority of (`active_count`), and
  which claimed states outrank ours (`better_claims`, the fork choice);
- how long a leader waits for peers that are about to be ready (`grace_over`);
- which contributions are admissible (`check_contribution`), how much each weighs (`token_weights`) and their
  weighted average (`weighted_average`);
- every deadline of a round, derived from one config (`Deadlines`), and the words for how a round ended (`Outcome`).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from protocol.codecs import get_codec
from protocol.outcome import Outcome as Outcome  # re-exported: the words for how a round ended sit beside its rules
from protocol.records import PROTOCOL_VERSION, PeerRecord, describe_difference
from protocol.robust import Rule

MAX_TOKENS = 2**40  # no honest peer trains on a trillion tokens in one round; larger claims are refused


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    """How groups form and how contributions are merged. Every deadline of a round derives from these numbers."""

    quorum: int = 2
    grace_min_s: float = 0.5
    grace_max_s: float = 10.0
    round_timeout_s: float = 60.0  # a ready peer waits this long for a group before giving the round up
    exchange_timeout_s: float = 60.0  # moving one contribution, or one result, over the wire
    control_timeout_s: float = 10.0  # one small control frame (join request and reply, group closed, abort)
    codec: str = "int8"
    max_group: int = 64
    weight_cap_factor: float = 4.0  # a member's token weight is capped at this × the group's median claim
    stale_discount: float = 0.5  # weight × discount**staleness for a Δ computed from an older θ
    max_staleness: int = 2
    aggregator: str = "clip"  # per shard: "clip" (median-norm clip, far outliers dropped) or "mean" (plain mean)
    clip_factor: float = 2.0  # clip radius: this × the median norm of the shard's parts
    reject_factor: float = 10.0  # parts longer than this × the median norm are dropped (0: clip only)
    audit_probes: int = 2  # random probes per shard in the audit of every result (0: no audit)

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.quorum <= 10_000, "quorum", self.quorum, "1 .. 10000"),
            (0 <= self.grace_min_s <= self.grace_max_s <= 3600, "grace", (self.grace_min_s, self.grace_max_s),
             "0 <= grace_min_s <= grace_max_s <= 3600"),
            (1 <= self.round_timeout_s <= 86400, "round_timeout_s", self.round_timeout_s, "1 .. 86400"),
            (1 <= self.exchange_timeout_s <= 3600, "exchange_timeout_s", self.exchange_timeout_s, "1 .. 3600"),
            (0.5 <= self.control_timeout_s <= 600, "control_timeout_s", self.control_timeout_s, "0.5 .. 600"),
            (2 <= self.max_group <= 10_000, "max_group", self.max_group, "2 .. 10000"),
            (1 <= self.weight_cap_factor <= 1e6, "weight_cap_factor", self.weight_cap_factor, "1 .. 1e6"),
            (0 < self.stale_discount <= 1, "stale_discount", self.stale_discount, "0 < discount <= 1"),
            (0 <= self.max_staleness <= 100, "max_staleness", self.max_staleness, "0 .. 100"),
            (0 <= self.audit_probes <= 16, "audit_probes", self.audit_probes, "0 .. 16"),
        ]
        for ok, name, value, allowed in checks:
            if not ok:
                raise ValueError(f"{name}: got {value!r}, allowed {allowed}")
        get_codec(self.codec)
        self.rule  # noqa: B018 - validates the aggregation settings

    @property
    def rule(self) -> Rule:
        return Rule(aggregator=self.aggregator, clip_factor=self.clip_factor, reject_factor=self.reject_factor)


@dataclass(frozen=True, kw_only=True)
class LocalModel:
    """What the protocol knows about the model: its fingerprint, its config (to name differences) and flat size."""

    fingerprint: str
    config: dict[str, Any]
    numel: int

    @property
    def config_json(self) -> str:
        return json.dumps(self.config, sort_keys=True, default=str)


@dataclass(frozen=True)
class Deadlines:
    """Every wait of one round, in seconds, from one RoundConfig (no other literal timeouts in the protocol)."""

    control: float  # one control frame (a claim, the plan, a vote, the certificate; opening the shard pipes)
    transfer: float  # all parts of the shards on the wire, and again all reduced shards
    linger: float  # leader: how long a member's stream stays open after the certificate, for it to be read
    exchange: float  # the whole exchange as the training thread waits for it: claims, plan, pipes, two transfers

    @classmethod
    def of(cls, cfg: RoundConfig) -> Deadlines:
        transfer, control = cfg.exchange_timeout_s, cfg.control_timeout_s
        return cls(control=control, transfer=transfer, linger=transfer, exchange=2 * transfer + 5 * control)


@dataclass(frozen=True)
class Behind:
    """The swarm holds a certified state that outranks ours: fetch it from these donors. `certificate` is the
    verified `protocol.certificates.Certificate` of that state."""

    round: int
    state_hash: str
    donors: list[str]
    work: int = 0
    certificate: Any = None


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


def leader_rank(seed: str, peer: str) -> bytes:
    """A peer's place in the leader order of a round: a hash of the round's seed (`Head.seed`: known only once the
    previous round is certified, and not computable by any one peer) with the peer id, so no peer can claim or grind
    its way to the front beyond trying its few admitted identities."""
    return hashlib.sha256(f"{seed}\n{peer}".encode()).digest()


def pick_leader(me: str, my_members: int, candidates: Iterable[str], *, needed: int, seed: str) -> str:
    """Whom to gather around for this round: among us and the ready `candidates` at our state, the lowest
    `leader_rank`. Every peer orders leaders the same way, so splits heal: a leader whose group is below `needed`
    sees the better-ranked one and merges into it. A leader whose group has reached `needed` keeps it (it is about
    to close)."""
    if my_members and 1 + my_members >= needed:
        return me
    return min((me, *candidates), key=lambda p: (leader_rank(seed, p), p))


def active_peers(records: Mapping[str, PeerRecord], round_number: int) -> set[str]:
    """The peers a group for round r must be a majority of (with us): every peer at round r − 1 or later (a peer one
    round behind is catching up; a joiner still at an old state is not training with us yet)."""
    return {p for p, r in records.items() if r.round >= round_number - 1}


def active_count(records: Mapping[str, PeerRecord], round_number: int) -> int:
    """The size of that swarm, us included."""
    return 1 + len(active_peers(records, round_number))


def active_past_genesis(records: Mapping[str, PeerRecord]) -> int:
    """Us and every peer that holds a certified state (past θ_0): what a certificate must speak for."""
    return 1 + sum(1 for r in records.values() if r.round >= 1)


@dataclass(frozen=True)
class Claim:
    """A state some peers say they hold, and the certified work they say leads to it."""

    round: int
    state_hash: str
    work: int
    donors: tuple[str, ...]

    def key(self) -> tuple[int, int, str]:
        return (self.work, self.round, self.state_hash)


def outranks(a: tuple[int, int, str], b: tuple[int, int, str]) -> bool:
    """Fork choice, applied by every peer the same way: more certified work wins, then the higher round, then the
    smaller hash."""
    return (a[0], a[1]) > (b[0], b[1]) or ((a[0], a[1]) == (b[0], b[1]) and a[2] < b[2])


def better_claims(records: Mapping[str, PeerRecord], *, round_number: int, state_hash: str, work: int,
                  genesis_hash: str) -> list[Claim]:
    """Claims that outrank the state we hold, best first. θ_0 needs no claim: every peer computes it, so any other
    round-0 hash is refused outright."""
    groups: dict[tuple[int, int, str], list[str]] = {}
    for peer, rec in records.items():
        if rec.round == 0 and rec.state_hash != genesis_hash:
            continue
        groups.setdefault((rec.work, rec.round, rec.state_hash), []).append(peer)
    ours = (work, round_number, state_hash)
    found = [Claim(round=k[1], state_hash=k[2], work=k[0], donors=tuple(sorted(v)))
             for k, v in groups.items() if outranks(k, ours)]
    found.sort(key=lambda c: (-c.work, -c.round, c.state_hash))
    return found


def group_forming(records: Mapping[str, PeerRecord], round_number: int, state_hash: str) -> bool:
    """Whether some peer at our (round, state) is ready to average: a group for our round is about to close."""
    return any(r.round == round_number and r.state_hash == state_hash and (r.ready or r.leading)
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


def token_weights(claims: Mapping[str, tuple[int, int]], *, cfg: RoundConfig) -> dict[str, int]:
    """Merge weight per contributor from its (claimed tokens, staleness): claims are capped at `weight_cap_factor`
    × the group's (lower) median claim, so one peer's inflated count buys at most that multiple of a typical
    member's weight however few honest peers there are, and discounted by `stale_discount` per round of staleness.
    Whole numbers, at least 1: every member re-derives them from the signed claims and must get the same."""
    counts = sorted(max(t, 1) for t, _ in claims.values())
    cap = cfg.weight_cap_factor * counts[(len(counts) - 1) // 2]
    return {peer: max(1, round(min(max(tokens, 1), cap) * cfg.stale_discount**stale))
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

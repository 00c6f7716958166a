"""The control side of a round between a leader and its members, on the authenticated libp2p join streams.

A member and its leader are joined by a `Link`: the stream the member joined on. After the group closes it
carries only small frames — the member's claim (tokens, staleness, how to reach it), the leader's plan, the
member's vote and the leader's certificate; the tensors move between the members themselves
(`swarmloco.protocol.round.shard_reduce`). The leader's checks on a claim are made here, before the claim can
weigh anything.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf.message import Message

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.text import short_id
from swarmloco.protocol.base.wire import WireError, close_writer, frame_bytes, read_frame, write_frame
from swarmloco.protocol.round.config import RoundConfig
from swarmloco.protocol.round.plans import Endpoint, Plan, endpoint_ok
from swarmloco.protocol.round.rules import check_contribution, token_weights
from swarmloco.protocol.trust.payloads import claim_body, signed

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)


@dataclass
class Link:
    peer: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def send(self, header: Message, payload: bytes | bytearray | memoryview = b"", *, timeout: float) -> int:
        """One frame; returns the bytes it took."""
        await write_frame(self.writer, header, payload, timeout=timeout)
        return frame_bytes(header, len(payload))

    async def recv(self, header_type: type[M], *, max_payload: int, timeout: float) -> tuple[M, bytearray]:
        return await read_frame(self.reader, header_type, max_payload=max_payload, timeout=timeout)

    def close(self) -> None:
        """Idempotent; libp2p still delivers what was sent before the close."""
        close_writer(self.writer)


@dataclass(frozen=True)
class MemberClaim:
    """What a contributor brings to a round, as its leader admitted it: the signed claim itself, and what follows
    from it."""

    tokens: int
    staleness: int  # rounds between the certified state the Δ was computed from and this round's
    endpoint: Endpoint
    bandwidth: float
    signed: pb.ContributionClaim = field(default_factory=pb.ContributionClaim)

    @classmethod
    def of(cls, header: pb.ContributionClaim) -> MemberClaim:
        return cls(int(header.tokens), int(header.round - header.base_round),
                   claimed_endpoint(header), float(header.bandwidth), header)


@dataclass(frozen=True)
class ClaimContext:
    """What every claim of one group must say: who signs it is checked against the peer it came from."""

    run_id: str
    round: int
    prev_hash: str
    leader: str
    codec: str
    numel: int
    max_staleness: int
    uncredited: frozenset[str] = frozenset()  # merge weight 1: the last certified round did not credit their work


@dataclass
class Claims:
    """What a leader collected: admissible claims by peer, the refused ones with the reason."""

    admitted: dict[str, MemberClaim] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)


def claim_problem(header: pb.ContributionClaim, *, peer: str, ctx: ClaimContext) -> str:
    """Why `peer`'s claim is refused ("" when it is admissible): it must be signed by `peer`, for this group, with
    a well-formed endpoint and a base state at most `max_staleness` rounds old."""
    if header.round != ctx.round or header.prev_hash != ctx.prev_hash or header.leader != ctx.leader:
        return f"claim is for round {header.round} of another group"
    if not header.base_round <= header.round:
        return f"base round {header.base_round} is after round {header.round}"
    problem = check_contribution(codec=header.codec, numel=header.numel, tokens=header.tokens,
                                 staleness=header.round - header.base_round, expect_codec=ctx.codec,
                                 expect_numel=ctx.numel, max_staleness=ctx.max_staleness)
    if problem:
        return problem
    if not endpoint_ok(claimed_endpoint(header)):
        return "malformed shard endpoint"
    if not 0 <= header.bandwidth < float("inf"):
        return f"bandwidth {header.bandwidth} is not a finite non-negative number"
    if len(header.audit_commit) != 64 or len(header.base_hash) > 64:
        return "malformed audit commitment or base hash"
    if not signed(peer, claim_body(ctx.run_id, header), bytes(header.signature)):
        return "claim is not signed by its sender"
    return ""


def claimed_endpoint(claim: pb.ContributionClaim) -> Endpoint:
    """The shard endpoint a member's signed claim states."""
    return Endpoint(tuple(claim.data_addrs), claim.data_token, bool(claim.dials_out))


def plan_claims_problem(plan: Plan, *, ctx: ClaimContext, cfg: RoundConfig) -> str:
    """Why a plan's contributors, weights and endpoints are not what their signed claims say ("" when they are):
    a member re-derives all three rather than take the leader's word for them."""
    if len(plan.claims) != len(plan.members):
        return "plan does not carry one signed claim per contributor"
    for peer, claim, endpoint in zip(plan.members, plan.claims, plan.endpoints, strict=True):
        problem = claim_problem(claim, peer=peer, ctx=ctx)
        if problem:
            return f"claim of {short_id(peer)}: {problem}"
        if claimed_endpoint(claim) != endpoint:
            return f"plan gives {short_id(peer)} another endpoint than it claimed"
    claimed = {p: MemberClaim.of(c) for p, c in zip(plan.members, plan.claims, strict=True)}
    claims = {p: (c.tokens, c.staleness) for p, c in claimed.items()}
    weights = token_weights(claims, cfg=cfg, cut=ctx.uncredited)
    if tuple(weights[p] for p in plan.members) != plan.weights:
        return "plan's weights are not those its signed claims give"
    return ""


async def collect_claims(links: dict[str, Link], *, ctx: ClaimContext, timeout: float,
                         base_known: Callable[[int, str], bool]) -> Claims:
    """Every member's claim in parallel; a member silent after `timeout` is excluded, and so is one whose Δ is
    based on a state we cannot tell is certified (`base_known(round, hash)`)."""
    into = Claims()

    async def one(link: Link) -> None:
        try:
            header, _ = await link.recv(pb.ContributionClaim, max_payload=0, timeout=timeout)
        except WireError as exc:
            into.excluded[link.peer] = f"no contribution: {exc}"
            return
        problem = claim_problem(header, peer=link.peer, ctx=ctx)
        if not problem and not base_known(int(header.base_round), header.base_hash):
            problem = f"its Δ is based on round {header.base_round}, a state we do not know as certified"
        if problem:
            into.excluded[link.peer] = problem
            return
        into.admitted[link.peer] = MemberClaim.of(header)

    await asyncio.gather(*(one(link) for link in links.values()))
    return into


async def broadcast(links: dict[str, Link], header: Message, *, timeout: float) -> int:
    """The same control frame to every member; returns the bytes delivered. A member that cannot be reached is
    logged and skipped: it finds itself behind (or its round discarded) and carries on from the certified state."""

    async def one(link: Link) -> int:
        try:
            return await link.send(header, timeout=timeout)
        except WireError as exc:
            logger.info("could not deliver %s to %s: %r", type(header).__name__, short_id(link.peer), exc)
            return 0

    return sum(await asyncio.gather(*(one(link) for link in links.values())))

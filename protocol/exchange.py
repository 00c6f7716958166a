"""The control side of a round between a leader and its members, on the authenticated libp2p join streams.

A member and its leader are joined by a `Link`: the stream the member joined on. After the group closes it
carries only small frames — the member's claim (tokens, staleness, how to reach it), the leader's plan, the
member's vote and the leader's certificate; the tensors move between the members themselves (`protocol.shards`).
The leader's checks on a claim are made here, before the claim can weigh anything.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf.message import Message

from protocol import swarmloco_wire_pb2 as pb
from protocol.plans import Endpoint, endpoint_ok
from protocol.rounds import check_contribution
from protocol.wire import WireError, close_writer, frame_bytes, read_frame, write_frame

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
class Claim:
    """What a contributor brings to a round, as its leader admitted it."""

    tokens: int
    staleness: int
    endpoint: Endpoint
    bandwidth: float


@dataclass
class Claims:
    """What a leader collected: admissible claims by peer, the refused ones with the reason."""

    admitted: dict[str, Claim] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)


def claim_problem(header: pb.Contribution, *, codec: str, numel: int, max_staleness: int) -> str:
    """Why a member's claim is refused ("" when it is admissible)."""
    problem = check_contribution(codec=header.codec, numel=header.numel, tokens=header.tokens,
                                 staleness=header.staleness, expect_codec=codec, expect_numel=numel,
                                 max_staleness=max_staleness)
    if problem:
        return problem
    if not endpoint_ok(Endpoint(tuple(header.data_addrs), header.data_token)):
        return "malformed shard endpoint"
    if not 0 <= header.bandwidth < float("inf"):
        return f"bandwidth {header.bandwidth} is not a finite non-negative number"
    return ""


async def collect_claims(links: dict[str, Link], *, codec: str, numel: int, max_staleness: int,
                         timeout: float) -> Claims:
    """Every member's claim in parallel; a member silent after `timeout` is excluded."""
    into = Claims()

    async def one(link: Link) -> None:
        try:
            header, _ = await link.recv(pb.Contribution, max_payload=0, timeout=timeout)
        except WireError as exc:
            into.excluded[link.peer] = f"no contribution: {exc}"
            return
        problem = claim_problem(header, codec=codec, numel=numel, max_staleness=max_staleness)
        if problem:
            into.excluded[link.peer] = problem
            return
        into.admitted[link.peer] = Claim(int(header.tokens), int(header.staleness),
                                         Endpoint(tuple(header.data_addrs), header.data_token), float(header.bandwidth))

    await asyncio.gather(*(one(link) for link in links.values()))
    return into


async def broadcast(links: dict[str, Link], header: Message, *, timeout: float) -> int:
    """The same control frame to every member; returns the bytes delivered. A member that cannot be reached is
    logged and skipped: it finds itself behind (or its round discarded) and carries on from the certified state."""

    async def one(link: Link) -> int:
        try:
            return await link.send(header, timeout=timeout)
        except WireError as exc:
            logger.info("could not deliver %s to %s: %r", type(header).__name__, link.peer[-8:], exc)
            return 0

    return sum(await asyncio.gather(*(one(link) for link in links.values())))

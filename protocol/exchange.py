"""Moving one round's tensors: each member's contribution to the leader, and the leader's result back.

A member and its leader are joined by a `Link`: the authenticated libp2p stream the member joined on, plus — when
the member could reach the leader's data plane — a direct TCP connection for the bulk bytes. A link decides once
which of the two carries a frame, so neither side repeats that choice. The leader's checks on what arrives
(size, codec, finiteness, token bound, staleness) are made here, before anything is accumulated.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from google.protobuf.message import Message

from protocol import swarmloco_wire_pb2 as pb
from protocol.codecs import Codec, CodecError
from protocol.data_plane import DataConn
from protocol.rounds import check_contribution
from protocol.wire import WireError, close_writer, frame_bytes, read_frame, write_frame

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)


@dataclass
class Link:
    peer: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    direct: DataConn | None = None  # the TCP data connection, once one is in use
    offer: asyncio.Future[DataConn] | None = None  # leader: resolves when the member dials the data plane
    token: str = ""  # leader: the one-time data-plane token offered to this member

    async def send(self, header: Message, payload: bytes | bytearray | memoryview = b"", *, timeout: float) -> int:
        """One frame, on the data connection when there is one; returns the bytes it took."""
        if self.direct is not None:
            await self.direct.send_frame(header, payload, timeout=timeout)
        else:
            await write_frame(self.writer, header, payload, timeout=timeout)
        return frame_bytes(header, len(payload))

    async def recv(self, header_type: type[M], *, max_payload: int, timeout: float) -> tuple[M, bytearray]:
        if self.direct is not None:
            return await self.direct.recv_frame(header_type, max_payload=max_payload, timeout=timeout)
        return await read_frame(self.reader, header_type, max_payload=max_payload, timeout=timeout)

    def close(self) -> None:
        """Idempotent; TCP and libp2p still deliver what was sent before the close."""
        close_writer(self.writer)
        if self.direct is not None:
            self.direct.close()


@dataclass
class Received:
    """What a leader collected: admissible contributions by peer, the refused ones with the reason, wire bytes."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    claims: dict[str, tuple[int, int]] = field(default_factory=dict)  # peer -> (tokens, staleness)
    excluded: dict[str, str] = field(default_factory=dict)
    bytes: int = 0


async def send_contribution(link: Link, header: pb.Contribution, payload: bytes | memoryview, *, timeout: float) -> int:
    """Member side. With a data connection, the control stream only announces it and the bytes go direct."""
    if link.direct is not None:
        await write_frame(link.writer, pb.Contribution(via_data_plane=True), timeout=timeout)
    return await link.send(header, payload, timeout=timeout)


async def receive_contribution(link: Link, *, codec: Codec, numel: int, max_staleness: int, timeout: float,
                               into: Received) -> None:
    """Leader side: read, check and decode one member's contribution into `into` (or record why it was refused)."""
    cap = codec.encoded_size(numel)
    try:
        header, body = await read_frame(link.reader, pb.Contribution, max_payload=cap, timeout=timeout)
        if header.via_data_plane:
            if link.offer is None:
                into.excluded[link.peer] = "announced a data connection it was never offered"
                return
            try:
                link.direct = await asyncio.wait_for(asyncio.shield(link.offer), timeout)
            except TimeoutError:
                into.excluded[link.peer] = "announced a data connection that never arrived"
                return
            header, body = await link.direct.recv_frame(pb.Contribution, max_payload=cap, timeout=timeout)
        into.bytes += frame_bytes(header, len(body))
        problem = check_contribution(
            codec=header.codec,
            numel=header.numel,
            tokens=header.tokens,
            staleness=header.staleness,
            expect_codec=codec.name,
            expect_numel=numel,
            max_staleness=max_staleness,
        )
        if problem:
            into.excluded[link.peer] = problem
            return
        tensor = await asyncio.get_running_loop().run_in_executor(None, codec.decode, body, numel)
        into.tensors[link.peer] = tensor
        into.claims[link.peer] = (int(header.tokens), int(header.staleness))
    except WireError as exc:
        into.excluded[link.peer] = f"no contribution: {exc}"
    except CodecError as exc:
        into.excluded[link.peer] = f"malformed tensor: {exc}"


async def collect(links: dict[str, Link], *, codec: Codec, numel: int, max_staleness: int, timeout: float) -> Received:
    """Every member's contribution in parallel; a member still sending after `timeout` is excluded."""
    into = Received()

    async def one(link: Link) -> None:
        try:
            await asyncio.wait_for(
                receive_contribution(
                    link, codec=codec, numel=numel, max_staleness=max_staleness, timeout=timeout, into=into
                ),
                timeout,
            )
        except TimeoutError:
            into.excluded[link.peer] = f"no contribution within {timeout:.0f}s"

    await asyncio.gather(*(one(link) for link in links.values()))
    return into


async def broadcast(
    links: dict[str, Link], header: pb.RoundResult, payload: bytes | memoryview = b"", *, timeout: float
) -> int:
    """The same result frame to every member; returns the bytes delivered. A member that cannot be reached is
    logged and skipped: it finds itself behind and re-syncs to the committed state."""

    async def one(link: Link) -> int:
        try:
            return await link.send(header, payload, timeout=timeout)
        except WireError as exc:
            logger.info("could not deliver the round result to %s: %r (it will re-sync)", link.peer[-8:], exc)
            return 0

    return sum(await asyncio.gather(*(one(link) for link in links.values())))

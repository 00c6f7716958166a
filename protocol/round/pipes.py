"""The connections of a sharded round: one pipe per pair of contributors, and the routing of incoming ones.

Each pair of contributors shares one connection, used in both directions. The member earlier in the plan dials,
unless only the later one is behind NAT, which then dials out (`Plan.dials`). The dialer connects to the other's TCP
data plane, presenting the other's round token (which only the group learnt, through the leader's authenticated plan)
in a hello signed with the dialer's peer key, so the listener knows who dialled and nobody who read the token off the
path can pose as a member; when that fails, it opens a libp2p stream to it instead. A pipe ends with a bye in each
direction, so neither side closes while frames for the other are still in flight.
"""
from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import TypeVar

from google.protobuf.message import Message

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.records import PROTOCOL_VERSION
from swarmloco.protocol.base.text import short_id
from swarmloco.protocol.base.wire import WireError, close_writer, frame_bytes, read_frame, write_frame
from swarmloco.protocol.network.data_hello import signer_of
from swarmloco.protocol.network.data_plane import DataConn, DataPlane, connect
from swarmloco.protocol.network.transport import Transport
from swarmloco.protocol.round.groups import RoundAborted
from swarmloco.protocol.round.plans import Endpoint, Plan
from swarmloco.protocol.trust.identity import Identity

M = TypeVar("M", bound=Message)
_BYE_WAIT_S = 10.0  # at most this long, in the background, for the other side to confirm it has everything


class Pipe:
    """The connection between two contributors of one round: a TCP data connection or a libp2p stream."""

    def __init__(self, peer: str, *, conn: DataConn | None = None, reader: asyncio.StreamReader | None = None,
                 writer: asyncio.StreamWriter | None = None) -> None:
        self.peer, self.conn, self.reader, self.writer = peer, conn, reader, writer
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def direct(self) -> bool:
        return self.conn is not None

    async def send(self, header: Message, payload: bytes | bytearray | memoryview = b"", *, timeout: float) -> int:
        if self.conn is not None:
            await self.conn.send_frame(header, payload, timeout=timeout)
        else:
            assert self.writer is not None
            await write_frame(self.writer, header, payload, timeout=timeout)
        return frame_bytes(header, len(payload))

    async def recv(self, header_type: type[M], *, max_payload: int, timeout: float,
                   into: memoryview | None = None) -> tuple[M, bytearray | memoryview]:
        """One frame. With `into`, a TCP pipe reads the payload straight into the start of it (and refuses one
        longer); a libp2p stream returns its own buffer either way."""
        if self.conn is not None:
            return await self.conn.recv_frame(header_type, max_payload=max_payload, timeout=timeout, into=into)
        assert self.reader is not None
        return await read_frame(self.reader, header_type, max_payload=max_payload, timeout=timeout)

    async def finish(self, round_number: int, *, timeout: float = _BYE_WAIT_S) -> None:
        """Say we have everything, wait (bounded) until the other side says so too, and close."""
        with contextlib.suppress(WireError, TimeoutError):
            await self.send(pb.ShardBye(round=round_number), timeout=timeout)
            await self.recv(pb.ShardBye, max_payload=0, timeout=timeout)
        self.close()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.writer is not None:
            close_writer(self.writer)
        if not self.finished.done():
            self.finished.set_result(None)


class Inbox:
    """This member's end of one round's shard connections: the pipes the other members open to it."""

    def __init__(self, round_number: int, token: str, *, max_pipes: int) -> None:
        self.round, self.token, self.max_pipes = round_number, token, max_pipes
        self.expected: set[str] | None = None  # once the plan is known, only these senders are kept
        self._pipes: dict[str, asyncio.Future[Pipe]] = {}
        self._taken: set[str] = set()
        self.closed = False

    def _slot(self, peer: str) -> asyncio.Future[Pipe]:
        if peer not in self._pipes:
            self._pipes[peer] = asyncio.get_running_loop().create_future()
        return self._pipes[peer]

    def offer(self, pipe: Pipe) -> bool:
        """Keep an incoming pipe; False (and closed) when it is unexpected, a duplicate, or one too many."""
        unexpected = self.expected is not None and pipe.peer not in self.expected
        full = pipe.peer not in self._pipes and len(self._pipes) >= self.max_pipes
        if self.closed or unexpected or full or self._slot(pipe.peer).done():
            pipe.close()
            return False
        self._slot(pipe.peer).set_result(pipe)
        return True

    def expect(self, senders: set[str]) -> None:
        self.expected = senders
        for peer in [p for p in self._pipes if p not in senders]:
            slot = self._pipes.pop(peer)
            if slot.done():
                slot.result().close()

    async def pipe(self, peer: str, *, timeout: float) -> Pipe:
        """The pipe `peer` opened to us; from here on the caller owns it."""
        pipe = await asyncio.wait_for(asyncio.shield(self._slot(peer)), timeout)
        self._taken.add(peer)
        return pipe

    def close(self) -> None:
        """No more pipes: those nobody took are closed (the ones taken close with their exchange)."""
        self.closed = True
        for peer, slot in self._pipes.items():
            if not slot.done():
                slot.cancel()
            elif peer not in self._taken:
                slot.result().close()


class ShardRouter:
    """Routes incoming shard connections (TCP hellos and libp2p streams) to the inbox of their round."""

    def __init__(self, transport: Transport, data_plane: DataPlane | None, *, max_group: int,
                 control_timeout: float, identity: Identity | None = None) -> None:
        self.transport, self.data_plane = transport, data_plane
        self.identity = identity or signer_of(transport)  # signs our TCP hellos; without one we dial libp2p only
        self.max_group, self.control_timeout = max_group, control_timeout
        self.handler_name = f"swarmloco/{transport.run_id}/shard/v{PROTOCOL_VERSION}"
        self._inboxes: dict[str, Inbox] = {}

    async def register(self) -> None:
        await self.transport.add_handler(self.handler_name, self._handle_stream)

    def open(self, round_number: int) -> Inbox:
        inbox = Inbox(round_number, secrets.token_hex(16), max_pipes=self.max_group)
        self._inboxes[inbox.token] = inbox
        if self.data_plane is not None:
            self.data_plane.listen(inbox.token, lambda conn, hello: self._on_tcp(inbox, conn, hello),
                                   me=self.transport.peer_id, run_id=self.transport.run_id)
        return inbox

    def endpoint(self, inbox: Inbox) -> Endpoint:
        addrs = tuple(self.data_plane.addrs) if self.data_plane is not None else ()
        return Endpoint(addrs, inbox.token, dials_out=not self.transport.reachable)

    def close(self, inbox: Inbox) -> None:
        self._inboxes.pop(inbox.token, None)
        if self.data_plane is not None:
            self.data_plane.forget(inbox.token)
        inbox.close()

    def _on_tcp(self, inbox: Inbox, conn: DataConn, hello: pb.DataHello) -> None:
        """A connection whose hello the data plane proved to be signed by `hello.sender`, to us, for this run."""
        if hello.round != inbox.round or not hello.sender:
            conn.close()
            return
        inbox.offer(Pipe(hello.sender, conn=conn))

    async def _handle_stream(self, caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello, _ = await read_frame(reader, pb.ShardHello, max_payload=0, timeout=self.control_timeout)
        except WireError:
            close_writer(writer)
            return
        inbox = self._inboxes.get(hello.token)
        if inbox is None or hello.round != inbox.round:
            close_writer(writer)
            return
        pipe = Pipe(caller, reader=reader, writer=writer)
        if inbox.offer(pipe):
            await pipe.finished  # the stream lives as long as the pipe: returning would close it

    async def dial(self, peer: str, endpoint: Endpoint, round_number: int, *, timeout: float,
                   use_tcp: bool) -> Pipe:
        """A pipe to a later member: its TCP data plane when reachable, else a libp2p stream. Raises WireError."""
        if use_tcp and endpoint.addrs and self.identity is not None:
            conn = await connect(list(endpoint.addrs), endpoint.token, timeout=min(3.0, timeout),
                                 round_number=round_number, identity=self.identity, receiver=peer,
                                 run_id=self.transport.run_id)
            if conn is not None:
                return Pipe(peer, conn=conn)
        try:
            reader, writer = await self.transport.open_stream(peer, self.handler_name, timeout=timeout)
        except Exception as exc:  # whatever keeps us from a member means: no pipe to it
            raise WireError(f"cannot reach {short_id(peer)}: {exc!r}") from exc
        pipe = Pipe(peer, reader=reader, writer=writer)
        try:
            await pipe.send(pb.ShardHello(token=endpoint.token, round=round_number), timeout=timeout)
        except WireError:
            pipe.close()
            raise
        return pipe

    async def open_pipes(self, plan: Plan, k: int, inbox: Inbox, *, timeout: float, use_tcp: bool) -> dict[str, Pipe]:
        """A pipe to every other contributor of the plan, by peer, for member k: dialled where `plan.dials` says we
        open it, taken from `inbox` where the other does. Raises RoundAborted, blaming one of them, when any pipe
        fails to open within `timeout` (those that did open are closed)."""

        async def one(i: int) -> tuple[str, Pipe]:
            peer = plan.members[i]
            if plan.dials(k, i):
                return peer, await self.dial(peer, plan.endpoints[i], plan.round, timeout=timeout, use_tcp=use_tcp)
            return peer, await inbox.pipe(peer, timeout=timeout)

        pipes: dict[str, Pipe] = {}
        others = [i for i in range(len(plan.members)) if i != k]
        results = await asyncio.gather(*(one(i) for i in others), return_exceptions=True)
        failed: dict[str, str] = {}
        for i, r in zip(others, results, strict=True):
            if isinstance(r, BaseException):
                failed[plan.members[i]] = f"{short_id(plan.members[i])} ({type(r).__name__})"
            else:
                pipes[r[0]] = r[1]
        if failed:
            for pipe in pipes.values():
                pipe.close()
            raise RoundAborted(f"no shard connection to {', '.join(failed.values())}", blame=next(iter(failed)))
        return pipes

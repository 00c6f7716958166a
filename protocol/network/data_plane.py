"""A direct TCP data plane for the bulk bytes of a round and of state downloads, beside libp2p.

libp2p (through the p2pd daemon) stays the control channel: it authenticates peers, traverses NAT and carries the
join/close handshake. Secrets for the data plane are handed out only over those authenticated streams: in a round,
each member's token for its shard connections reaches the other members through the leader; a donor hands a
joiner a one-time token. A peer that can reach the advertised TCP address opens a plain connection and sends a
hello with the token, signed with its peer key and addressed to the listener (`swarmloco.protocol.network.data_hello`);
one that cannot falls back to a libp2p stream. The hello is read on the event loop, bounded in time and in number of
handshakes pending, so strangers that connect and say nothing cost no thread. The TCP bytes after the hello are
neither encrypted nor authenticated here (payloads carry their own signatures): pass `--no-data-plane` on networks
you do not trust.

The bulk bytes bypass the event loop: a data connection is a plain blocking socket driven from a thread pool,
so the kernel copies a payload straight from the sender's tensor into the receiver's buffer (`sendall` of a
memoryview, `recv_into`). Through asyncio streams the same 100 MiB cost ~2.5x longer on loopback (three extra
copies through the transport's buffers). Frames are those of `swarmloco.protocol.base.wire`, with the same caps
and deadlines.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.message import Message

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.buffers import large_buffer
from swarmloco.protocol.base.text import short_id
from swarmloco.protocol.base.wire import (
    HEADER_LEN,
    PAYLOAD_LEN,
    WireError,
    frame_prefix,
    header_length,
    parse_header,
    payload_length,
)
from swarmloco.protocol.network.data_hello import (
    HandshakeLimits,
    PendingHandshakes,
    ReplayGuard,
    hello_problem,
    read_hello,
    signed_hello,
)
from swarmloco.protocol.trust.identity import Identity

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
R = TypeVar("R")
_CHUNK = 16 << 20  # bytes per send/recv call: the deadline is re-checked between calls
# Every blocking socket call of an established data connection runs here (handshakes never do), never in the loop's
# default executor (which decodes tensors): a group of many members must not starve the codec, nor the codec the
# sockets. In a sharded round a member sends to and receives from every other member at once (2 (N - 1) blocking
# calls); a pool smaller than that could fill with sends whose receivers are all queued behind their own sends, so
# it is sized for 64 members.
_IO = ThreadPoolExecutor(max_workers=160, thread_name_prefix="swarmloco-data")


def hosts_from_maddrs(maddrs: list[str]) -> list[str]:
    """IPv4 hosts of /ip4/<host>/tcp/... multiaddrs, unspecified addresses dropped, order kept."""
    hosts: list[str] = []
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] == "ip4" and parts[2] not in ("0.0.0.0", "") and parts[2] not in hosts:
            hosts.append(parts[2])
    return hosts


class DataConn:
    """One direct TCP connection of a round. Awaitable frame I/O; the blocking calls run on the data-plane pool."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.closed = False

    async def send_frame(
        self, header: Message, payload: bytes | bytearray | memoryview = b"", *, timeout: float
    ) -> None:
        prefix = frame_prefix(header, len(payload))
        await self._run(
            f"sending {type(header).__name__}", self._send_all, [prefix, payload], time.monotonic() + timeout
        )

    async def send_headers(self, headers: list[Message], *, timeout: float) -> None:
        """Several payload-less frames in one write (one pool hop for all of them)."""
        parts: list[bytes | bytearray | memoryview] = [frame_prefix(h, 0) for h in headers]
        await self._run(f"sending {len(headers)} frames", self._send_all, parts, time.monotonic() + timeout)

    async def recv_frame(self, header_type: type[M], *, max_payload: int, timeout: float,
                         into: memoryview | None = None) -> tuple[M, bytearray | memoryview]:
        """One frame; the payload is a writable bytearray, filled in place by the kernel, or with `into` the start of
        `into` itself (a payload longer than `into` is refused like one over `max_payload`)."""
        deadline = time.monotonic() + timeout
        limit = max_payload if into is None else min(max_payload, len(into))
        raw, payload = await self._run(f"reading {header_type.__name__}", self._recv_frame, limit, deadline, into)
        return parse_header(header_type, raw), payload

    async def read_eof(self, *, timeout: float) -> None:
        """Wait until the peer closes its end (or the deadline); anything it sends meanwhile is discarded."""
        await self._run("waiting for the end of stream", self._recv_eof, time.monotonic() + timeout)

    def close(self) -> None:
        """Idempotent. Wakes a pool thread still blocked on this socket; bytes already sent are still delivered."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    # --- blocking halves (pool threads) ---------------------------------------------------------------------------
    async def _run(self, what: str, fn: Callable[..., R], *args: Any) -> R:
        try:
            return await asyncio.get_running_loop().run_in_executor(_IO, fn, *args)
        except WireError:
            raise
        except (OSError, ValueError) as exc:  # socket.timeout is an OSError; ValueError: used after close
            raise WireError(f"data connection: {what} failed: {exc!r}") from exc

    def _remaining(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WireError("data connection: deadline passed")
        return left

    def _send_all(self, parts: list[bytes | bytearray | memoryview], deadline: float) -> None:
        for part in parts:
            view = memoryview(part).cast("B")
            sent = 0
            while sent < len(view):
                self.sock.settimeout(self._remaining(deadline))
                sent += self.sock.send(view[sent : sent + _CHUNK])

    def _recv_into(self, view: memoryview, deadline: float) -> None:
        got = 0
        while got < len(view):
            self.sock.settimeout(self._remaining(deadline))
            n = self.sock.recv_into(view[got:], min(len(view) - got, _CHUNK))
            if n == 0:
                raise WireError(f"data connection: stream ended after {got} of {len(view)} bytes")
            got += n

    def _recv_exact(self, size: int, deadline: float) -> bytearray:
        out = bytearray(size)
        self._recv_into(memoryview(out), deadline)
        return out

    def _recv_frame(self, max_payload: int, deadline: float,
                    into: memoryview | None = None) -> tuple[bytearray, bytearray | memoryview]:
        raw = self._recv_exact(header_length(bytes(self._recv_exact(HEADER_LEN.size, deadline))), deadline)
        size = payload_length(bytes(self._recv_exact(PAYLOAD_LEN.size, deadline)), max_payload)
        if into is None:  # (a large payload lands in memory a buffer now gone used before: no page faults)
            payload = large_buffer(size)
            self._recv_into(memoryview(payload), deadline)
            return raw, payload
        self._recv_into(into[:size], deadline)
        return raw, into[:size]

    def _recv_eof(self, deadline: float) -> None:
        while True:
            self.sock.settimeout(self._remaining(deadline))
            if not self.sock.recv(1 << 16):
                return


Listener = Callable[[DataConn, pb.DataHello], None]


@dataclass
class _Route:
    """What a token admits: hellos addressed to `me` in `run_id`, signed by `sender` (any signer when empty)."""

    replay: ReplayGuard
    me: str = ""
    run_id: str = ""
    sender: str = ""
    listener: Listener | None = None
    future: asyncio.Future[DataConn] | None = None


@dataclass
class DataPlane:
    bind_host: str
    advertise_hosts: list[str]
    port: int = 0
    limits: HandshakeLimits = field(default_factory=HandshakeLimits)
    _listener: socket.socket | None = None
    _accepting: asyncio.Task[None] | None = None
    _routes: dict[str, _Route] = field(default_factory=dict)
    _pending: PendingHandshakes | None = None
    refused: int = 0  # hellos that arrived whole but were refused (unknown token, bad signature, replay, ...)

    async def start(self) -> None:
        listener = socket.create_server((self.bind_host, 0), backlog=128)
        listener.setblocking(False)
        self._listener, self.port = listener, listener.getsockname()[1]
        self._pending = PendingHandshakes(self.limits)
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop())

    @property
    def addrs(self) -> list[str]:
        return [f"{host}:{self.port}" for host in self.advertise_hosts] if self._listener is not None else []

    @property
    def pending(self) -> int:
        """Handshakes in progress now (for tests of the bounds)."""
        return len(self._pending) if self._pending is not None else 0

    def expect(self, *, me: str = "", run_id: str = "", sender: str = "") -> tuple[str, asyncio.Future[DataConn]]:
        """A fresh one-time token and the future its connection will resolve: the first hello that presents it,
        signed (by `sender` when given), addressed to `me` in `run_id` (each checked when given)."""
        token = secrets.token_hex(16)
        future: asyncio.Future[DataConn] = asyncio.get_running_loop().create_future()
        self._routes[token] = _Route(ReplayGuard(1), me, run_id, sender, future=future)
        return token, future

    def listen(self, token: str, on_connection: Listener, *, me: str = "", run_id: str = "") -> None:
        """Hand every connection whose signed hello presents `token` (addressed to `me` in `run_id`, each checked
        when given) to `on_connection`, with the hello, until forgotten. The listener owns the connection from
        then on (and closes the ones it does not want); the hello's sender is proven, its round is not checked."""
        self._routes[token] = _Route(ReplayGuard(self.limits.nonces_per_token), me, run_id, listener=on_connection)

    def forget(self, token: str) -> None:
        route = self._routes.pop(token, None)
        if route is not None and route.future is not None and not route.future.done():
            route.future.cancel()

    async def _accept_loop(self) -> None:
        assert self._listener is not None and self._pending is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(self._listener)
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # e.g. out of file descriptors: keep serving once it passes
                logger.warning("data plane accept failed: %r", exc)
                await asyncio.sleep(0.5)
                continue
            sock.setblocking(False)
            task = loop.create_task(self._handshake(sock))
            self._pending.add(task, str(addr[0]))  # may cancel the oldest pending handshakes to make room
            task.add_done_callback(self._pending.done)
            # A handshake cancelled before it ever ran cannot close its socket itself.
            task.add_done_callback(lambda t, s=sock: s.close() if t.cancelled() else None)

    async def _handshake(self, sock: socket.socket) -> None:
        """On the loop: the whole hello within the deadline, then the route's checks; only then a `DataConn`."""
        try:
            hello = await read_hello(sock, deadline_s=self.limits.deadline_s)
        except WireError:
            sock.close()
            return
        except asyncio.CancelledError:  # evicted to make room, or the plane is closing
            sock.close()
            raise
        route = self._routes.get(hello.token)
        problem = "unknown or used token" if route is None else (
            hello_problem(hello, me=route.me, run_id=route.run_id, sender=route.sender,
                          freshness_s=self.limits.freshness_s) or route.replay.admit(bytes(hello.nonce)))
        if problem or route is None:
            self.refused += 1
            logger.debug("data plane refused a hello from %s: %s", short_id(hello.sender), problem)
            sock.close()
            return
        conn = DataConn(sock)
        if route.listener is not None:
            route.listener(conn, hello)
            return
        self._routes.pop(hello.token, None)
        if route.future is None or route.future.done():
            conn.close()
            return
        route.future.set_result(conn)

    async def close(self) -> None:
        for token in list(self._routes):
            self.forget(token)
        if self._pending is not None:
            self._pending.cancel_all()
        if self._accepting is not None:
            self._accepting.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None


async def connect(addrs: list[str], token: str, *, timeout: float = 3.0, sender: str = "", round_number: int = 0,
                  identity: Identity | None = None, receiver: str = "", run_id: str = "") -> DataConn | None:
    """Open a data connection to the first reachable address and send a hello, signed with `identity` and
    addressed to `receiver` (a hello without `identity` is unsigned, and refused by every current listener).
    None when no address takes it (use libp2p instead). Connect and hello run on the loop, each within
    `timeout`; only IP literals are dialled (an address list is not trusted to make us resolve names)."""
    loop = asyncio.get_running_loop()
    for addr in addrs:
        host, _, port = addr.rpartition(":")
        sock = None
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
            sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, (str(ip), int(port)))
                hello = signed_hello(identity, token=token, receiver=receiver, run_id=run_id,
                                     round_number=round_number, sender=sender)
                await loop.sock_sendall(sock, frame_prefix(hello, 0))
        except (OSError, ValueError, TimeoutError) as exc:
            if sock is not None:
                sock.close()
            logger.debug("data plane %s unreachable or refused the hello: %r", addr, exc)
            continue
        return DataConn(sock)
    return None

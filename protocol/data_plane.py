"""A direct TCP data plane for the bulk bytes of a round and of state downloads, beside libp2p.

libp2p (through the p2pd daemon) stays the control channel: it authenticates peers, traverses NAT and carries the
join/close handshake. Secrets for the data plane are handed out only over those authenticated streams: in a round,
each member's token for its shard connections reaches the other members through the leader; a donor hands a
joiner a one-time token. A peer that can reach the advertised TCP address opens a plain connection and presents
the token; one that cannot falls back to a libp2p stream. The TCP bytes are not encrypted: pass `--no-data-plane`
on networks you do not trust.

The bulk bytes bypass the event loop: a data connection is a plain blocking socket driven from a thread pool,
so the kernel copies a payload straight from the sender's tensor into the receiver's buffer (`sendall` of a
memoryview, `recv_into`). Through asyncio streams the same 100 MiB cost ~2.5x longer on loopback (three extra
copies through the transport's buffers). Frames are those of `protocol.wire`, with the same caps and deadlines.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.message import Message

from protocol import swarmloco_wire_pb2 as pb
from protocol.wire import (
    HEADER_LEN,
    PAYLOAD_LEN,
    WireError,
    frame_prefix,
    header_length,
    parse_header,
    payload_length,
)

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
R = TypeVar("R")
_CHUNK = 16 << 20  # bytes per send/recv call: the deadline is re-checked between calls
_HELLO_TIMEOUT_S = 5.0
# Every blocking socket call of the data plane runs here, never in the loop's default executor (which decodes
# tensors): a group of many members must not starve the codec, nor the codec the sockets. In a sharded round a
# member sends to and receives from every other member at once (2 (N - 1) blocking calls); a pool smaller than that
# could fill with sends whose receivers are all queued behind their own sends, so it is sized for 64 members.
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

    async def recv_frame(self, header_type: type[M], *, max_payload: int, timeout: float) -> tuple[M, bytearray]:
        """One frame; the payload is a writable bytearray, filled in place by the kernel."""
        deadline = time.monotonic() + timeout
        raw, payload = await self._run(f"reading {header_type.__name__}", self._recv_frame, max_payload, deadline)
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

    def _recv_frame(self, max_payload: int, deadline: float) -> tuple[bytearray, bytearray]:
        raw = self._recv_exact(header_length(bytes(self._recv_exact(HEADER_LEN.size, deadline))), deadline)
        payload = self._recv_exact(
            payload_length(bytes(self._recv_exact(PAYLOAD_LEN.size, deadline)), max_payload), deadline
        )
        return raw, payload

    def _recv_eof(self, deadline: float) -> None:
        while True:
            self.sock.settimeout(self._remaining(deadline))
            if not self.sock.recv(1 << 16):
                return


Listener = Callable[[DataConn, pb.DataHello], None]


@dataclass
class DataPlane:
    bind_host: str
    advertise_hosts: list[str]
    port: int = 0
    _listener: socket.socket | None = None
    _accepting: asyncio.Task[None] | None = None
    _expected: dict[str, asyncio.Future[DataConn]] = field(default_factory=dict)
    _listeners: dict[str, Listener] = field(default_factory=dict)
    _handshakes: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> None:
        listener = socket.create_server((self.bind_host, 0), backlog=128)
        listener.setblocking(False)
        self._listener, self.port = listener, listener.getsockname()[1]
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop())

    @property
    def addrs(self) -> list[str]:
        return [f"{host}:{self.port}" for host in self.advertise_hosts] if self._listener is not None else []

    def expect(self) -> tuple[str, asyncio.Future[DataConn]]:
        """A fresh one-time token and the future its connection will resolve."""
        token = secrets.token_hex(16)
        future: asyncio.Future[DataConn] = asyncio.get_running_loop().create_future()
        self._expected[token] = future
        return token, future

    def listen(self, token: str, on_connection: Listener) -> None:
        """Hand every connection whose hello presents `token` to `on_connection` (with the hello), until forgotten.
        The listener owns the connection from then on (and closes the ones it does not want)."""
        self._listeners[token] = on_connection

    def forget(self, token: str) -> None:
        self._listeners.pop(token, None)
        future = self._expected.pop(token, None)
        if future is not None and not future.done():
            future.cancel()

    async def _accept_loop(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # e.g. out of file descriptors: keep serving once it passes
                logger.warning("data plane accept failed: %r", exc)
                await asyncio.sleep(0.5)
                continue
            task = loop.create_task(self._handshake(DataConn(sock)))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: DataConn) -> None:
        try:
            hello, _ = await conn.recv_frame(pb.DataHello, max_payload=0, timeout=_HELLO_TIMEOUT_S)
        except WireError:
            conn.close()
            return
        except asyncio.CancelledError:
            conn.close()
            raise
        listener = self._listeners.get(hello.token)
        if listener is not None:
            listener(conn, hello)
            return
        future = self._expected.pop(hello.token, None)
        if future is None or future.done():
            conn.close()  # unknown or reused token: not ours to serve
            return
        future.set_result(conn)

    async def close(self) -> None:
        for token in list(self._expected):
            self.forget(token)
        for task in [self._accepting, *self._handshakes]:
            if task is not None:
                task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None


async def connect(addrs: list[str], token: str, *, timeout: float = 3.0, sender: str = "",
                  round_number: int = 0) -> DataConn | None:
    """Open a data connection to the first reachable address; None when none is (use libp2p instead)."""
    loop = asyncio.get_running_loop()
    for addr in addrs:
        host, _, port = addr.rpartition(":")
        try:
            sock = await loop.run_in_executor(
                _IO, functools.partial(socket.create_connection, (host, int(port)), timeout)
            )
        except (OSError, ValueError) as exc:
            logger.debug("data plane %s unreachable: %r", addr, exc)
            continue
        conn = DataConn(sock)
        try:
            await conn.send_frame(pb.DataHello(token=token, sender=sender, round=round_number), timeout=timeout)
            return conn
        except WireError as exc:
            conn.close()
            logger.debug("data plane %s refused the hello: %r", addr, exc)
    return None

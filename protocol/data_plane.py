"""A direct TCP data plane for the bulk tensors of a round, beside libp2p.

libp2p (through the p2pd daemon) stays the control channel: it authenticates peers, traverses NAT and carries the
join/close handshake. When a leader closes a group it hands each member, over that authenticated stream, the
leader's TCP addresses and a one-time token. A member that can reach one of them opens a plain TCP connection,
presents the token, and moves its pseudo-gradient (and receives the average) there; a member that cannot falls
back to the libp2p stream. The TCP bytes are not encrypted: pass `--no-data-plane` on networks you do not trust.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field

from protocol import swarmloco_wire_pb2 as pb
from protocol.wire import WireError, close_writer, read_frame, write_frame

logger = logging.getLogger(__name__)
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def hosts_from_maddrs(maddrs: list[str]) -> list[str]:
    """IPv4 hosts of /ip4/<host>/tcp/... multiaddrs, unspecified addresses dropped, order kept."""
    hosts: list[str] = []
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] == "ip4" and parts[2] not in ("0.0.0.0", "") and parts[2] not in hosts:
            hosts.append(parts[2])
    return hosts


@dataclass
class DataPlane:
    bind_host: str
    advertise_hosts: list[str]
    port: int = 0
    _server: asyncio.base_events.Server | None = None
    _expected: dict[str, asyncio.Future[Stream]] = field(default_factory=dict)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, host=self.bind_host, port=0, limit=1 << 22)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def addrs(self) -> list[str]:
        return [f"{host}:{self.port}" for host in self.advertise_hosts] if self._server is not None else []

    def expect(self) -> tuple[str, asyncio.Future[Stream]]:
        """A fresh one-time token and the future its connection will resolve."""
        token = secrets.token_hex(16)
        future: asyncio.Future[Stream] = asyncio.get_running_loop().create_future()
        self._expected[token] = future
        return token, future

    def forget(self, token: str) -> None:
        future = self._expected.pop(token, None)
        if future is not None and not future.done():
            future.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello, _ = await read_frame(reader, pb.DataHello, max_payload=0, timeout=5)
        except WireError:
            close_writer(writer)
            return
        future = self._expected.pop(hello.token, None)
        if future is None or future.done():
            close_writer(writer)  # unknown or reused token: not ours to serve
            return
        future.set_result((reader, writer))

    async def close(self) -> None:
        for token in list(self._expected):
            self.forget(token)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def connect(addrs: list[str], token: str, *, timeout: float = 3.0) -> Stream | None:
    """Open a data connection to the first reachable address; None when none is (use libp2p instead)."""
    for addr in addrs:
        host, _, port = addr.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port), limit=1 << 22), timeout)
            await write_frame(writer, pb.DataHello(token=token), timeout=timeout)
            return reader, writer
        except (OSError, ValueError, asyncio.TimeoutError, WireError) as exc:
            logger.debug("data plane %s unreachable: %r", addr, exc)
    return None

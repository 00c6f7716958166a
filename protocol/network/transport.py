"""What a round needs from the network, as one small interface with two implementations.

`swarmloco.protocol.network.node.SwarmNode` is the real one (hivemind's DHT and libp2p streams through p2pd);
`swarmloco.protocol.testing.fake` is an in-memory one on which matchmaking and the exchange are unit-tested in
milliseconds: splits, merges, deaths mid-exchange and silent members, without a daemon.

Threading: a transport owns one asyncio loop on a background thread. Coroutines of the round run there; the
training thread hands them over with `submit` / `call`, and changes the peer's record with `update_record`, which
is applied on the loop thread only (the record has one writer, so no update is ever lost to a race).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from swarmloco.protocol.base.clock import Clock
from swarmloco.protocol.base.records import PeerRecord

T = TypeVar("T")
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
StreamHandler = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Transport(Protocol):
    @property
    def peer_id(self) -> str: ...

    @property
    def run_id(self) -> str: ...

    loop: asyncio.AbstractEventLoop
    clock: Clock  # what deadlines and view ends are read from (`swarmloco.protocol.base.clock`)
    reachable: bool  # whether other peers can dial this one; False behind NAT (--client-mode): see `update_record`

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coro` on the transport's loop; thread-safe."""
        ...

    def call(self, coro: Coroutine[Any, Any, T], *, timeout: float) -> T:
        """Run `coro` on the loop and wait for its result; cancels it and raises TimeoutError past `timeout`."""
        ...

    async def add_handler(self, name: str, handler: StreamHandler) -> None:
        """Serve protocol `name`: `handler(caller_peer_id, reader, writer)` runs for every incoming stream."""
        ...

    async def open_stream(self, peer_id: str, name: str, *, timeout: float) -> Stream:
        """A stream to `peer_id`'s handler for `name`; raises on failure (unreachable, no such handler)."""
        ...

    async def fetch_records(self, *, timeout: float) -> dict[str, PeerRecord]:
        """The live, well-formed records of every *other* peer of this run (ours is never included)."""
        ...

    def update_record(self, **changes: Any) -> None:
        """Change fields of this peer's record (all fields, the first time) and publish it; thread-safe. The
        record's `reachable` is always the transport's own."""
        ...

    def own_record(self) -> PeerRecord | None:
        """This peer's record with every change made so far (None before the first); read on the loop thread."""
        ...

    def data_plane_hosts(self) -> tuple[str, list[str]] | None:
        """(bind host, advertised hosts) for the direct TCP data plane, or None when it is off."""
        ...


def run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], *, timeout: float) -> T:
    """Run `coro` on `loop` (another thread's) and wait for its result; past `timeout` it is cancelled there and
    TimeoutError raised here. The one implementation of `Transport.call`."""
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise

"""An in-memory `Transport`: many fake peers on one asyncio loop, streams as in-process pipes, records in a dict.

Round logic runs on it unchanged, so matchmaking and the exchange are tested in milliseconds and deterministically:
`partition` hides records from some peers (as DHT reads at different moments do), `kill` makes a peer vanish
mid-round (its streams break, its record and handlers disappear), and a test can serve its own stream handler to
play a silent or hostile peer. Its loop runs on a virtual clock (`virtual_time`) unless told otherwise: timeouts
expire when every peer has waited for them, however busy the machine is.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from swarmloco.protocol.base.clock import SYSTEM, Clock
from swarmloco.protocol.base.records import PeerRecord
from swarmloco.protocol.network.transport import Stream, StreamHandler, run_on
from swarmloco.protocol.testing.virtual_time import DrivingPool, ParkingFuture, VirtualClock, VirtualLoop
from swarmloco.protocol.trust.admission import Credentials
from swarmloco.protocol.trust.identity import Identity

T = TypeVar("T")


class _PipeEnd:
    """The writing half of one direction of a fake stream; `close` (or the peer's death) delivers EOF."""

    def __init__(self, net: FakeNetwork, owner: str, sink: asyncio.StreamReader) -> None:
        self.net, self.owner, self.sink = net, owner, sink
        self.closed = False
        self.broken = False  # the owner died: writes towards it fail, like a reset connection
        self.other: _PipeEnd | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.closed or (self.other is not None and self.other.broken):
            raise ConnectionResetError("fake stream closed")
        self.sink.feed_data(bytes(data))

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("fake stream closed")
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sink.feed_eof()

    def is_closing(self) -> bool:
        return self.closed


class FakeNetwork:
    """Owns the loop thread shared by every fake peer; use as a context manager (the thread that enters it drives
    the peers: see `virtual_time`). `virtual=False`: the machine's clock instead."""

    def __init__(self, *, virtual: bool = True) -> None:
        self.virtual: VirtualClock | None = VirtualClock() if virtual else None
        self.clock: Clock = self.virtual or SYSTEM
        self.loop = VirtualLoop(self.virtual) if self.virtual else asyncio.new_event_loop()
        self._driving: contextlib.ExitStack | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-net", daemon=True)
        self._thread.start()
        self.records: dict[str, PeerRecord] = {}
        self.handlers: dict[tuple[str, str], StreamHandler] = {}
        self.dead: set[str] = set()
        self.unreachable: set[str] = set()  # peers behind NAT
        self.visible: dict[str, set[str]] = {}  # peer -> the peers whose records it can see (absent: all)
        self._ends: list[_PipeEnd] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def __enter__(self) -> FakeNetwork:
        if self.virtual is not None:
            self._driving = contextlib.ExitStack()
            self._driving.enter_context(self.virtual.drive())
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- waiting, for the threads that drive the peers (on the virtual clock, these let time pass) ---------------
    def sleep(self, seconds: float) -> None:
        """Let the peers run for `seconds`."""
        if self.virtual is not None:
            self.virtual.sleep(seconds)
        else:
            time.sleep(seconds)

    def until(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Let the peers run until `condition()` holds (True) or `timeout` passes (False), looking every 10 ms."""
        deadline = self.clock.monotonic() + timeout
        while not condition():
            if self.clock.monotonic() >= deadline:
                return False
            self.sleep(0.01)
        return True

    def pool(self, workers: int) -> concurrent.futures.Executor:
        """Threads to drive peers from (each peer's own, as a training thread is)."""
        if self.virtual is not None:
            return DrivingPool(self.virtual, workers)
        return concurrent.futures.ThreadPoolExecutor(workers)

    def peer(self, *, run_id: str = "fake-run", reachable: bool = True) -> FakeTransport:
        """A new peer with a real Ed25519 identity (its peer id is the key's), so it signs like a real one.
        `reachable=False`: behind NAT; it opens streams, and nobody can open one to it."""
        transport = FakeTransport(self, Identity(path=Path("<memory>"), private_key=Identity.generate()), run_id)
        if not reachable:
            self.unreachable.add(transport.peer_id)
        return transport

    def partition(self, *groups: set[str]) -> None:
        """Each peer sees only the records of its own group (and streams still connect: it is a view split)."""
        self.visible = {p: set(g) for g in groups for p in g}

    def heal(self) -> None:
        self.visible = {}

    def kill(self, peer_id: str) -> None:
        """The peer vanishes: its record and handlers go, every stream it holds breaks. Thread-safe."""
        self.call(self._kill(peer_id), timeout=5)

    async def _kill(self, peer_id: str) -> None:
        self.dead.add(peer_id)
        self.records.pop(peer_id, None)
        for key in [k for k in self.handlers if k[0] == peer_id]:
            del self.handlers[key]
        for end in self._ends:
            if end.owner == peer_id:
                end.broken = True
                end.close()
                if end.other is not None:
                    end.other.close()

    def call(self, coro: Coroutine[Any, Any, T], *, timeout: float) -> T:
        if self.virtual is None:
            return run_on(self.loop, coro, timeout=timeout)
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop)
        self.virtual.wait(future, None)
        return future.result(0)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future if self.virtual is None else ParkingFuture(self.virtual, future)

    def close(self) -> None:
        if self._driving is not None:  # stop driving first, so that what the cancelled tasks do as they end may run
            self._driving.close()
            self._driving = None

        async def stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        if self.virtual is not None and not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()  # and its executor's threads

    async def _connect(self, caller: str, callee: str, name: str) -> Stream:
        handler = self.handlers.get((callee, name))
        if handler is None or callee in self.dead or caller in self.dead:
            raise ConnectionRefusedError(f"{callee} does not serve {name}")
        if callee in self.unreachable:
            raise ConnectionRefusedError(f"{callee} is behind NAT: nobody can dial it")
        to_callee, to_caller = asyncio.StreamReader(), asyncio.StreamReader()
        caller_end, callee_end = _PipeEnd(self, caller, to_callee), _PipeEnd(self, callee, to_caller)
        caller_end.other, callee_end.other = callee_end, caller_end
        self._ends += [caller_end, callee_end]
        task = self.loop.create_task(self._serve(handler, caller, to_callee, callee_end))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return to_caller, caller_end  # type: ignore[return-value]

    @staticmethod
    async def _serve(handler: StreamHandler, caller: str, reader: asyncio.StreamReader, end: _PipeEnd) -> None:
        try:
            await handler(caller, reader, end)  # type: ignore[arg-type]
        finally:
            end.close()


class FakeTransport:
    def __init__(self, net: FakeNetwork, identity: Identity, run_id: str) -> None:
        self.net, self._peer_id, self._run_id = net, identity.peer_id, run_id
        self.credentials = Credentials(identity)  # no ticket: fake peers form a private swarm unless a test says so
        self.loop = net.loop
        self.clock = net.clock

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def reachable(self) -> bool:
        """False behind NAT (`FakeNetwork.peer(reachable=False)`): the network refuses every stream opened to us."""
        return self._peer_id not in self.net.unreachable

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return self.net.submit(coro)

    def call(self, coro: Coroutine[Any, Any, T], *, timeout: float) -> T:
        return self.net.call(coro, timeout=timeout)

    async def add_handler(self, name: str, handler: StreamHandler) -> None:
        self.net.handlers[(self._peer_id, name)] = handler

    async def open_stream(self, peer_id: str, name: str, *, timeout: float) -> Stream:
        return await asyncio.wait_for(self.net._connect(self._peer_id, peer_id, name), timeout)

    async def fetch_records(self, *, timeout: float) -> dict[str, PeerRecord]:
        await asyncio.sleep(0)
        seen = self.net.visible.get(self._peer_id)
        return {p: r for p, r in self.net.records.items() if p != self._peer_id and (seen is None or p in seen)}

    def update_record(self, **changes: Any) -> None:
        def apply() -> None:
            if self._peer_id in self.net.dead:
                return
            old = self.net.records.get(self._peer_id)
            stamped = {**changes, "reachable": self.reachable}
            self.net.records[self._peer_id] = replace(old, **stamped) if old is not None else PeerRecord(**stamped)

        if threading.current_thread() is self.net._thread:
            apply()
        else:
            self.loop.call_soon_threadsafe(apply)

    def own_record(self) -> PeerRecord | None:
        return self.net.records.get(self._peer_id)

    def data_plane_hosts(self) -> tuple[str, list[str]] | None:
        return None

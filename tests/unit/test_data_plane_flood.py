"""A flood of silent and slow-drip TCP connections, from one and from several loopback addresses, against a data
plane: pending handshakes stay bounded (in total and per source), no thread waits on a stranger, and an honest
signed exchange of 1 KiB each way still completes in well under a second."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import threading
import time
from collections import deque
from pathlib import Path

import pytest
from _loops import run_loop as _run

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.network.data_hello import HandshakeLimits
from swarmloco.protocol.network.data_plane import DataPlane, connect
from swarmloco.protocol.trust.identity import Identity

pytestmark = pytest.mark.timeout(90)

RUN = "run-flood"
LIMITS = HandshakeLimits(pending=32, per_source=8, deadline_s=2.0)
SOURCES = [f"127.0.0.{i}" for i in range(1, 9)]  # Linux routes all of 127/8 to loopback
OPEN_AT_ONCE = 400  # the attacker's sockets held open (the old pool had 160 threads)


class Flood:
    """An attacker thread: keeps `OPEN_AT_ONCE` connections open, opening new ones as fast as the listener takes
    them (the oldest closed), every fourth one dripping a byte every 0.2 s, the rest silent."""

    def __init__(self, port: int, sources: list[str]) -> None:
        self.port, self.sources = port, sources
        self.stop = threading.Event()
        self.opened = 0
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        held: deque[socket.socket] = deque()
        last_drip = time.monotonic()
        try:
            while not self.stop.is_set():
                sock = socket.socket()
                sock.settimeout(0.5)
                try:
                    sock.bind((self.sources[self.opened % len(self.sources)], 0))
                    sock.connect(("127.0.0.1", self.port))
                except OSError:
                    sock.close()
                    time.sleep(0.01)
                    continue
                self.opened += 1
                held.append(sock)
                while len(held) > OPEN_AT_ONCE:
                    held.popleft().close()
                if time.monotonic() - last_drip > 0.2:
                    last_drip = time.monotonic()
                    for i, s in enumerate(held):
                        if i % 4 == 0:
                            with contextlib.suppress(OSError):
                                s.send(b"\x01")
                time.sleep(0.002)
        finally:
            for s in held:
                s.close()


def _identity() -> Identity:
    return Identity(path=Path("<memory>"), private_key=Identity.generate())


async def _honest_exchange(plane: DataPlane, dialer: Identity, listener: Identity) -> float:
    """Seconds for: connect, signed hello, 1 KiB there and 1 KiB back."""
    started = time.monotonic()
    token, future = plane.expect(me=listener.peer_id, run_id=RUN, sender=dialer.peer_id)
    conn = await connect(plane.addrs, token, identity=dialer, receiver=listener.peer_id, run_id=RUN, timeout=5.0)
    assert conn is not None
    try:
        theirs = await asyncio.wait_for(future, 10)
        await conn.send_frame(pb.ShardBye(round=1), b"a" * 1024, timeout=10)
        _, got = await theirs.recv_frame(pb.ShardBye, max_payload=1024, timeout=10)
        await theirs.send_frame(pb.ShardBye(round=1), got, timeout=10)
        _, back = await conn.recv_frame(pb.ShardBye, max_payload=1024, timeout=10)
        assert back == b"a" * 1024
        theirs.close()
    finally:
        plane.forget(token)
        conn.close()
    return time.monotonic() - started


@pytest.mark.parametrize("sources", [SOURCES[:1], SOURCES], ids=["one-source", "eight-sources"])
def test_flood_of_silent_and_dripping_connections_leaves_honest_exchange_fast(sources: list[str]) -> None:
    dialer, listener = _identity(), _identity()

    async def main() -> tuple[list[float], int, int, int, int]:
        plane = DataPlane(bind_host="127.0.0.1", advertise_hosts=["127.0.0.1"], limits=LIMITS)
        await plane.start()
        threads_before = threading.active_count()
        try:
            quiet = await _honest_exchange(plane, dialer, listener)
            with Flood(plane.port, sources) as flood:
                while flood.opened < OPEN_AT_ONCE:  # the attacker has its sockets open before we measure
                    await asyncio.sleep(0.05)
                    assert plane.pending <= LIMITS.pending
                times, peak = [], 0
                for _ in range(8):
                    peak = max(peak, plane.pending)
                    times.append(await _honest_exchange(plane, dialer, listener))
                    await asyncio.sleep(0.1)
                threads = threading.active_count() - threads_before
                opened = flood.opened
            evicted = plane._pending.evicted if plane._pending is not None else 0
            return [quiet, *times], peak, threads, opened, evicted
        finally:
            await plane.close()

    times, peak, threads, opened, evicted = _run(main())
    quiet, flooded = times[0], times[1:]
    print(f"\nflood from {len(sources)} source(s): {opened} connections opened, {evicted} pending evicted, "
          f"peak pending {peak}; honest exchange quiet {quiet * 1000:.1f} ms, under flood median "
          f"{statistics.median(flooded) * 1000:.1f} ms, max {max(flooded) * 1000:.1f} ms")
    assert peak <= LIMITS.pending
    assert threads <= 2 + 8, f"{threads} more threads under the flood"  # the flood thread, a few pool threads
    assert max(flooded) < 1.0, f"an honest 1 KiB exchange took {max(flooded):.2f}s under the flood"
    assert evicted > 0


def test_dripping_hello_is_cut_at_the_whole_handshake_deadline() -> None:
    """A hello sent a byte every 0.1 s (each byte well inside any per-read timeout) is closed at the deadline."""
    async def main() -> float:
        limits = HandshakeLimits(deadline_s=0.5)
        plane = DataPlane(bind_host="127.0.0.1", advertise_hosts=["127.0.0.1"], limits=limits)
        await plane.start()
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", plane.port))
            started = time.monotonic()
            for _ in range(100):
                try:
                    await loop.sock_sendall(sock, b"\x00")
                except OSError:
                    break
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(loop.sock_recv(sock, 1), 0.1) == b"":
                        break
            return time.monotonic() - started
        finally:
            sock.close()
            await plane.close()

    took = _run(main())
    assert took < 1.2, f"a 0.5 s handshake deadline let a dripping hello live {took:.2f}s"

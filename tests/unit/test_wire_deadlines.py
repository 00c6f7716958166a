"""A frame's deadline covers the whole frame (header and payload), on asyncio streams (the libp2p path) and on the
TCP data plane alike: a peer that drips one byte at a time, each well inside the timeout, is cut off when the
frame's time is up, not when it stops sending."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
from _loops import run_loop as _run

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.wire import WireError, frame_prefix, read_frame
from swarmloco.protocol.network.data_plane import DataConn

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 0.6
DRIP_S = 0.05  # one byte this often: no single read of the old per-read deadline would take 0.6 s


def _frame() -> bytes:
    return frame_prefix(pb.ShardResult(round=7), 64) + bytes(64)  # 78 bytes: ~4 s dripped


async def _drip(writer: asyncio.StreamWriter | socket.socket, data: bytes, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for i in range(len(data)):
        if stop.is_set():
            return
        if isinstance(writer, socket.socket):
            await loop.sock_sendall(writer, data[i : i + 1])
        else:
            writer.write(data[i : i + 1])
            await writer.drain()
        await asyncio.sleep(DRIP_S)


async def _timed(coro: object) -> float:
    start = time.monotonic()
    with pytest.raises(WireError, match="within|deadline|timed out"):
        await coro  # type: ignore[misc]
    return time.monotonic() - start


def test_stream_frame_deadline_is_per_frame_not_per_read() -> None:
    async def main() -> float:
        got: asyncio.Future[asyncio.StreamReader] = asyncio.get_running_loop().create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got.set_result(reader)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        stop = asyncio.Event()
        dripper = asyncio.ensure_future(_drip(writer, _frame(), stop))
        try:
            reader = await asyncio.wait_for(got, 5)
            return await _timed(read_frame(reader, pb.ShardResult, max_payload=64, timeout=TIMEOUT_S))
        finally:
            stop.set()
            dripper.cancel()
            writer.close()
            server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

    took = _run(main())
    assert took < TIMEOUT_S + 0.5, f"a {TIMEOUT_S}s frame deadline took {took:.2f}s against a slow drip"


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname(), timeout=5)
        b, _ = listener.accept()
    a.setblocking(False)
    return a, b


def test_data_conn_frame_deadline_is_per_frame_not_per_read() -> None:
    async def main() -> float:
        a, b = _tcp_pair()
        conn = DataConn(b)
        stop = asyncio.Event()
        dripper = asyncio.ensure_future(_drip(a, _frame(), stop))
        try:
            return await _timed(conn.recv_frame(pb.ShardResult, max_payload=64, timeout=TIMEOUT_S))
        finally:
            stop.set()
            dripper.cancel()
            conn.close()
            a.close()

    took = _run(main())
    assert took < TIMEOUT_S + 0.5, f"a {TIMEOUT_S}s frame deadline took {took:.2f}s against a slow drip"


def test_whole_frame_in_time_is_read() -> None:
    async def main() -> tuple[pb.ShardResult, bytearray]:
        reader = asyncio.StreamReader()
        reader.feed_data(_frame())
        return await read_frame(reader, pb.ShardResult, max_payload=64, timeout=TIMEOUT_S)

    header, payload = _run(main())
    assert header.round == 7 and payload == bytes(64)

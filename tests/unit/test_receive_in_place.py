"""Receiving a frame straight into a caller's buffer (how a joiner places state chunks and a member a reduced shard),
and the large buffers such payloads land in."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import torch

from swarmloco.protocol.base import buffers
from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.buffers import large_buffer, large_empty, prefaulted_buffer
from swarmloco.protocol.base.wire import WireError, frame_prefix, read_frame
from swarmloco.protocol.network.data_plane import DataConn

pytestmark = pytest.mark.timeout(60)


def _frame(payload: bytes) -> bytes:
    return frame_prefix(pb.StateChunk(index=3, ok=True), len(payload)) + payload


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname(), timeout=5)
        b, _ = listener.accept()
    return a, b


@pytest.mark.parametrize("transport", ["data-conn", "stream"])
def test_a_payload_lands_in_the_callers_buffer_and_a_longer_one_is_refused(transport: str) -> None:
    target = bytearray(b"." * 16)

    async def receive(data: bytes, into: memoryview) -> tuple[pb.StateChunk, bytearray | memoryview]:
        if transport == "stream":
            reader = asyncio.StreamReader()
            reader.feed_data(data)
            reader.feed_eof()
            return await read_frame(reader, pb.StateChunk, max_payload=1 << 20, timeout=5, into=into)
        a, b = _pair()
        conn = DataConn(b)
        try:
            a.sendall(data)
            return await conn.recv_frame(pb.StateChunk, max_payload=1 << 20, timeout=5, into=into)
        finally:
            conn.close()
            a.close()

    header, payload = asyncio.run(receive(_frame(b"0123456789"), memoryview(target)[4:]))
    assert header.index == 3 and bytes(payload) == b"0123456789"
    assert target == b"....0123456789.."  # written where asked, nothing copied elsewhere
    with pytest.raises(WireError):  # 13 bytes do not fit the 12 left: refused before anything is read into it
        asyncio.run(receive(_frame(b"x" * 13), memoryview(target)[4:]))
    assert target == b"....0123456789.."


def test_a_prefaulted_buffer_is_writable_zeroed_memory_of_the_size_asked() -> None:
    small = prefaulted_buffer(1000)
    assert small.shape == (1000,) and small.flags.writeable
    size = (96 << 20) + 5
    big = prefaulted_buffer(size)
    assert big.shape == (size,) and big.flags.writeable
    assert not big[:: 1 << 20].any() and big[-1] == 0  # fresh anonymous pages read as zeros
    big[-5:] = 7
    memoryview(big)[: 1 << 20] = b"\x01" * (1 << 20)
    assert big[-5:].tolist() == [7] * 5 and big[(1 << 20) - 1] == 1 and big[1 << 20] == 0
    deadline = time.monotonic() + 20  # the prefault thread ends on its own
    while any(t.name == "swarmloco-prefault" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("size", [1000, (24 << 20) + 3])
def test_a_large_buffer_is_writable_memory_of_the_size_asked(size: int) -> None:
    buffer = large_buffer(size)
    view = memoryview(buffer)
    assert len(view) == size and view.format == "B" and not view.readonly
    view[-3:] = b"abc"
    assert bytes(view[-3:]) == b"abc"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_empty_is_a_contiguous_tensor_of_the_numel_and_dtype_asked(dtype: torch.dtype) -> None:
    small, big = large_empty(10, dtype), large_empty((6 << 20) + 1, dtype)
    for t, numel in ((small, 10), (big, (6 << 20) + 1)):
        assert t.dtype == dtype and t.numel() == numel and t.shape == (numel,) and t.is_contiguous()
    big.fill_(1.5)
    big[-1] = 2.0
    assert float(big.sum()) == 1.5 * (6 << 20) + 2.0


def test_large_buffers_reuse_the_memory_of_ones_gone_and_never_of_one_alive() -> None:
    size = 9 << 20
    first = large_empty(size // 4)
    address = first.data_ptr()
    view = first[10:20]  # a view keeps the memory in use
    del first
    second = large_empty(size // 4)
    assert second.data_ptr() != address
    del view
    third = large_empty(size // 4 - 1000)  # the first buffer's memory is free now, and fits: it comes back
    assert third.data_ptr() == address
    payload = large_buffer(3 * size)  # too big for any freed one: fresh memory
    assert len(payload) == 3 * size and not memoryview(payload).readonly
    del second, third, payload
    assert 3 <= len(buffers._POOL) <= buffers._POOL.capacity
    assert large_empty(1 << 10).numel() == 1 << 10  # (small ones are plain tensors)


def test_a_buffer_somewhat_larger_than_one_gone_reuses_its_memory() -> None:
    """A round's shard grows when its reducer's bandwidth share does: its buffers still come from the pool."""
    pool = buffers._Pool(capacity=16)
    first = pool.array(10 << 20)
    address = first.ctypes.data
    del first
    grown = pool.array(14 << 20)  # up to HEADROOM times the first size
    assert grown.ctypes.data == address and len(grown) == 14 << 20
    del grown
    assert pool.array(16 << 20).ctypes.data != address  # beyond it: a mapping of its own


def test_the_pool_keeps_at_most_three_times_the_largest_mapping() -> None:
    pool = buffers._Pool(capacity=16)
    held = [pool.array(10 << 20) for _ in range(5)]  # five buffers alive at once, then all gone
    del held
    assert len(pool) == 3  # 50 MiB freed, 30 MiB kept
    kept = pool.array(10 << 20)
    assert len(kept) == 10 << 20 and len(pool) == 2  # one reused
    del kept
    assert len(pool) == 3  # and back as soon as nothing refers to it

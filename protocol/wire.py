"""Framing for swarmloco's streams over hivemind's libp2p binary streams.

A frame is: u32 header length, the header (a protobuf message), u64 payload length, the payload. Both lengths are
checked against caps *before* anything is read, and every read has a deadline, so a hostile or dead peer can
neither make us allocate unbounded memory nor block us forever.
"""
from __future__ import annotations

import asyncio
import struct
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

MAX_HEADER_BYTES = 64 * 1024
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_CHUNK = 1 << 20

M = TypeVar("M", bound=Message)


class WireError(ConnectionError):
    """The stream broke, timed out, or carried a frame that violates the caps or the schema."""


async def write_frame(writer: asyncio.StreamWriter, header: Message, payload: bytes | memoryview = b"", *, timeout: float) -> None:
    encoded = header.SerializeToString()
    if len(encoded) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(encoded)} bytes exceeds the {MAX_HEADER_BYTES}-byte cap")
    try:
        writer.write(_U32.pack(len(encoded)) + encoded + _U64.pack(len(payload)))
        if len(payload):
            writer.write(payload)  # the transport sends what it can now and buffers the rest (one copy at most)
        await asyncio.wait_for(writer.drain(), timeout)
    except (asyncio.TimeoutError, OSError, RuntimeError) as exc:
        raise WireError(f"sending {type(header).__name__} failed: {exc!r}") from exc


async def read_frame(reader: asyncio.StreamReader, header_type: type[M], *, max_payload: int, timeout: float) -> tuple[M, bytearray]:
    """Read one frame; the payload is returned as a writable bytearray (tensors can wrap it without a copy)."""
    try:
        (length,) = _U32.unpack(await asyncio.wait_for(reader.readexactly(4), timeout))
        if length > MAX_HEADER_BYTES:
            raise WireError(f"peer sent a {length}-byte header, cap is {MAX_HEADER_BYTES}")
        raw = await asyncio.wait_for(reader.readexactly(length), timeout)
        (size,) = _U64.unpack(await asyncio.wait_for(reader.readexactly(8), timeout))
        if size > max_payload:
            raise WireError(f"peer announced a {size}-byte payload, cap is {max_payload}")
        payload = bytearray(size)
        view, got = memoryview(payload), 0
        while got < size:
            chunk = await asyncio.wait_for(reader.read(min(_CHUNK * 4, size - got)), timeout)
            if not chunk:
                raise WireError(f"stream ended after {got} of {size} payload bytes")
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
    except asyncio.IncompleteReadError as exc:
        raise WireError("stream closed by peer") from exc
    except (asyncio.TimeoutError, OSError) as exc:
        raise WireError(f"reading {header_type.__name__} failed: {exc!r}") from exc
    header = header_type()
    try:
        header.ParseFromString(bytes(raw))
    except DecodeError as exc:
        raise WireError(f"malformed {header_type.__name__}: {exc}") from exc
    return header, payload


def frame_bytes(header: Message, payload_len: int) -> int:
    """Bytes a frame occupies on the stream (before libp2p's own encryption and multiplexing overhead)."""
    return _U32.size + header.ByteSize() + _U64.size + payload_len


def close_writer(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except (OSError, RuntimeError):
        pass

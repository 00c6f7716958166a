"""Framing for swarmloco's streams over hivemind's libp2p binary streams.

A frame is: u32 header length, the header (a protobuf message), u64 payload length, the payload. Both lengths are
checked against caps *before* anything is read, and a frame has one deadline for all of it (header and payload):
a peer that drips a byte at a time cannot stretch a read past it. So a hostile or dead peer can neither make us
allocate unbounded memory nor block us longer than the caller allowed.
"""
from __future__ import annotations

import asyncio
import struct
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

MAX_HEADER_BYTES = 64 * 1024
HEADER_LEN = struct.Struct("<I")
PAYLOAD_LEN = struct.Struct("<Q")
_CHUNK = 1 << 20

M = TypeVar("M", bound=Message)


class WireError(ConnectionError):
    """The stream broke, timed out, or carried a frame that violates the caps or the schema."""


async def write_frame(
    writer: asyncio.StreamWriter, header: Message, payload: bytes | memoryview = b"", *, timeout: float
) -> None:
    prefix = frame_prefix(header, len(payload))
    try:
        writer.write(prefix)
        if len(payload):
            writer.write(payload)  # the transport sends what it can now and buffers the rest (one copy at most)
        await asyncio.wait_for(writer.drain(), timeout)
    except (TimeoutError, OSError, RuntimeError) as exc:
        raise WireError(f"sending {type(header).__name__} failed: {exc!r}") from exc


async def read_frame(
    reader: asyncio.StreamReader, header_type: type[M], *, max_payload: int, timeout: float,
    into: memoryview | None = None,
) -> tuple[M, bytearray | memoryview]:
    """Read one frame within `timeout` seconds for the whole of it; the payload is returned as a writable bytearray
    (tensors can wrap it without a copy), or with `into` written to the start of `into` and returned as that slice
    (a payload longer than `into` is refused like one over `max_payload`)."""
    limit = max_payload if into is None else min(max_payload, len(into))
    try:
        async with asyncio.timeout(timeout):
            raw, payload = await _read_frame(reader, limit, into)
    except asyncio.IncompleteReadError as exc:
        raise WireError("stream closed by peer") from exc
    except TimeoutError as exc:
        raise WireError(f"reading {header_type.__name__} failed: no whole frame within {timeout:.3g}s") from exc
    except OSError as exc:
        raise WireError(f"reading {header_type.__name__} failed: {exc!r}") from exc
    return parse_header(header_type, raw), payload


async def _read_frame(reader: asyncio.StreamReader, max_payload: int,
                      into: memoryview | None = None) -> tuple[bytes, bytearray | memoryview]:
    raw = await reader.readexactly(header_length(await reader.readexactly(HEADER_LEN.size)))
    size = payload_length(await reader.readexactly(PAYLOAD_LEN.size), max_payload)
    payload: bytearray | memoryview = bytearray(size) if into is None else into[:size]
    view, got = memoryview(payload), 0
    while got < size:
        chunk = await reader.read(min(_CHUNK * 4, size - got))
        if not chunk:
            raise WireError(f"stream ended after {got} of {size} payload bytes")
        view[got : got + len(chunk)] = chunk
        got += len(chunk)
    return raw, payload


# --- the frame format, shared with the socket-based data plane ------------------------------------------------------
def frame_prefix(header: Message, payload_len: int) -> bytes:
    """Everything of a frame before its payload."""
    encoded = header.SerializeToString()
    if len(encoded) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(encoded)} bytes exceeds the {MAX_HEADER_BYTES}-byte cap")
    return HEADER_LEN.pack(len(encoded)) + encoded + PAYLOAD_LEN.pack(payload_len)


def header_length(raw: bytes) -> int:
    (length,) = HEADER_LEN.unpack(raw)
    if length > MAX_HEADER_BYTES:
        raise WireError(f"peer sent a {length}-byte header, cap is {MAX_HEADER_BYTES}")
    return int(length)


def payload_length(raw: bytes, max_payload: int) -> int:
    (size,) = PAYLOAD_LEN.unpack(raw)
    if size > max_payload:
        raise WireError(f"peer announced a {size}-byte payload, cap is {max_payload}")
    return int(size)


def parse_header(header_type: type[M], raw: bytes | bytearray) -> M:
    header = header_type()
    try:
        header.ParseFromString(bytes(raw))
    except DecodeError as exc:
        raise WireError(f"malformed {header_type.__name__}: {exc}") from exc
    return header


def frame_bytes(header: Message, payload_len: int) -> int:
    """Bytes a frame occupies on the stream (before libp2p's own encryption and multiplexing overhead)."""
    return HEADER_LEN.size + header.ByteSize() + PAYLOAD_LEN.size + payload_len


def close_writer(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except (OSError, RuntimeError):
        pass

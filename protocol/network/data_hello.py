"""The hello that opens a TCP data connection, and the bounds on handshakes that are still in progress.

A data connection's first frame is a `DataHello`. The dialer signs it with its peer key over the run id, the round,
the listener's peer id, its own peer id, the token, a fresh random nonce and its clock. The listener hands the
connection on only when the signature is the claimed sender's, the hello is addressed to the listener, its clock is
within the freshness window of ours and its nonce is new for that token. The token (handed out on admitted libp2p
streams only) says which round or download a connection is for; the signature says who dials. So neither a token
read off the plaintext path nor a replayed hello lets anyone else in as that sender. What follows the hello is not
authenticated here: payloads carry their own signatures.

Until its hello is complete a connection is *pending*. Pending handshakes are bounded in total and per source
address, and a handshake has one deadline for the whole hello. When a bound is reached, the oldest pending handshake
of that source (or, for the total bound, of all sources) is closed at once to make room. An honest dialer sends its
hello right after connecting, so it is pending for about one round trip; a silent or dripping connection is always
older, so it goes first.
"""
from __future__ import annotations

import asyncio
import secrets
import socket
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.text import short_id
from swarmloco.protocol.base.wire import HEADER_LEN, PAYLOAD_LEN, WireError, parse_header
from swarmloco.protocol.trust.identity import Identity, verify

_DOMAIN = b"swarmloco-data-hello-v1\n"
NONCE_BYTES = 16
MAX_HELLO_BYTES = 1024  # a signed hello is ~300 bytes: the 64 KiB frame cap would be a free buffer per connection


@dataclass(frozen=True, kw_only=True)
class HandshakeLimits:
    """What a data plane gives connections that have not yet proven anything."""

    pending: int = 64  # handshakes in progress, all sources together
    per_source: int = 8  # handshakes in progress from one IP address
    deadline_s: float = 2.0  # from accept to a complete hello, for the whole hello
    freshness_s: float = 300.0  # a hello signed more than this far from our clock is refused (clock skew allowance)
    nonces_per_token: int = 256  # hellos remembered (against replay) per token; beyond it the token takes no more

    def __post_init__(self) -> None:
        if not 1 <= self.per_source <= self.pending <= 4096:
            raise ValueError(f"need 1 <= per_source ({self.per_source}) <= pending ({self.pending}) <= 4096")
        if not 0.05 <= self.deadline_s <= 60.0:
            raise ValueError(f"deadline_s must be in [0.05, 60] s, got {self.deadline_s}")
        if not 1.0 <= self.freshness_s <= 86400.0:
            raise ValueError(f"freshness_s must be in [1, 86400] s, got {self.freshness_s}")
        if not 1 <= self.nonces_per_token <= 65536:
            raise ValueError(f"nonces_per_token must be in [1, 65536], got {self.nonces_per_token}")


def signer_of(transport: Any) -> Identity | None:
    """The identity a transport's peer signs with (both transports hold their `credentials`); None without one."""
    credentials = getattr(transport, "credentials", None)
    identity = getattr(credentials, "identity", None)
    return identity if isinstance(identity, Identity) else None


def hello_body(hello: pb.DataHello) -> bytes:
    """The bytes a hello's signature covers: every field but the signature, each length-prefixed."""
    fields = [hello.run_id.encode(), str(hello.round).encode(), hello.receiver.encode(), hello.sender.encode(),
              hello.token.encode(), bytes(hello.nonce), str(hello.time_ms).encode()]
    return _DOMAIN + b"".join(struct.pack("<I", len(f)) + f for f in fields)


def signed_hello(identity: Identity | None, *, token: str, receiver: str = "", run_id: str = "",
                 round_number: int = 0, sender: str = "") -> pb.DataHello:
    """A fresh hello; signed when `identity` is given (an unsigned one is refused by every current listener)."""
    hello = pb.DataHello(token=token, sender=identity.peer_id if identity is not None else sender,
                         round=round_number, run_id=run_id, receiver=receiver,
                         nonce=secrets.token_bytes(NONCE_BYTES), time_ms=int(time.time() * 1000))
    if identity is not None:
        hello.signature = identity.sign(hello_body(hello))
    return hello


def hello_problem(hello: pb.DataHello, *, me: str = "", run_id: str = "", sender: str = "",
                  freshness_s: float, now: float | None = None) -> str:
    """Why a listener refuses `hello` ("" when it does not): checked before the connection is handed to anyone.
    `me`, `run_id` and `sender` are checked when given (a registration that knows them passes them)."""
    if not hello.sender or not hello.signature:
        return "unsigned hello"
    if sender and hello.sender != sender:
        return f"hello from {short_id(hello.sender)}, expected {short_id(sender)}"
    if me and hello.receiver != me:
        return "hello addressed to another peer"
    if run_id and hello.run_id != run_id:
        return "hello for another run"
    skew = abs((time.time() if now is None else now) - hello.time_ms / 1000)
    if skew > freshness_s:
        return f"hello signed {skew:.0f}s away from our clock (window {freshness_s:.0f}s)"
    if len(hello.nonce) != NONCE_BYTES:
        return f"nonce of {len(hello.nonce)} bytes, need {NONCE_BYTES}"
    if not verify(hello.sender, hello_body(hello), bytes(hello.signature)):
        return "signature is not the sender's"
    return ""


class ReplayGuard:
    """The nonces a token has accepted; forgotten with the token (a token lives one round or one download)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._seen: set[bytes] = set()

    def admit(self, nonce: bytes) -> str:
        if nonce in self._seen:
            return "replayed hello"
        if len(self._seen) >= self.capacity:
            return f"token has taken its {self.capacity} hellos"
        self._seen.add(nonce)
        return ""


class PendingHandshakes:
    """The handshakes in progress, oldest first, in total and per source; making room cancels the oldest."""

    def __init__(self, limits: HandshakeLimits) -> None:
        self.limits = limits
        self._all: OrderedDict[asyncio.Task[None], str] = OrderedDict()
        self._by_source: dict[str, OrderedDict[asyncio.Task[None], None]] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._all)

    def add(self, task: asyncio.Task[None], source: str) -> None:
        mine = self._by_source.setdefault(source, OrderedDict())
        while len(mine) >= self.limits.per_source:
            self._evict(next(iter(mine)))
        while len(self._all) >= self.limits.pending:
            self._evict(next(iter(self._all)))
        self._all[task] = source
        self._by_source.setdefault(source, OrderedDict())[task] = None

    def done(self, task: asyncio.Task[None]) -> None:
        """Idempotent: the handshake ended (hello read, refused, evicted or timed out)."""
        source = self._all.pop(task, None)
        if source is None:
            return
        mine = self._by_source[source]
        mine.pop(task, None)
        if not mine:
            del self._by_source[source]

    def _evict(self, task: asyncio.Task[None]) -> None:
        self.done(task)
        task.cancel()  # its handler closes the socket on the next pass of the loop
        self.evicted += 1

    def cancel_all(self) -> None:
        for task in list(self._all):
            self._evict(task)


async def read_hello(sock: socket.socket, *, deadline_s: float) -> pb.DataHello:
    """The first frame of an accepted, non-blocking socket, read on the event loop (no thread waits on a stranger),
    whole within `deadline_s`, exactly its own bytes (what follows stays in the socket). Raises WireError."""
    loop = asyncio.get_running_loop()

    async def exactly(size: int) -> bytes:
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = await loop.sock_recv_into(sock, view[got:])
            if n == 0:
                raise WireError(f"data connection closed after {got} of {size} hello bytes")
            got += n
        return bytes(buf)

    try:
        async with asyncio.timeout(deadline_s):
            (length,) = HEADER_LEN.unpack(await exactly(HEADER_LEN.size))
            if length > MAX_HELLO_BYTES:
                raise WireError(f"a {length}-byte hello, cap is {MAX_HELLO_BYTES}")
            raw = await exactly(length)
            (size,) = PAYLOAD_LEN.unpack(await exactly(PAYLOAD_LEN.size))
    except TimeoutError as exc:
        raise WireError(f"no whole hello within {deadline_s:.3g}s") from exc
    except OSError as exc:
        raise WireError(f"reading the hello failed: {exc!r}") from exc
    if size:
        raise WireError(f"a hello with a {size}-byte payload")
    return parse_header(pb.DataHello, raw)

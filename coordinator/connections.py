"""Connection-level defences of the coordinator's HTTP server: idle and whole-request deadlines, and caps on open
connections per client address and in total.

uvicorn's h11 protocol arms its keep-alive timer only once a response is written, and any byte received cancels
it: a connection that never sends a request, or sends it one byte at a time, is never closed. Its
``limit_concurrency`` counts open connections, so 256 silent connections turned every real request into a 503.
:class:`GuardedH11Protocol` wraps that protocol so that

- a connection with no request in progress (just accepted, or between keep-alive requests) is closed after
  ``idle_timeout_s``;
- a request must arrive and be answered within ``request_timeout_s`` of its first byte, however its bytes are
  spread out (408 while it is still incomplete; a client that does not read its answer is dropped);
- one client address (an IPv4 address or an IPv6 /64) holds at most ``max_per_address`` connections; more are
  answered 429 and closed;
- at most ``max_connections`` are open: at the cap the connection idle for longest is closed to make room, and
  only when none is idle is the newcomer answered 503 and closed. Silent connections therefore never lock out a
  client with a request to make.

All protocol callbacks run on the server's event loop thread, so the accounting needs no lock.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ConnectionGuard", "ConnectionLimits", "GuardedH11Protocol", "address_key", "guarded_protocol",
           "raise_fd_limit"]

logger = logging.getLogger(__name__)

FD_RESERVE = 256  # descriptors kept for the database, logs, the listening socket and the DHT's pipes
LOG_EVERY_S = 10.0  # at most one summary line per interval, however many connections an attacker opens


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    """How long a connection may idle or take over one request, and how many may be open."""

    idle_timeout_s: float = 5.0  # before the first request and between keep-alive requests
    request_timeout_s: float = 30.0  # first byte of a request until its answer is written
    max_connections: int = 2048
    max_per_address: int = 64  # behind a reverse proxy every client has its address: raise to max_connections
    max_header_bytes: int = 16 * 1024  # request line and headers; a body is capped by the endpoint

    def __post_init__(self) -> None:
        if not 0.05 <= self.idle_timeout_s <= 600:
            raise ValueError(f"idle_timeout_s must be in [0.05, 600], got {self.idle_timeout_s}")
        if not 0.1 <= self.request_timeout_s <= 3600:
            raise ValueError(f"request_timeout_s must be in [0.1, 3600], got {self.request_timeout_s}")
        if not 8 <= self.max_connections <= 1_000_000:
            raise ValueError(f"max_connections must be in [8, 1000000], got {self.max_connections}")
        if not 1 <= self.max_per_address <= self.max_connections:
            raise ValueError(f"max_per_address must be in [1, max_connections={self.max_connections}], got "
                             f"{self.max_per_address}")
        if not 1024 <= self.max_header_bytes <= 1024 * 1024:
            raise ValueError(f"max_header_bytes must be in [1 KiB, 1 MiB], got {self.max_header_bytes}")


def address_key(host: str) -> str:
    """What the per-address cap counts: the IPv4 address, or the /64 of an IPv6 one (one subscriber's block)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's soft limit on open files toward ``wanted`` (never above the hard limit); returns the
    soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return wanted if soft == resource.RLIM_INFINITY else soft
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
        return soft
    return target


class ConnectionGuard:
    """Counts open connections per address and in total, and knows which are idle (oldest first)."""

    def __init__(self, limits: ConnectionLimits, *, max_connections: int | None = None) -> None:
        self.limits = limits
        self.max_connections = limits.max_connections if max_connections is None else max_connections
        self._open: set[GuardedH11Protocol] = set()
        self._per_address: Counter[str] = Counter()
        self._idle: dict[GuardedH11Protocol, None] = {}  # insertion order: the longest idle first
        self.totals: Counter[str] = Counter()  # since start, for tests and operators
        self._unlogged: Counter[str] = Counter()
        self._logged_at = float("-inf")

    @classmethod
    def for_process(cls, limits: ConnectionLimits) -> ConnectionGuard:
        """A guard whose global cap fits this process's open-file limit (raised if it can be)."""
        soft = raise_fd_limit(limits.max_connections + FD_RESERVE)
        cap = max(8, min(limits.max_connections, soft - FD_RESERVE))
        if cap < limits.max_connections:
            logger.warning("open-file limit %d leaves room for %d connections, not max_connections=%d; raise "
                           "`ulimit -n` to %d", soft, cap, limits.max_connections,
                           limits.max_connections + FD_RESERVE)
        return cls(limits, max_connections=cap)

    @property
    def open_count(self) -> int:
        return len(self._open)

    def admit(self, conn: GuardedH11Protocol, address: str) -> int:
        """0 when ``conn`` may stay open, else the HTTP status to refuse it with."""
        if self._per_address[address] >= self.limits.max_per_address:
            self.note("refused_address")
            return 429
        if len(self._open) >= self.max_connections:
            victim = next(iter(self._idle), None)
            if victim is None:
                self.note("refused_full")
                return 503
            self.release(victim)
            victim.close_now()
            self.note("evicted")
        self._open.add(conn)
        self._per_address[address] += 1
        return 0

    def release(self, conn: GuardedH11Protocol) -> None:
        """Forget ``conn`` (idempotent)."""
        if conn not in self._open:
            return
        self._open.discard(conn)
        self._idle.pop(conn, None)
        self._per_address[conn.address] -= 1
        if self._per_address[conn.address] <= 0:
            del self._per_address[conn.address]

    def set_idle(self, conn: GuardedH11Protocol, idle: bool) -> None:
        self._idle.pop(conn, None)
        if idle and conn in self._open:
            self._idle[conn] = None

    def note(self, event: str) -> None:
        """Count ``event``; log the counts since the last line at most every ``LOG_EVERY_S``. An idle connection
        closed is routine (every keep-alive connection ends that way) and is only counted."""
        self.totals[event] += 1
        if event == "idle_closed":
            return
        self._unlogged[event] += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            counts = ", ".join(f"{k}={v}" for k, v in sorted(self._unlogged.items()))
            logger.warning("connections refused or cut off: %s (open %d of %d, at most %d per address, idle "
                           "timeout %gs, request deadline %gs)", counts, len(self._open), self.max_connections,
                           self.limits.max_per_address, self.limits.idle_timeout_s, self.limits.request_timeout_s)
            self._unlogged.clear()


def _raw_response(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 answer that closes the connection, written outside h11 (no request may exist)."""
    reasons = {408: "Request Timeout", 429: "Too Many Requests", 503: "Service Unavailable"}
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.1 {status} {reasons[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n")
    if status != 408:
        head += "retry-after: 5\r\n"
    return head.encode() + b"\r\n" + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a :class:`ConnectionGuard` (set by :func:`guarded_protocol`)."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.address = ""
        self._admitted = False
        self._busy = False
        self._deadline: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.address = address_key(self.client[0] if self.client else "?")
        refusal = self.guard.admit(self, self.address)
        if refusal:
            message = (f"more than {self.guard.limits.max_per_address} connections from this address; close some "
                       f"and retry" if refusal == 429 else "the coordinator is at its connection limit; retry later")
            transport.write(_raw_response(refusal, message))
            transport.close()
            return
        self._admitted = True
        self._idle()

    def data_received(self, data: bytes) -> None:
        if not self._admitted or self.transport.is_closing():
            return  # refused, evicted or already answered 400: whatever it still sends is dropped
        if not self._busy:
            self._busy = True
            self.guard.set_idle(self, False)
            self._arm(self.guard.limits.request_timeout_s, self._request_expired)
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.release(self)
        self._admitted = False
        super().connection_lost(exc)

    # -- uvicorn hooks ---------------------------------------------------------------------------------------

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request that was already buffered
        if self.transport.is_closing() or not self._admitted:
            return
        self._unset_keepalive_if_required()  # our idle timer replaces uvicorn's keep-alive timer
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm(self.guard.limits.request_timeout_s, self._request_expired)
        else:
            self._idle()

    def timeout_keep_alive_handler(self) -> None:
        self.close_now()

    def _should_upgrade(self) -> bool:
        # No endpoint speaks WebSocket, and an upgrade would hand the transport to a protocol the guard does not
        # see; uvicorn would also log two warnings per upgrade request. Serve it as plain HTTP instead.
        return False

    # -- timers ----------------------------------------------------------------------------------------------

    def _idle(self) -> None:
        self._busy = False
        self.guard.set_idle(self, True)
        self._arm(self.guard.limits.idle_timeout_s, self._idle_expired)

    def _arm(self, delay: float, callback: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _idle_expired(self) -> None:
        self._deadline = None
        self.guard.note("idle_closed")
        self.close_now()

    def _request_expired(self) -> None:
        self._deadline = None
        cycle = self.cycle
        current = cycle is not None and not cycle.response_complete
        if current and cycle is not None and cycle.response_started:
            self.guard.note("slow_reader")  # the answer is written but not read: nothing more to say
            self.transport.abort()
            return
        limit = self.guard.limits.request_timeout_s
        if current and cycle is not None and not cycle.more_body:
            self.guard.note("slow_answer")  # the whole request arrived; we were too slow answering it
            status, message = 503, f"no answer within {limit:g}s; retry later"
        else:
            self.guard.note("slow_request")
            status, message = 408, f"request not received within {limit:g}s of its first byte"
        if current and cycle is not None:
            cycle.disconnected = True  # the endpoint's reads end and its answer is dropped
            cycle.message_event.set()
        self.transport.write(_raw_response(status, message))
        self.transport.close()

    def close_now(self) -> None:
        """Close this connection (idle expiry, eviction, shutdown of an idle keep-alive connection)."""
        self._disarm()
        self._admitted = False
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` bound to ``guard`` (uvicorn instantiates it itself)."""
    return type("CoordinatorH11Protocol", (GuardedH11Protocol,), {"guard": guard})

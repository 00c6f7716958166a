"""Dial-back: whether a peer can be reached from outside, as `swarmloco doctor` asks the coordinator.

A peer behind NAT or a firewall can dial out (it reaches the bootstrap node and the coordinator) but nobody can
dial in, and then no group can reach it unless it uses a relay. The doctor listens on a port and asks the
coordinator to connect to it. The coordinator only ever connects to the address the request came from: it cannot
be made to probe a third party. Each dial is one TCP connect with a short timeout, made on the event loop (no
thread waits on it), at most `max_in_flight` at once, and at a bounded rate per client address (an IPv4 address or
an IPv6 /64, as the connection caps count them): nobody can make the coordinator spend its threads or its sockets.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from swarmloco.coordinator.connections import address_key
from swarmloco.coordinator.limits import RateLimiter

DIAL_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class DialBack:
    status: int
    body: dict[str, Any]


class DialBacker:
    def __init__(self, *, rate_per_s: float = 0.5, burst: float = 5.0, timeout_s: float = DIAL_TIMEOUT_S,
                 max_in_flight: int = 16) -> None:
        self._limiter = RateLimiter(rate_per_s, burst)
        self.timeout_s, self.max_in_flight = timeout_s, max_in_flight
        self._in_flight = 0  # only touched on the event loop

    async def dial(self, client: str, port: int) -> DialBack:
        """Connect once to (client, port); `client` is the request's source address, never the asker's word."""
        if not 1 <= port <= 65535:
            return DialBack(400, {"error": f"port must be 1..65535, got {port}"})
        if not client or client == "?":
            return DialBack(400, {"error": "the request's source address is unknown"})
        if self._in_flight >= self.max_in_flight:
            return DialBack(429, {"error": "too many dial-backs in progress; retry in a few seconds"})
        if not self._limiter.allow(address_key(client), time.monotonic()):
            return DialBack(429, {"error": "too many dial-backs from this address; retry in a few seconds"})
        address = f"[{client}]:{port}" if ":" in client else f"{client}:{port}"
        started = time.monotonic()
        self._in_flight += 1
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(client, port), self.timeout_s)
        except (OSError, TimeoutError) as exc:
            why = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or type(exc).__name__
            return DialBack(200, {"reachable": False, "address": address, "error": why})
        finally:
            self._in_flight -= 1
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return DialBack(200, {"reachable": True, "address": address,
                              "connect_ms": round(1000 * (time.monotonic() - started), 1)})

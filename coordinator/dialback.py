"""Dial-back: whether a peer can be reached from outside, as `swarmloco doctor` asks the coordinator.

A peer behind NAT or a firewall can dial out (it reaches the bootstrap node and the coordinator) but nobody can
dial in, and then no group can reach it unless it uses a relay. The doctor listens on a port and asks the
coordinator to connect to it. The coordinator only ever connects to the address the request came from: it cannot
be made to probe a third party. The port is the asker's choice (1..65535), one TCP connect with a short timeout,
and a per-address rate limit bounds how often anyone can make it dial.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

from swarmloco.coordinator.limits import RateLimiter

DIAL_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class DialBack:
    status: int
    body: dict[str, Any]


class DialBacker:
    def __init__(self, *, rate_per_s: float = 0.5, burst: float = 5.0, timeout_s: float = DIAL_TIMEOUT_S) -> None:
        self._limiter = RateLimiter(rate_per_s, burst)
        self.timeout_s = timeout_s

    def dial(self, client: str, port: int) -> DialBack:
        """Connect once to (client, port); `client` is the request's source address, never the asker's word."""
        if not 1 <= port <= 65535:
            return DialBack(400, {"error": f"port must be 1..65535, got {port}"})
        if not client or client == "?":
            return DialBack(400, {"error": "the request's source address is unknown"})
        if not self._limiter.allow(client, time.monotonic()):
            return DialBack(429, {"error": "too many dial-backs from this address; retry in a few seconds"})
        address = f"[{client}]:{port}" if ":" in client else f"{client}:{port}"
        started = time.monotonic()
        try:
            with socket.create_connection((client, port), timeout=self.timeout_s):
                pass
        except OSError as exc:
            return DialBack(200, {"reachable": False, "address": address,
                                  "error": exc.strerror or type(exc).__name__})
        return DialBack(200, {"reachable": True, "address": address,
                              "connect_ms": round(1000 * (time.monotonic() - started), 1)})

"""Link test: the bandwidth between a volunteer's machine and the coordinator, as `swarmloco doctor` measures it.

`GET /api/linktest?bytes=N` sends N bytes (at most `MAX_BYTES`) that no proxy can compress; `POST /api/linktest` reads
a body of at most `MAX_BYTES` and says how long it took. Both are bounded like the dial-back: a rate per client
address (an IPv4 address or an IPv6 /64) and a number in progress at once, so nobody can turn the coordinator into a
traffic source or sink for others.
"""
from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from swarmloco.coordinator.connections import address_key
from swarmloco.coordinator.limits import RateLimiter

__all__ = ["BLOCK", "MAX_BYTES", "LinkTester"]

MAX_BYTES = 16 << 20
BLOCK = os.urandom(1 << 20)  # random, so a compressing proxy cannot shrink the test


@dataclass
class LinkTester:
    rate_per_s: float = 0.2
    burst: float = 6.0  # a doctor run takes up to four tests: a probe and a timed one, each way
    max_in_flight: int = 4
    slot_ttl_s: float = 60.0  # a test is forgotten after this long, however it ended (the request deadline is 30 s)

    def __post_init__(self) -> None:
        self._limiter = RateLimiter(self.rate_per_s, self.burst)
        self._slots: dict[int, float] = {}  # tests in progress -> when each began; only touched on the event loop
        self._next = 0

    def admit(self, client: str, nbytes: int, *, too_large: int = 400) -> tuple[int, int, str]:
        """(slot, 0, "") when a test of `nbytes` from `client` may run (call `done(slot)` after it), else (-1, the
        HTTP status, why); `too_large` is the status for a size out of range."""
        now = time.monotonic()
        self._slots = {k: t for k, t in self._slots.items() if now - t < self.slot_ttl_s}
        if not 1 <= nbytes <= MAX_BYTES:
            return -1, too_large, f"bytes must be 1..{MAX_BYTES}, got {nbytes}"
        if len(self._slots) >= self.max_in_flight:
            return -1, 429, "too many link tests in progress; retry in a few seconds"
        if not self._limiter.allow(address_key(client), now):
            return -1, 429, "too many link tests from this address; retry in a minute"
        self._next += 1
        self._slots[self._next] = now
        return self._next, 0, ""

    def done(self, slot: int) -> None:
        self._slots.pop(slot, None)

    async def payload(self, slot: int, nbytes: int) -> AsyncIterator[bytes]:
        """The download's bytes, block by block; the slot is freed when the response ends, however it ends."""
        try:
            sent = 0
            while sent < nbytes:
                block = BLOCK[: min(len(BLOCK), nbytes - sent)]
                sent += len(block)
                yield block
        finally:
            self.done(slot)

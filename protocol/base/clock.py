"""Where the protocol reads the time.

Every decision that depends on time (a view's end, a grace window, how long a peer stays distrusted, a group's
readiness cutoff) reads it from the transport's `clock`, never from the `time` module, so the in-memory transport
can run the same code on a virtual clock that moves only when nothing is left to run
(`swarmloco.protocol.testing.virtual_time`): there, a timeout expires because every peer waited for it, not
because the machine was busy. Code running on the transport's loop may read `loop.time()` instead: it is the same
clock. Durations measured only to be reported (how long an audit's CPU work took) keep `time.monotonic`.
"""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds from an arbitrary origin; never goes back."""
        ...

    def time(self) -> float:
        """Wall-clock unix seconds, as peers' records and views state them."""
        ...


class SystemClock:
    """The machine's clocks: what every real peer runs on."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


SYSTEM = SystemClock()

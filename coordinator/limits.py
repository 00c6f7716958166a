"""Token buckets that refuse floods with 429, keyed by client address or peer id, in bounded memory."""
from __future__ import annotations

import threading

__all__ = ["RateLimiter"]


class RateLimiter:
    """Token bucket per key (``rate`` tokens a second, at most ``burst``); tracks at most ``max_keys`` keys."""

    def __init__(self, rate: float, burst: float, max_keys: int = 10_000) -> None:
        if not (rate > 0 and burst >= 1 and max_keys >= 1):
            raise ValueError(f"need rate > 0, burst >= 1 and max_keys >= 1, got {rate}, {burst}, {max_keys}")
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def allow(self, key: str, now: float) -> bool:
        """Take one token for ``key`` if it has one."""
        with self._lock:
            tokens, last = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
            if len(self._buckets) >= self.max_keys and key not in self._buckets:
                self._buckets.clear()  # crude but bounded: forget everyone rather than grow forever
            if tokens < 1:
                self._buckets[key] = (tokens, now)
                return False
            self._buckets[key] = (tokens - 1, now)
            return True

    def wait_s(self, key: str, now: float) -> float:
        """Seconds until ``key`` has a token again (0 when it has one now)."""
        with self._lock:
            tokens, last = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate

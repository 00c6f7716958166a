"""Peer-side reporting client: sends signed reports to the coordinator without ever slowing training.

Every ``report_*`` call validates and signs the report on the caller's thread (tens of microseconds) and appends it
to a bounded in-memory queue; a background thread posts the queue in order. Failures (coordinator down, slow,
overloaded) are retried with exponential back-off and jitter; a report leaves the queue only when the coordinator
acknowledged it (2xx) or refused it for good (4xx other than 408/429). Retries reuse the report's nonce, so a
report whose acknowledgement was lost is stored once; a report that waited longer than ``resign_after_s`` is
re-signed with a fresh timestamp (same nonce) to stay inside the coordinator's window.

When the queue is full, the oldest metrics/heartbeat report is dropped to make room (round, hello and bye reports
are kept); if only those remain, the new report is dropped and the call returns ``False``. Nothing is persisted:
reports not yet acknowledged when the process dies are lost, acknowledged ones are in the coordinator's database.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import requests

from swarmloco.protocol.base.text import bounded
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.reports import Report, ReportError, build_report

__all__ = ["ReportSender", "ReportSenderConfig", "ReportSenderStats"]

logger = logging.getLogger(__name__)

_DROPPABLE = frozenset({"metrics", "heartbeat"})
_RETRYABLE_4XX = frozenset({408, 425, 429})


@dataclass(frozen=True, kw_only=True)
class ReportSenderConfig:
    """Buffering, timeouts and back-off of the reporting client."""

    buffer_size: int = 10_000
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 5.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 30.0
    heartbeat_interval_s: float = 15.0  # 0 disables automatic heartbeats
    resign_after_s: float = 300.0

    def __post_init__(self) -> None:
        if self.buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {self.buffer_size}")
        if not (self.connect_timeout_s > 0 and self.read_timeout_s > 0):
            raise ValueError(f"timeouts must be > 0, got {self.connect_timeout_s}, {self.read_timeout_s}")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError(f"need 0 < backoff_initial_s <= backoff_max_s, got {self.backoff_initial_s}, "
                             f"{self.backoff_max_s}")
        if self.heartbeat_interval_s < 0:
            raise ValueError(f"heartbeat_interval_s must be >= 0, got {self.heartbeat_interval_s}")
        if self.resign_after_s <= 0:
            raise ValueError(f"resign_after_s must be > 0, got {self.resign_after_s}")


@dataclass(kw_only=True)
class ReportSenderStats:
    """Counters of what happened to reports so far."""

    queued: int = 0
    acknowledged: int = 0
    rejected: int = 0  # refused for good by the coordinator (4xx)
    dropped: int = 0  # thrown away locally because the queue was full or the input invalid
    attempts_failed: int = 0
    pending: int = 0


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


class ReportSender:
    """Background reporting client; see the module docstring for guarantees.

    :param on_result: optional callback ``(report, http_status)`` run on the sender thread for every final answer
    """

    def __init__(self, coordinator_url: str, identity: Identity, run_id: str, *,
                 config: ReportSenderConfig | None = None,
                 on_result: Callable[[Report, int], None] | None = None) -> None:
        self.url = coordinator_url.rstrip("/") + "/api/reports"
        self.identity, self.run_id = identity, run_id
        self.config = config or ReportSenderConfig()
        self.on_result = on_result
        self._queue: collections.deque[Report] = collections.deque()
        self._cond = threading.Condition()
        self._stats = ReportSenderStats()
        self._closing = False
        self._abort = False
        self._retry_now = False  # set by close(): one immediate attempt, skipping any back-off in progress
        self._thread: threading.Thread | None = None
        self._next_heartbeat = time.monotonic() + self.config.heartbeat_interval_s
        self._last_heartbeat_body: dict[str, Any] = {}
        self._warned_unreachable = False

    # -- public API (never blocks) ---------------------------------------------------------------------------

    def start(self) -> ReportSender:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="swarmloco-reporter", daemon=True)
            self._thread.start()
        return self

    def hello(self, *, version: str, device: str, memory_bytes: int, tokens_per_s: float,
              extra: Mapping[str, Any] | None = None) -> bool:
        """`extra`: optional schema fields (the accounting ones: device kind, session, pending tokens)."""
        return self._submit("hello", {"version": version, "device": device, "memory_bytes": int(memory_bytes),
                                      "tokens_per_s": _finite_or_none(tokens_per_s) or 0.0, **(extra or {})})

    def heartbeat(self, *, round: int | None = None, tokens_total: int | None = None) -> bool:
        self._last_heartbeat_body = {"round": round, "tokens_total": tokens_total}
        return self._submit("heartbeat", dict(self._last_heartbeat_body))

    def report_metrics(self, *, step: int, train_loss: float | None, tokens_per_s: float, tokens_total: int,
                       eval_loss: float | None = None, extra: Mapping[str, Any] | None = None) -> bool:
        self._last_heartbeat_body["tokens_total"] = int(tokens_total)
        body: dict[str, Any] = {"step": int(step), "train_loss": _finite_or_none(train_loss),
                                "tokens_per_s": _finite_or_none(tokens_per_s) or 0.0,
                                "tokens_total": int(tokens_total)}
        if eval_loss is not None:
            body["eval_loss"] = _finite_or_none(eval_loss)
        return self._submit("metrics", {**body, **(extra or {})})

    def report_round(self, *, round: int, members: Sequence[str], tokens: Sequence[int], state_hash: str | None,
                     train_s: float, wait_s: float, average_s: float, outcome: str,
                     failure_reason: str | None = None, eval_loss: float | None = None,
                     certificate: str | None = None, extra: Mapping[str, Any] | None = None) -> bool:
        self._last_heartbeat_body["round"] = int(round)
        body: dict[str, Any] = {
            "round": int(round), "members": list(members), "tokens": [int(t) for t in tokens],
            "state_hash": state_hash, "train_s": float(train_s), "wait_s": float(wait_s),
            "average_s": float(average_s), "outcome": outcome,
            "failure_reason": failure_reason[:1000] if failure_reason else failure_reason,
        }
        if eval_loss is not None:
            body["eval_loss"] = _finite_or_none(eval_loss)
        if certificate:  # the commit certificate's JSON: without it the coordinator does not credit the round
            body["certificate"] = certificate
        return self._submit("round", {**body, **(extra or {})})

    @property
    def stats(self) -> ReportSenderStats:
        with self._cond:
            return ReportSenderStats(**{**self._stats.__dict__, "pending": len(self._queue)})

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queue is empty (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def close(self, timeout: float = 5.0, *, reason: str | None = "shutdown") -> int:
        """Send a ``bye`` report, deliver what is queued within ``timeout`` seconds, stop; returns reports left."""
        if reason is not None and self._thread is not None:
            self._submit("bye", {"reason": bounded(reason, 200)})
        with self._cond:
            self._closing = True
            self._retry_now = True
            self._cond.notify_all()
        if self._thread is not None:
            self.flush(timeout)
            with self._cond:
                self._abort = True
                self._cond.notify_all()
            self._thread.join(max(0.0, min(timeout, self.config.connect_timeout_s + self.config.read_timeout_s)))
        left = self.stats.pending
        if left:
            logger.warning("reporter closed with %d report(s) not delivered to %s", left, self.url)
        return left

    # -- internals -------------------------------------------------------------------------------------------

    def _submit(self, kind: str, body: dict[str, Any]) -> bool:
        try:
            report = build_report(self.identity, self.run_id, kind, body)
        except (ReportError, ValueError, TypeError) as e:
            logger.warning("not reporting invalid %s report: %s", kind, e)
            with self._cond:
                self._stats.dropped += 1
            return False
        with self._cond:
            if self._closing and kind != "bye":
                self._stats.dropped += 1
                return False
            if len(self._queue) >= self.config.buffer_size and not self._make_room(kind):
                self._stats.dropped += 1
                return False
            self._queue.append(report)
            self._stats.queued += 1
            self._cond.notify_all()
        return True

    def _make_room(self, kind: str) -> bool:
        for i, queued in enumerate(self._queue):
            if queued.kind in _DROPPABLE and i > 0:  # never drop the head: it may be in flight
                del self._queue[i]
                self._stats.dropped += 1
                return True
        return False

    def _next_item(self, not_before: float) -> Report | None:
        """Wait for the next report to send; None when it is time to stop."""
        with self._cond:
            while not self._abort:
                now = time.monotonic()
                if (self.config.heartbeat_interval_s > 0 and now >= self._next_heartbeat and not self._closing
                        and len(self._queue) < self.config.buffer_size
                        and not any(r.kind == "heartbeat" for r in self._queue)):
                    self._next_heartbeat = now + self.config.heartbeat_interval_s
                    try:
                        self._queue.append(build_report(self.identity, self.run_id, "heartbeat",
                                                        dict(self._last_heartbeat_body)))
                        self._stats.queued += 1
                    except ReportError as e:
                        logger.debug("skipping heartbeat: %s", e)
                if self._queue and (now >= not_before or self._retry_now):
                    self._retry_now = False
                    return self._queue[0]
                if self._closing and not self._queue:
                    return None
                wake = [self._next_heartbeat] if self.config.heartbeat_interval_s > 0 else []
                if self._queue:
                    wake.append(not_before)
                self._cond.wait(max(0.01, min(wake) - now) if wake else 1.0)
        return None

    def _run(self) -> None:
        session = requests.Session()
        backoff, not_before = self.config.backoff_initial_s, 0.0
        try:
            while (report := self._next_item(not_before)) is not None:
                head = report
                if time.time() - report.timestamp > self.config.resign_after_s:
                    report = build_report(self.identity, self.run_id, report.kind, report.body, nonce=report.nonce)
                status = self._post(session, report)
                with self._cond:
                    final = status is not None and (200 <= status < 300 or (
                        400 <= status < 500 and status not in _RETRYABLE_4XX))
                    if final:
                        if self._queue and self._queue[0] is head:
                            self._queue.popleft()
                        if 200 <= status < 300:  # type: ignore[operator]
                            self._stats.acknowledged += 1
                        else:
                            self._stats.rejected += 1
                        self._cond.notify_all()
                    else:
                        self._stats.attempts_failed += 1
                        if self._queue and self._queue[0] is head and report is not head:
                            self._queue[0] = report  # keep the fresher signature for the next attempt
                if final:
                    backoff, not_before = self.config.backoff_initial_s, 0.0
                    if self.on_result is not None:
                        self.on_result(report, int(status))  # type: ignore[arg-type]
                else:
                    not_before = time.monotonic() + backoff * random.uniform(0.5, 1.0)
                    backoff = min(self.config.backoff_max_s, backoff * 2)
        except Exception:  # never let a bug here take the peer down; log it loudly instead
            logger.exception("reporter thread crashed; reports are no longer sent")
        finally:
            session.close()

    def _post(self, session: requests.Session, report: Report) -> int | None:
        try:
            resp = session.post(self.url, data=report.encode(), headers={"Content-Type": "application/json"},
                                timeout=(self.config.connect_timeout_s, self.config.read_timeout_s))
        except requests.RequestException as e:
            if not self._warned_unreachable:
                # Said once, at the first failure: a mistyped --coordinator should not wait for the exit to show.
                self._warned_unreachable = True
                logger.warning("cannot reach the coordinator at %s (%s): training goes on, reports are retried in "
                               "the background; check --coordinator", self.url.removesuffix("/api/reports"),
                               type(e).__name__)
            else:
                logger.debug("coordinator unreachable (%s); will retry", type(e).__name__)
            return None
        self._warned_unreachable = False  # reachable again: warn again if it goes away
        if 400 <= resp.status_code < 500 and resp.status_code not in _RETRYABLE_4XX:
            logger.warning("coordinator refused %s report %s: %d %s", report.kind, report.nonce, resp.status_code,
                           bounded(resp.text))
        return resp.status_code

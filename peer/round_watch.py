"""Watching the swarm while a round trains: the network loop's half of ending a round early.

The training thread can only look at the swarm between two steps, and on slow hardware (or a loaded machine) a step
takes seconds: a look submitted after one step and read after the next saw a forming group two steps late, and the
group's leader, whose grace waits only for peers that say they are about to be ready, had closed by then. So the
looking runs on the network loop on its own timer: every PEEK_S it reads the records and raises a flag once a group
for our round is forming or the swarm has moved past our state, and every ETA_EVERY_S it publishes when we expect to
be ready. The training thread reads the flag after each step: it stops at most one step after the look that saw the
group, and the ready time it promised counted that step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from swarmloco.protocol.network.transport import Transport

__all__ = ["ETA_EVERY_S", "PEEK_S", "RoundWatch"]
logger = logging.getLogger(__name__)
PEEK_S = 0.5  # how often a training peer looks whether a group for its round is forming
ETA_EVERY_S = 1.0  # how often it republishes its ready-time estimate


@dataclass
class RoundWatch:
    """One round's watch, started when its training starts and stopped when it ends.

    `eta`: the Unix time the round's budget will be spent, from measured step times. `forming`: one look at the
    swarm, True when training should stop now; None for a peer that always trains its whole budget. `step_s`: how
    long one step takes (the most a stop waits for the step in flight)."""

    node: Transport
    eta: Callable[[], float]
    forming: Callable[[], Awaitable[bool]] | None
    step_s: Callable[[], float]
    _seen: threading.Event = field(default_factory=threading.Event)
    _stopped: threading.Event = field(default_factory=threading.Event)
    _task: concurrent.futures.Future[None] | None = None

    def start(self) -> RoundWatch:
        self._task = self.node.submit(self._run())
        return self

    def seen(self) -> bool:
        """Whether a look saw a reason to stop training (thread-safe; read by the training thread)."""
        return self._seen.is_set()

    def stop(self) -> None:
        """End the watch; it publishes nothing after this returns (a change it queued before is applied first)."""
        self._stopped.set()
        if self._task is not None:
            self._task.cancel()

    def ready_at(self) -> float:
        """The ready time to publish: a peer that stops for forming groups joins one within a look and the rest of
        its current step, so it says so (a leader waits for a peer expected within its grace, not for others)."""
        if self._seen.is_set():
            return self.node.clock.time() + self.step_s()
        eta = self.eta()
        if self.forming is not None:
            eta = min(eta, self.node.clock.time() + 2 * PEEK_S + self.step_s())
        return eta

    def _publish(self) -> None:
        if self._stopped.is_set():
            return
        try:
            self.node.update_record(eta=self.ready_at())
        except Exception:  # the estimate reads the training thread's counters: never end the watch over one read
            logger.warning("publishing our ready time failed", exc_info=True)

    async def _run(self) -> None:
        await asyncio.gather(self._publishing(), self._looking())

    async def _publishing(self) -> None:
        while not self._stopped.is_set():
            self._publish()
            await asyncio.sleep(ETA_EVERY_S)

    async def _looking(self) -> None:
        while self.forming is not None and not self._seen.is_set() and not self._stopped.is_set():
            try:
                if await self.forming():
                    self._seen.set()
                    self._publish()
                    return
            except Exception as exc:  # a failed look only means: train on, look again
                logger.debug("looking at the swarm failed: %r", exc)
            await asyncio.sleep(PEEK_S)

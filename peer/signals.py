"""Graceful shutdown: the first SIGINT/SIGTERM asks the loop to stop at a safe point; the second forces exit."""
from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

logger = logging.getLogger(__name__)


class StopFlag:
    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: dict[int, object] = {}
        self._pid = os.getpid()

    def __bool__(self) -> bool:
        return self.event.is_set()

    def request(self, reason: str = "requested") -> None:
        if not self.event.is_set():
            logger.info("stopping (%s): finishing the current step, then checkpointing", reason)
        self.event.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            # A forked helper (hivemind's DHT process) inherited this handler: behave like a default process.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.event.is_set():
            logger.warning("second %s: exiting immediately", signal.Signals(signum).name)
            os._exit(130)
        self.request(signal.Signals(signum).name)

    def install(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

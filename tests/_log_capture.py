"""Catch what a server in this process logs at WARNING and above, uvicorn's loggers included (they do not
propagate to the root logger; "uvicorn.error" propagates to "uvicorn", which is watched)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def tracebacks(self) -> list[str]:
        return [r.getMessage()[:200] for r in self.records if r.exc_info or "Traceback" in r.getMessage()]


@contextmanager
def captured_logs() -> Iterator[Captured]:
    handler = Captured()
    watched = [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in watched:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in watched:
            logger.removeHandler(handler)

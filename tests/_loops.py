"""Running a coroutine in a test without `asyncio.run`, which ends with `set_event_loop(None)` and so breaks later
tests that build asyncio objects outside a loop."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on a fresh loop; cancel whatever it left running, then close the loop."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left, timeout=5))
        loop.close()

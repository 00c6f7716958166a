"""Waiting on a group's members without letting the slowest set the pace."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def gather_with_grace(coros: list[Awaitable[T]], *, have: int, need: int, floor: float) -> list[T | None]:
    """Await every coroutine, but once `need` results are in (counting `have` already held), give the rest at most
    max(floor, 2 × the time taken so far): a member that stalls its sends costs the round seconds, not its
    deadline. Results cut off are None (their coroutines are cancelled)."""
    clock = asyncio.get_running_loop()  # the transport's clock (virtual on the in-memory one)
    started = clock.time()
    tasks = [asyncio.ensure_future(c) for c in coros]
    pending = set(tasks)
    try:
        while pending:
            if have + len(tasks) - len(pending) >= need:
                grace = max(floor, 2 * (clock.time() - started))
                _, pending = await asyncio.wait(pending, timeout=grace)
                break
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in pending:
            t.cancel()
    return [None if t in pending or t.cancelled() else t.result() for t in tasks]

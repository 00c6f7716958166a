"""Keeping the cyclic garbage collector's full passes out of a round.

A full collection walks every object the interpreter tracks, and a peer holds a great many (torch, hivemind, the
model's modules): one pass holds the GIL for tens of milliseconds of CPU, over 100 ms of wall time on a loaded
machine. During a round every member waits for the slowest at each step, so one member's pass stalls the whole
group. Measured in `bench allreduce` (100 MiB, 4 peers on 2 cores): a full pass fell inside 2 of 16 peer-rounds
and took 117 and 124 ms, a quarter of the round.

`collector_paused()` turns automatic collection off for as long as any round of the process runs, and back on (if
it was on) when the last one ends; the collection that was due then runs at once, on whichever thread allocates
next, outside the round. Reference counting frees everything else meanwhile, so what a round can leave behind is its
cyclic garbage for the round's duration, which its deadlines bound.
"""
from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_rounds = 0  # rounds of this process now inside `collector_paused`
_resume = False  # whether automatic collection was on when the first of them began


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection inside the block (nesting and threads allowed)."""
    global _rounds, _resume
    with _lock:
        if _rounds == 0:
            _resume = gc.isenabled()
            gc.disable()
        _rounds += 1
    try:
        yield
    finally:
        with _lock:
            _rounds -= 1
            if _rounds == 0 and _resume:
                gc.enable()

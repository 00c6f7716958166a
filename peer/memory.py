"""Giving the memory a peer has freed back to the operating system, once a round.

glibc keeps what a long-running process frees: every thread that allocates gets an arena of its own, and once a
large block has been freed, blocks up to 32 MiB come from those arenas instead of mappings of their own (the
threshold adapts to spare page faults). A peer's rounds, audits and the state downloads it serves allocate and free
tens of MB on several threads, so its RSS creeps up by hundreds of MB that nothing uses. Measured on a tiny-model
peer serving 50 state downloads beside its rounds, beside two CPU burners: +160 to +340 MB; with
MALLOC_ARENA_MAX=2 and a fixed 1 MiB mmap threshold, +0 to +60 MB. A fixed threshold would make the training's own
allocations page-fault every step, so instead `malloc_trim(0)` after each round returns the free pages of every
arena, and keeps the threshold that makes them cheap. A no-op where the C library has no malloc_trim (macOS, musl).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; whether the C library could (tens of µs on a tiny peer here)."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True

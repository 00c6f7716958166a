"""Large receive buffers whose pages are made ready ahead of the bytes that will land in them.

A fresh buffer costs a page fault per 4 KiB page on its first write: for a 388 MiB state that is about 0.2 s of
kernel time, as long as the transfer itself on loopback. `prefaulted_buffer` maps anonymous memory and asks the
kernel to populate it (`MADV_POPULATE_WRITE`, Linux 5.14+) from a background thread, in order and in steps, so the
pages are ready before the receive reaches them and the faults run on another core. Where the kernel cannot (another
OS, an older kernel), the buffer is the same and its pages fault on first write as any buffer's do.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading

import numpy as np

__all__ = ["prefaulted_buffer"]

logger = logging.getLogger(__name__)
_MADV_POPULATE_WRITE = 23
_STEP = 16 << 20  # bytes per madvise call: the receive can start as soon as the first step is ready
_MIN_BYTES = 64 << 20  # smaller buffers fault in less time than a thread takes to start
_madvise = None
if sys.platform == "linux":
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # no libc symbol: plain buffers
        _madvise = None


def _populate(region: mmap.mmap, address: int, size: int) -> None:
    """On a daemon thread: populate the pages of `region` in order. Holding `region` keeps it mapped meanwhile."""
    assert _madvise is not None
    for offset in range(0, size, _STEP):
        if region.closed or _madvise(address + offset, min(_STEP, size - offset), _MADV_POPULATE_WRITE) != 0:
            logger.debug("page prefault stopped at %d of %d bytes (errno %d)", offset, size, ctypes.get_errno())
            return


def prefaulted_buffer(size: int) -> np.ndarray:
    """A writable uint8 array of `size` bytes, not zero-filled by us (the kernel's fresh pages are zeros), whose
    pages a background thread faults in ahead of use."""
    if size < _MIN_BYTES or _madvise is None:
        return np.empty(size, dtype=np.uint8)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(region, dtype=np.uint8)  # holds `region` for as long as the array (or a view of it) lives
    threading.Thread(target=_populate, args=(region, array.ctypes.data, size), name="swarmloco-prefault",
                     daemon=True).start()
    return array

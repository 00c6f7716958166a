"""Large buffers, and what their first write costs.

A fresh buffer costs a page fault per 4 KiB page on its first write: for a 388 MiB state that is about 0.2 s of
kernel time, as long as the transfer itself on loopback; a round of 100 MiB paid about 45 ms of faults for its
average alone, per member, every round.
- `large_buffer` and `large_empty` map anonymous memory on 2 MiB boundaries and ask for transparent huge pages
  (`MADV_HUGEPAGE`, for kernels where THP is "madvise"): 512 times fewer faults, 100 MiB written in about a fifth of
  the time. The round's received parts and results, its average and its reduced shard use them.
- `prefaulted_buffer` also asks the kernel to populate the pages (`MADV_POPULATE_WRITE`, Linux 5.14+) from a
  background thread, in order and in steps, so they are ready before a long receive (a state download) reaches them.
Where the kernel cannot (another OS, an older kernel, THP off), each is a plain buffer whose pages fault on first
write as any buffer's do.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading

import numpy as np
import torch

__all__ = ["large_buffer", "large_empty", "prefaulted_buffer"]

logger = logging.getLogger(__name__)
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
_HUGE_PAGE = 2 << 20
_MIN_HUGE_BYTES = 8 << 20  # below this, malloc's reused heap is cheaper than a fresh mapping
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


def _mapped(size: int) -> tuple[mmap.mmap, np.ndarray]:
    """`size` bytes of fresh anonymous memory starting on a huge-page boundary, asked to be backed by huge pages;
    the array holds the mapping for as long as it (or a view of it) lives."""
    assert _madvise is not None
    region = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(region, dtype=np.uint8)
    start = -whole.ctypes.data % _HUGE_PAGE
    array = whole[start : start + size]
    _madvise(array.ctypes.data, size, _MADV_HUGEPAGE)  # a refusal (THP off) leaves ordinary pages
    return region, array


def large_buffer(size: int) -> bytearray | memoryview:
    """A writable buffer of `size` bytes for a payload to land in (contents undefined)."""
    if size < _MIN_HUGE_BYTES or _madvise is None:
        return bytearray(size)
    return memoryview(_mapped(size)[1])


def large_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.empty(numel, dtype=dtype), on huge pages when it is large."""
    size = numel * dtype.itemsize
    if size < _MIN_HUGE_BYTES or _madvise is None:
        return torch.empty(numel, dtype=dtype)
    return torch.from_numpy(_mapped(size)[1]).view(dtype)


def prefaulted_buffer(size: int) -> np.ndarray:
    """A writable uint8 array of `size` bytes, not zero-filled by us (the kernel's fresh pages are zeros), whose
    pages a background thread faults in ahead of use."""
    if size < _MIN_BYTES or _madvise is None:
        return np.empty(size, dtype=np.uint8)
    region, array = _mapped(size)
    threading.Thread(target=_populate, args=(region, array.ctypes.data, size), name="swarmloco-prefault",
                     daemon=True).start()
    return array

"""Large buffers, and what their first write costs.

A fresh buffer costs a page fault per 4 KiB page on its first write: for a 388 MiB state that is about 0.2 s of
kernel time, as long as the transfer itself on loopback; a round of 100 MiB paid about 45 ms of faults for its
average alone, per member, every round, and as much again for the parts it received.
- `large_buffer` and `large_empty` hand out memory that a buffer now gone used before (`_Pool`): a round asks for
  about the same sizes every time, so from the second round on its parts, results, average and reduced shard land
  in pages already in place. A buffer's memory returns to the pool only once nothing refers to it any more.
- `prefaulted_buffer` asks the kernel to populate a fresh buffer's pages (`MADV_POPULATE_WRITE`, Linux 5.14+) from a
  background thread, in order and in steps, so they are ready before a long receive (a state download) reaches them.
  Where the kernel cannot (another OS, an older kernel), the buffer is the same and its pages fault on first write
  as any buffer's do.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading
import weakref

import numpy as np
import torch

__all__ = ["large_buffer", "large_empty", "prefaulted_buffer"]

logger = logging.getLogger(__name__)
_MADV_POPULATE_WRITE = 23
_STEP = 16 << 20  # bytes per madvise call: the receive can start as soon as the first step is ready
_MIN_BYTES = 64 << 20  # smaller buffers fault in less time than a thread takes to start
_MIN_POOLED = 8 << 20  # below this, malloc's own reuse of freed memory does the same
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


class _Pool:
    """Mappings of large buffers whose last user is gone, for the next buffer that fits one (at most twice its
    size): the smallest that fits is reused. The oldest go back to the kernel beyond `capacity` mappings, or beyond
    three times the largest mapping (about one round's working set: its average and its parts).

    A mapping is `HEADROOM` times the size first asked of it. Its pages beyond what a buffer writes cost nothing
    (they are never faulted in), and a later buffer up to that much larger still finds it: a round's shards change
    size from round to round with the members' bandwidth shares, and a member whose shard grew by a few percent
    otherwise mapped all four of its shard-sized buffers afresh (bench allreduce, 100 MiB, 4 peers: 6 of 20
    peer-rounds, 100-150 MiB of page faults each)."""

    HEADROOM = 1.5

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[mmap.mmap] = []  # oldest first
        self._largest = 0  # the largest mapping made
        self._lock = threading.Lock()

    def array(self, size: int) -> np.ndarray:
        """A writable uint8 array of `size` bytes (contents undefined)."""
        with self._lock:
            fits = [m for m in self._free if size <= len(m) <= 2 * size]
            region = min(fits, key=len) if fits else None
            if region is not None:
                self._free.remove(region)
        if region is None:
            mapped = -(-int(size * self.HEADROOM) // mmap.PAGESIZE) * mmap.PAGESIZE
            region = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with self._lock:
                self._largest = max(self._largest, mapped)
        array = np.frombuffer(region, dtype=np.uint8, count=size)  # holds the mapping while it, or a view, lives
        weakref.finalize(array, self._release, region)  # the finalizer holds the mapping, not the array
        return array

    def _release(self, region: mmap.mmap) -> None:
        with self._lock:
            self._free.append(region)
            del self._free[: max(0, len(self._free) - self.capacity)]
            while sum(map(len, self._free)) > 3 * self._largest:
                del self._free[0]

    def __len__(self) -> int:
        return len(self._free)


_POOL = _Pool(capacity=16)


def large_buffer(size: int) -> bytearray | memoryview:
    """A writable buffer of `size` bytes for a payload to land in (contents undefined)."""
    return bytearray(size) if size < _MIN_POOLED else memoryview(_POOL.array(size))


def large_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.empty(numel, dtype=dtype), a large one in memory that a buffer now gone used before."""
    size = numel * dtype.itemsize
    if size < _MIN_POOLED:
        return torch.empty(numel, dtype=dtype)
    return torch.from_numpy(_POOL.array(size)).view(dtype)

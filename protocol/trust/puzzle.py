"""The admission puzzle: a proof of work that makes a new identity in an ``open`` run cost CPU time.

A proof is a ``work`` string such that::

    sha256(DOMAIN || canonical JSON [run_id, peer_id, timestamp] || "\\n" || work)

has at least ``bits`` leading zero bits: about ``2**bits`` hashes to find, one hash to check. The challenge names
the run, the peer id and the signed ticket request's timestamp, so a proof buys one identity in one run only, and
it cannot be computed earlier than the request's timestamp window allows (an authority accepts a timestamp at most
a few minutes old, see protocol/trust/ticket_request.py). ``work`` is a decimal counter of at most
``MAX_WORK_CHARS`` digits.

Pure code: no I/O, no torch; ``solve`` is bounded by a time limit and a stop callback.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable

__all__ = [
    "DOMAIN",
    "MAX_BITS",
    "MAX_WORK_CHARS",
    "WORK_RE",
    "PuzzleTimeout",
    "check",
    "challenge",
    "hash_rate",
    "solve",
    "valid_bits",
]

DOMAIN = b"swarmloco-admission-puzzle-v1\n"
MAX_BITS = 40  # 2**40 hashes is days of one core: anything more is a mistake, or an authority that bars everyone
MAX_WORK_CHARS = 24  # a decimal counter: 13 digits reach 2**40, the rest is room for a solver's own numbering
WORK_RE = re.compile(rf"[0-9]{{0,{MAX_WORK_CHARS}}}")
_CHUNK = 4096  # hashes between two looks at the clock and the stop callback


class PuzzleTimeout(TimeoutError):
    """``solve`` ran out of time or was told to stop; ``hashes`` says how many it tried."""

    def __init__(self, message: str, hashes: int) -> None:
        super().__init__(message)
        self.hashes = hashes


def valid_bits(bits: object) -> bool:
    """Whether ``bits`` is a difficulty an authority may ask for (an int in 0..MAX_BITS; 0: no puzzle)."""
    return type(bits) is int and 0 <= bits <= MAX_BITS


def challenge(run_id: str, peer_id: str, timestamp: float) -> bytes:
    """The bytes every proof for this run, peer and request timestamp starts with."""
    fields = json.dumps([run_id, peer_id, float(timestamp)], separators=(",", ":"), allow_nan=False)
    return DOMAIN + fields.encode() + b"\n"


def _target(bits: int) -> bytes:
    """A digest has ``bits`` leading zero bits exactly when it sorts below this (both 32 bytes, big-endian)."""
    return (1 << (256 - bits)).to_bytes(32, "big")  # bits >= 1


def check(run_id: str, peer_id: str, timestamp: float, work: str, bits: int) -> bool:
    """Whether ``work`` proves ``bits`` bits of work for this run, peer and timestamp (always true for 0 bits)."""
    if not valid_bits(bits):
        raise ValueError(f"bits must be an int in 0..{MAX_BITS}, got {bits!r}")
    if bits == 0:
        return True
    if type(work) is not str or not work or not WORK_RE.fullmatch(work):
        return False
    return hashlib.sha256(challenge(run_id, peer_id, timestamp) + work.encode()).digest() < _target(bits)


def solve(run_id: str, peer_id: str, timestamp: float, bits: int, *, max_s: float,
          stop: Callable[[], bool] | None = None, clock: Callable[[], float] = time.monotonic) -> str:
    """A ``work`` string that passes :func:`check` ("" for 0 bits); about ``2**bits`` hashes.

    :raises PuzzleTimeout: after ``max_s`` seconds, or as soon as ``stop()`` returns true (looked at every few
        thousand hashes, a few milliseconds)
    """
    if not valid_bits(bits):
        raise ValueError(f"bits must be an int in 0..{MAX_BITS}, got {bits!r}")
    if bits == 0:
        return ""
    prefix = hashlib.sha256(challenge(run_id, peer_id, timestamp))
    target = _target(bits)
    deadline = clock() + max_s
    counter = 0
    while True:
        found = _scan(prefix, target, counter)
        if found is not None:
            return str(found)
        counter += _CHUNK
        if clock() >= deadline or (stop is not None and stop()):
            why = "was stopped" if clock() < deadline else f"found no proof within {max_s:g}s"
            raise PuzzleTimeout(f"the {bits}-bit admission puzzle {why} ({counter} hashes tried)", counter)


def _scan(prefix: hashlib._Hash, target: bytes, start: int) -> int | None:
    """The first counter in [start, start + _CHUNK) whose digest sorts below `target`, if any: the solver's loop."""
    for n in range(start, start + _CHUNK):
        h = prefix.copy()
        h.update(b"%d" % n)
        if h.digest() < target:
            return n
    return None


def hash_rate(sample_s: float = 0.2, *, clock: Callable[[], float] = time.perf_counter) -> float:
    """Hashes a second :func:`solve` manages on this machine, measured for about ``sample_s`` seconds."""
    prefix = hashlib.sha256(challenge("rate", "rate", 0.0))
    never = b"\x00" * 32  # no digest sorts below it: the loop does the solver's work without ever stopping early
    hashes, start = 0, clock()
    while True:
        _scan(prefix, never, hashes)
        hashes += _CHUNK
        elapsed = clock() - start
        if elapsed >= sample_s:
            return hashes / elapsed

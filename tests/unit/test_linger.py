"""How long a peer that finished its rounds keeps serving its state: the whole --linger for joiners that may come,
or, in a swarm of known size (--wait-for-peers N), until all N peers are at its round."""
from __future__ import annotations

import threading
import time

from _records import rec as record

from swarmloco.peer.swarm_state import caught_up, linger_for_peers


def test_caught_up_needs_every_peer_at_our_round_and_the_whole_swarm_seen() -> None:
    at_3 = {"b": record(round=3), "c": record(round=4)}
    assert caught_up(at_3, round_=3, wanted=3)
    assert not caught_up(at_3, round_=3, wanted=4)  # a fourth peer is not seen: it may be behind
    assert not caught_up({**at_3, "d": record(round=2)}, round_=3, wanted=3)  # d may still fetch our state
    assert not caught_up({}, round_=3, wanted=2)  # the read failed, or nobody is left to tell


def _timed(wanted: int, records: dict[str, object], seconds: float = 3.0) -> tuple[float, int]:
    reads = 0

    def read() -> dict[str, object]:
        nonlocal reads
        reads += 1
        return records

    started = time.monotonic()
    linger_for_peers(seconds, round_=3, wanted=wanted, read=read, stop=threading.Event(),  # type: ignore[arg-type]
                     poll_s=0.05)
    return time.monotonic() - started, reads


def test_a_swarm_of_known_size_leaves_once_everyone_caught_up() -> None:
    took, reads = _timed(3, {"b": record(round=3), "c": record(round=3)}, seconds=30.0)
    assert took < 15 and reads == 1


def test_a_laggard_or_an_open_swarm_keeps_the_peer_the_whole_linger() -> None:
    took, reads = _timed(3, {"b": record(round=3), "c": record(round=2)}, seconds=0.5)
    assert took >= 0.5 and reads >= 2  # c may still fetch our state
    took, reads = _timed(0, {"b": record(round=3)}, seconds=0.5)
    assert took >= 0.5 and reads == 0  # a donor for joiners that may come later


def test_a_stop_request_ends_the_linger() -> None:
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    linger_for_peers(60.0, round_=3, wanted=0, read=dict, stop=stop)
    assert time.monotonic() - started < 30

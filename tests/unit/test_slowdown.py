"""`--slowdown` emulates slower hardware by sleeping after each step in proportion to it. A step that took far
longer than the ones before it (the process was SIGSTOPped, the laptop slept) must not stretch the sleep: a peer
stopped for 30 s at slowdown 3 slept another 60 s, and missed every round meanwhile."""
from __future__ import annotations

import collections

import pytest

from swarmloco.peer.training import slowdown_sleep


def test_each_step_is_followed_by_slowdown_minus_one_times_itself() -> None:
    recent: collections.deque[float] = collections.deque(maxlen=16)
    assert [slowdown_sleep(s, recent, 3.0) for s in (0.1, 0.12, 0.09)] == pytest.approx([0.2, 0.24, 0.18])


def test_a_step_that_spanned_a_stop_sleeps_no_longer_than_twice_a_usual_one() -> None:
    recent: collections.deque[float] = collections.deque([0.1] * 10, maxlen=16)
    assert slowdown_sleep(30.0, recent, 3.0) == pytest.approx(0.4)
    assert slowdown_sleep(0.1, recent, 3.0) == pytest.approx(0.2)  # and the next one is back to normal

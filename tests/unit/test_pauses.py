"""`collector_paused`: no automatic garbage collection while any round of the process runs, and the collector's
state as it was once the last one ends."""
from __future__ import annotations

import gc
import threading

import pytest
import torch
from _fake_rounds import H0, Applied, peers, run

from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.base.pauses import collector_paused
from swarmloco.protocol.round.averager import RoundResult
from swarmloco.protocol.round.groups import Group


@pytest.fixture(autouse=True)
def _restore_collector():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_a_round_runs_without_automatic_collection_and_turns_it_back_on():
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_collector_stays_off_until_the_last_of_overlapping_rounds_ends():
    gc.enable()
    first_in, second_done, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def other_round() -> None:
        with collector_paused():
            first_in.set()
            second_done.wait(5)
        first_out.set()

    thread = threading.Thread(target=other_round)
    thread.start()
    assert first_in.wait(5)
    with collector_paused():
        seen.append(gc.isenabled())
    seen.append(gc.isenabled())  # the other round still runs
    second_done.set()
    assert first_out.wait(5)
    thread.join(5)
    assert seen == [False, False]
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off():
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_an_error_inside_the_round_still_turns_the_collector_back_on():
    gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("round failed")
    assert gc.isenabled()


def test_a_round_applies_its_average_with_the_collector_off(net):
    """The wiring: `Averager.run_round` holds the pause for the whole round, the outer step included."""
    gc.enable()
    averagers = peers(net, 3, quorum=2)
    watching = [Watching() for _ in averagers]

    def one(i: int) -> RoundResult:
        found = averagers[i].find_group(0, H0).result(timeout=10)
        assert isinstance(found, Group), found
        return run(averagers[i], found, i, watching[i])

    with net.pool(len(averagers)) as pool:
        results = list(pool.map(one, range(len(averagers))))
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3, [r.reason for r in results]
    assert [w.collector_on for w in watching] == [[False]] * 3
    assert gc.isenabled()


class Watching(Applied):
    """An outer step that notes whether automatic collection was on when it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.collector_on: list[bool] = []

    def __call__(self, average: torch.Tensor) -> str:
        self.collector_on.append(gc.isenabled())
        return super().__call__(average)

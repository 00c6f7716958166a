"""The in-memory transport's virtual clock: time passes only when every peer waits, so no timeout of a fake-network
test expires because the machine was busy (each test here fails on the machine's clock: `virtual=False`)."""
from __future__ import annotations

import asyncio
import time

import pytest

from swarmloco.protocol.testing import virtual_time
from swarmloco.protocol.testing.fake import FakeNetwork

BUSY_S = 0.3  # real seconds of work, three times the virtual timeout each test sets against it


@pytest.mark.parametrize("virtual", [True, False], ids=["virtual", "machine-clock"])
def test_a_timeout_never_expires_while_the_driving_thread_works(virtual: bool) -> None:
    """A peer's timeout of 0.1 s, and its driving thread busy for 0.3 s before it answers: on the virtual clock the
    answer is in time, however long the work took in real time."""
    with FakeNetwork(virtual=virtual) as net:
        answered = asyncio.Event()  # used only on the loop

        async def wait_for_answer() -> bool:
            try:
                await asyncio.wait_for(answered.wait(), 0.1)
                return True
            except TimeoutError:
                return False

        waiting = net.submit(wait_for_answer())
        time.sleep(BUSY_S)  # the training thread's work (a real sleep holds the virtual clock still)
        net.loop.call_soon_threadsafe(answered.set)
        in_time = waiting.result(timeout=5)
    assert in_time is virtual


@pytest.mark.parametrize("virtual", [True, False], ids=["virtual", "machine-clock"])
def test_an_executor_job_holds_the_clock_until_its_result_is_back(virtual: bool) -> None:
    """Work a coroutine hands to a thread (hashing, reducing, auditing) counts as running: a 0.1 s timer elsewhere
    on the loop fires only after the 0.3 s job's result reached its coroutine."""
    with FakeNetwork(virtual=virtual) as net:
        done: list[str] = []

        async def job() -> None:
            await asyncio.get_running_loop().run_in_executor(None, time.sleep, BUSY_S)
            done.append("job")

        async def timer() -> None:
            await asyncio.sleep(0.1)
            done.append("timer")

        async def both() -> None:
            await asyncio.gather(job(), timer())

        net.call(both(), timeout=5)
    assert done == (["job", "timer"] if virtual else ["timer", "job"])


def test_waiting_peers_let_an_hour_pass_at_once() -> None:
    with FakeNetwork() as net:
        clock = net.clock
        began, began_wall, real = clock.monotonic(), clock.time(), time.monotonic()
        slept = net.submit(asyncio.sleep(3600, result="woke"))
        assert slept.result(timeout=7200) == "woke"
        net.sleep(600)
        assert clock.monotonic() - began == pytest.approx(4200)
        assert clock.time() - began_wall == pytest.approx(4200)  # the wall clock moves with it
    assert time.monotonic() - real < 5


def test_a_result_waited_for_with_a_timeout_times_out_in_virtual_time() -> None:
    with FakeNetwork() as net:
        never = net.submit(asyncio.Event().wait())
        began = net.clock.monotonic()
        with pytest.raises(TimeoutError):
            never.result(timeout=30)
        assert net.clock.monotonic() - began == pytest.approx(30)
        never.cancel()
        with pytest.raises(TimeoutError):  # `call` cancels what ran out of time, as on the real transport
            net.call(asyncio.sleep(10), timeout=2)
        assert net.clock.monotonic() - began == pytest.approx(32)


def test_driving_pool_workers_hold_the_clock_and_their_results_park_the_waiter() -> None:
    """Peers driven from worker threads: each one's work holds time still (here: 0.3 s of real work against a
    0.1 s timer on the loop), and the thread waiting for their results lets time pass meanwhile."""
    with FakeNetwork() as net:
        fired = net.submit(asyncio.sleep(0.1, result="fired"))

        def work(i: int) -> tuple[int, bool]:
            time.sleep(BUSY_S)
            return i, fired.done()

        with net.pool(2) as pool:
            results = list(pool.map(work, range(2)))
        assert results == [(0, False), (1, False)]  # the timer could not fire during either worker's work
        assert fired.result(timeout=1) == "fired"  # and fires once they are done and everyone waits


def test_a_driving_thread_blocked_outside_the_clock_is_an_error_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(virtual_time, "REAL_LIMIT_S", 0.5)
    with FakeNetwork() as net:
        forever = net.submit(asyncio.Event().wait())  # nothing will ever set it, and no timer is left to jump to
        with pytest.raises(TimeoutError, match="real time"):
            forever.result()
        forever.cancel()

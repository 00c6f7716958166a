"""A virtual clock for the in-memory transport: time moves only when nothing is left to run.

The fake peers' round logic runs partly on one asyncio loop and partly on the threads that drive the peers (the
training threads of real peers: they apply outer steps and hand coroutines to the loop). On the machine's clock a
timeout there expires whenever the machine is slow enough, so a test's outcome would depend on the load beside it.
Here the loop's clock is a counter that jumps to the next timer only when

- the loop has nothing ready to run,
- no job it handed to an executor thread is running (`run_in_executor`: hashing, reducing, auditing), and
- every *driving* thread is parked in a wait the clock knows of.

A driving thread is one that entered `VirtualClock.driving()` (the thread that opened the `FakeNetwork`, and the
workers of `FakeNetwork.pool`). It is parked while it waits through the clock: `FakeNetwork.call`, the result of
a future from `FakeTransport.submit` or `FakeNetwork.pool`, `FakeNetwork.sleep` and `FakeNetwork.until`. A
driving thread that blocks any other way (`time.sleep`, a plain `threading.Event.wait`) holds the clock still, so
a test that waits that way for something that needs time to pass stops there; `REAL_LIMIT_S` turns that into an
error instead of a hang.

So a round's timeouts, views and grace windows fire in the same order on a busy machine as on an idle one, and a
test that waits 30 virtual seconds for a view to expire takes milliseconds.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import selectors
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

REAL_LIMIT_S = 60.0  # real seconds a parked thread waits before its wait fails: a test that can never go on
_POLL_REAL_S = 0.05  # how long the loop blocks for real while some thread works (it is woken sooner when it parks)


class VirtualClock:
    """Virtual monotonic and wall time, and the count of what is running (the loop advances it only at zero)."""

    def __init__(self) -> None:
        self._now = 0.0
        self._wall0 = time.time()  # the virtual wall clock starts at the real one: records' times look plausible
        self._lock = threading.Lock()
        self._busy = 0
        self._local = threading.local()
        self.loop: asyncio.AbstractEventLoop | None = None

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._wall0 + self._now

    # --- what is running ----------------------------------------------------------------------------------------
    def hold(self) -> None:
        with self._lock:
            self._busy += 1

    def release(self) -> None:
        with self._lock:
            self._busy -= 1
            assert self._busy >= 0, "virtual clock: released more than held"
            idle = self._busy == 0
        loop = self.loop
        if idle and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_nothing)  # wake it: time may move now

    def advance_if_idle(self, seconds: float) -> bool:
        """On the loop thread: jump `seconds` ahead if nothing is running; whether it did."""
        with self._lock:
            if self._busy:
                return False
            self._now += seconds
            return True

    @property
    def driving(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def drive(self, *, held: bool = False) -> Iterator[None]:
        """This thread drives peers: the clock stands still while it works, except while it waits through the
        clock. `held`: the hold was already taken for it (by whoever handed it the work, so that no instant
        passes in which nothing is counted)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth == 0 and not held:
            self.hold()
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                self.release()

    # --- waiting ------------------------------------------------------------------------------------------------
    def wait(self, future: concurrent.futures.Future[Any], timeout: float | None) -> bool:
        """Wait until `future` is done or `timeout` virtual seconds pass; whether it is done. A driving thread
        counts as parked meanwhile, and as working again from the instant the future completes (on the loop
        thread, before the loop could move time on)."""
        if future.done():
            return True
        loop = self.loop
        assert loop is not None
        driving = self.driving
        woke = threading.Event()
        resumed = [False]
        timers: list[asyncio.TimerHandle] = []

        def resume(_: object = None) -> None:
            with self._lock:
                if resumed[0]:
                    return
                resumed[0] = True
                if driving:
                    self._busy += 1
            woke.set()

        if timeout is not None:  # armed before we park, so no time passes between our `now` and the timer's
            loop.call_soon_threadsafe(lambda: timers.append(loop.call_later(max(0.0, timeout), resume)))
        # Resumed (counted as working) by whichever comes first; only then parked, so that a future completing in
        # between cannot leave an instant in which this thread counts as neither.
        future.add_done_callback(resume)
        if driving:
            self.release()
        if not woke.wait(REAL_LIMIT_S):
            resume()
            raise TimeoutError(f"virtual clock: nothing this thread waits for happened in {REAL_LIMIT_S:.0f}s of "
                               "real time (is a driving thread blocked outside the clock?)")
        if timers:
            loop.call_soon_threadsafe(timers[0].cancel)
        return future.done()

    def sleep(self, seconds: float) -> None:
        """Let `seconds` of virtual time pass (the peers run meanwhile)."""
        self.wait(concurrent.futures.Future(), seconds)


def _nothing() -> None:
    pass


class ParkingFuture(concurrent.futures.Future[Any]):
    """A future whose `result` waits through the virtual clock, for `timeout` virtual seconds."""

    def __init__(self, clock: VirtualClock, inner: concurrent.futures.Future[Any] | None = None) -> None:
        super().__init__()
        self.clock, self._inner = clock, inner
        if inner is not None:
            inner.add_done_callback(self._copy)

    def _copy(self, inner: concurrent.futures.Future[Any]) -> None:
        if inner.cancelled():
            super().cancel()
            self.set_running_or_notify_cancel()
        elif inner.exception() is not None:
            self.set_exception(inner.exception())
        else:
            self.set_result(inner.result())

    def cancel(self) -> bool:
        if self._inner is not None:
            return self._inner.cancel()
        return super().cancel()

    def result(self, timeout: float | None = None) -> Any:
        if not self.clock.wait(self, timeout):
            raise TimeoutError(f"not done within {timeout}s of virtual time")
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.clock.wait(self, timeout):
            raise TimeoutError(f"not done within {timeout}s of virtual time")
        return super().exception(0)


class DrivingPool(concurrent.futures.Executor):
    """Worker threads that drive peers: each job counts as running from its submission until its future is done,
    and its result is waited for through the clock."""

    def __init__(self, clock: VirtualClock, workers: int) -> None:
        self.clock = clock
        self._threads = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="fake-driver")
        self._futures: list[ParkingFuture] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> ParkingFuture:
        future = ParkingFuture(self.clock)
        self.clock.hold()  # taken here: the work counts before its thread starts

        def job() -> None:
            with self.clock.drive(held=True):  # released once the result is set, and waiters resumed
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # handed to whoever waits on the future
                    future.set_exception(exc)
                else:
                    future.set_result(result)

        self._futures.append(future)
        self._threads.submit(job)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if wait:
            for future in self._futures:
                self.clock.wait(future, None)
        self._threads.shutdown(wait=wait, cancel_futures=cancel_futures)


class _Selector(selectors.BaseSelector):
    """The loop's selector: where the loop would sleep until its next timer, time jumps there instead, when
    nothing is running; while something is, the loop waits for real (woken when it parks), and time stands."""

    def __init__(self, inner: selectors.BaseSelector, clock: VirtualClock) -> None:
        self.inner, self.clock = inner, clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return self.inner.select(0)
        if timeout is not None and self.clock.advance_if_idle(timeout):
            return self.inner.select(0)
        return self.inner.select(_POLL_REAL_S)

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self.inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self.inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self.inner.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self.inner.get_map()

    def close(self) -> None:
        self.inner.close()


class VirtualLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on `clock`: its `time()` is virtual, and executor jobs count as running."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock
        clock.loop = self
        self._selector = _Selector(self._selector, clock)  # type: ignore[has-type]
        self._jobs = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="fake-net-job")

    def time(self) -> float:
        return self.clock.monotonic()

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        self.clock.hold()
        done = (executor or self._jobs).submit(func, *args)
        result = asyncio.wrap_future(done, loop=self)
        # Released only after the callback `wrap_future` added has handed the result to the loop (callbacks run in
        # order): until the loop takes it, `_ready` is not empty, so no time passes between the job and its result.
        done.add_done_callback(lambda _: self.clock.release())
        return result

    def close(self) -> None:
        super().close()
        self._jobs.shutdown(wait=False, cancel_futures=True)

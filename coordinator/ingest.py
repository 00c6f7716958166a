"""The coordinator's ingest pipeline: reports from many connections verified in parallel and stored in batches.

The event loop hands each report's bytes to a verifier thread (size, JSON, schema and the Ed25519 check, which
releases the GIL, so that verifiers use more than one core), and each verified report to the one writer thread. The
writer takes every report waiting (at most ``max_batch``), checks each against the store as
:meth:`CoordinatorService.ingest` does (known nonce, timestamp, ticket, the peer's rate, commit certificate) and
stores them in one transaction: one commit and one fsync for the batch, a savepoint for each report. No answer is
given before that commit is over, so a 200 still means the report is durable. While the writer fsyncs, the next
reports are verified and queue up: the busier the coordinator, the larger its batches.

Everything is bounded: at most ``max_pending`` reports are in the pipeline (more are answered 503, retry later), and
a caller waits at most ``answer_timeout_s`` for its answer (then 503; a retry of the same report gets the stored
answer, since its nonce makes it idempotent).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from swarmloco.coordinator.authority import Answer
from swarmloco.coordinator.service import CoordinatorService, Parsed
from swarmloco.coordinator.store import PendingReport

__all__ = ["IngestConfig", "IngestPipeline", "unexpected"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class IngestConfig:
    """How many threads verify reports, and how much the pipeline holds."""

    verifiers: int = 2  # threads that parse and verify (0: the writer does it too)
    max_pending: int = 4096  # reports received and not yet answered; more are answered 503
    max_batch: int = 1024  # reports in one transaction
    answer_timeout_s: float = 30.0  # how long a request waits for its answer before a 503

    def __post_init__(self) -> None:
        if not 0 <= self.verifiers <= 64:
            raise ValueError(f"verifiers must be in [0, 64], got {self.verifiers}")
        if not 1 <= self.max_pending <= 1_000_000:
            raise ValueError(f"max_pending must be in [1, 1000000], got {self.max_pending}")
        if not 1 <= self.max_batch <= 100_000:
            raise ValueError(f"max_batch must be in [1, 100000], got {self.max_batch}")
        if not 0.1 <= self.answer_timeout_s <= 3600:
            raise ValueError(f"answer_timeout_s must be in [0.1, 3600], got {self.answer_timeout_s}")


def unexpected(exc: BaseException | None) -> Answer:
    """The answer to a failure on the coordinator's side: retryable (503), as the HTTP layer answers one."""
    name = type(exc).__name__ if exc is not None else "no result"
    return Answer(status=503, body={"error": f"coordinator error ({name}); retry later"})


BUSY = Answer(status=503, body={"error": "coordinator busy: too many reports in flight; retry with back-off"})
STOPPED = Answer(status=503, body={"error": "coordinator is stopping; retry later"})


def _give_up(future: asyncio.Future[Answer], answer: Answer) -> None:
    if not future.done():
        future.set_result(answer)


@dataclass(eq=False, slots=True)
class _Job:
    """One report on its way through the pipeline, and the future its request awaits."""

    raw: bytes
    client: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Answer]
    parsed: Parsed | None = None


class IngestPipeline:
    """Verifier threads and one writer thread in front of ``service``'s store; :meth:`submit` from an event loop."""

    def __init__(self, service: CoordinatorService, config: IngestConfig | None = None) -> None:
        self.service, self.config = service, config or IngestConfig()
        # Both queues together hold at most max_pending jobs: submit counts them in before it enqueues.
        self._raw: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._verified: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._count_lock = threading.Lock()
        self._pending = 0
        self._stopped = False
        self._late = Answer(status=503, body={"error": f"no answer within {self.config.answer_timeout_s:g}s; retry "
                                                       "(a retry of the same report gets its stored answer)"})
        self.batches = 0  # transactions the writer ran (for the benchmark and tests)
        self._verifiers = [threading.Thread(target=self._verify_loop, name=f"ingest-verify-{i}", daemon=True)
                           for i in range(self.config.verifiers)]
        self._writer = threading.Thread(target=self._write_loop, name="ingest-writer", daemon=True)
        self._started = False

    def start(self) -> IngestPipeline:
        if not self._started:
            self._started = True
            for t in (*self._verifiers, self._writer):
                t.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Answer what is queued (the writer finishes its batches), then end the threads."""
        with self._count_lock:
            self._stopped = True
        if not self._started:
            return
        for _ in self._verifiers:
            self._raw.put(None)
        for t in self._verifiers:
            t.join(timeout)
        self._verified.put(None)
        self._writer.join(timeout)

    async def submit(self, raw: bytes, *, client: str = "?") -> Answer:
        """The answer to one report, once it is refused or durably stored."""
        with self._count_lock:
            if self._stopped:
                return STOPPED
            if self._pending >= self.config.max_pending:
                return BUSY
            self._pending += 1
        loop = asyncio.get_running_loop()
        job = _Job(raw, client, loop, loop.create_future())
        (self._raw if self._verifiers else self._verified).put(job)
        # a timer rather than asyncio.wait_for, which costs a task's worth of bookkeeping on every report
        timer = loop.call_later(self.config.answer_timeout_s, _give_up, job.future, self._late)
        try:
            return await job.future
        finally:
            timer.cancel()

    # -- threads ---------------------------------------------------------------------------------------------

    def _parse(self, job: _Job) -> Answer | None:
        try:
            parsed = self.service.parse(job.raw, client=job.client)
        except Exception as exc:
            logger.exception("unexpected error while verifying a report")
            return unexpected(exc)
        if isinstance(parsed, Answer):
            return parsed
        job.parsed = parsed
        return None

    def _verify_loop(self) -> None:
        while (job := self._raw.get()) is not None:
            refusal = self._parse(job)
            if refusal is not None:
                self._answer([(job, refusal)])
            else:
                self._verified.put(job)

    def _write_loop(self) -> None:
        stopping = False
        while not stopping:
            job = self._verified.get()
            if job is None:
                break
            batch = [job]
            while len(batch) < self.config.max_batch:
                try:
                    job = self._verified.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                batch.append(job)
            try:
                self._write(batch)
            except BaseException as exc:  # never leave a caller without an answer
                logger.exception("ingest writer failed")
                self._answer([(j, unexpected(exc)) for j in batch if not j.future.done()])

    def _write(self, batch: Sequence[_Job]) -> None:
        """Check each report against the store, store those that pass in one transaction, then answer them all."""
        answers: list[tuple[_Job, Answer]] = []
        items: list[tuple[_Job, PendingReport]] = []
        for job in batch:
            if job.parsed is None and (refusal := self._parse(job)) is not None:  # no verifier threads
                answers.append((job, refusal))
                continue
            assert job.parsed is not None
            try:
                checked = self.service.check(job.parsed)
            except Exception as exc:
                logger.exception("unexpected error while admitting a report")
                checked = unexpected(exc)
            if isinstance(checked, Answer):
                answers.append((job, checked))
            else:
                items.append((job, checked))
        if items:
            try:
                self.service.store.add_reports([item for _, item in items])
            except Exception as exc:
                logger.exception("unexpected error while storing reports")
                for _, item in items:
                    item.error = item.error or exc
            self.batches += 1
            for job, item in items:
                if item.error is not None or item.result is None:
                    if item.error is not None:
                        logger.error("a report could not be stored: %r", item.error)
                    answers.append((job, unexpected(item.error)))
                else:
                    assert job.parsed is not None
                    answers.append((job, self.service.stored(item.result, job.parsed.digest)))
        self._answer(answers)

    def _answer(self, answers: Sequence[tuple[_Job, Answer]]) -> None:
        """Hand answers to their event loops: one wake-up per loop for the whole batch."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Job, Answer]]] = {}
        for job, answer in answers:
            by_loop.setdefault(job.loop, []).append((job, answer))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._settle, pairs)
            except RuntimeError:  # the loop is closed: nobody waits for these answers any more
                self._release(len(pairs))

    def _settle(self, pairs: Sequence[tuple[_Job, Answer]]) -> None:
        for job, answer in pairs:
            if not job.future.done():  # not given up on (timed out, or the request was cancelled)
                job.future.set_result(answer)
        self._release(len(pairs))

    def _release(self, n: int) -> None:
        with self._count_lock:
            self._pending -= n

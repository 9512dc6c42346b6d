"""The two threads that keep the session busy: while the main thread checks and runs a batch (ONNX
Runtime releases the GIL in ``Run``), the **feeder** already takes and reads the next one, and the
**replier** encodes the previous one's answers and writes them. Only the main thread calls
``Run``: still one session, one ``Run`` at a time. The main thread checks each batch (decode, the
model's signature) itself: the feeder then spends its time in Redis round trips, and its start
script is on its way while the main thread still works on the batch before (under the GIL, one
thread computes at a time).

At most one batch waits beside the one running, and a second only while the queue has a backlog
(the last start left jobs on it; ``Slots``): a worker takes no more jobs than it is about to run,
so that its neighbours on the queue are not starved. Each thread has its own Redis connection. A
job is held (its records kept fresh by the heartbeat) from its start until it is answered, handed
on or released (ortq.worker.ownership, whose rule every path here keeps); the scripts are fenced,
so a job taken back from this worker meanwhile is answered once all the same.

A thread that dies ends the worker: the feeder's death ends the main thread's loop once the
batches already taken have run, and the replier's makes the main thread answer what is left
itself, then end (exit status 1; the pool starts a fresh process).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ortq import tracing
from ortq.errors import ConfigurationError
from ortq.metrics import WorkerMetrics
from ortq.redisfaults import is_refused
from ortq.replication import ConfirmRefused
from ortq.rqcompat.acl import refused_command
from ortq.rqcompat.book import Book, Finished, StartedJob
from ortq.settings import REDIS_DOWN, Settings, redis_message
from ortq.worker import jobs
from ortq.worker.intake import Intake, Taken
from ortq.worker.ownership import Left, hand_on
from ortq.worker.presence import Presence
from ortq.worker.upkeep import Upkeep, despite_outage

log = logging.getLogger("ortq.worker")

#: Unexpected errors in a row (none of Redis being down, none of a job's own) that end a thread, and
#: with it the worker (exit 1, for its supervisor to start a fresh one).
MAX_UNEXPECTED = 5


@dataclass
class Outcome:
    """What a batch came to, for the replier: outputs to answer with, failures, and every job it held."""

    held: list[StartedJob]
    computed: list[jobs.Computed] = field(default_factory=list)
    failures: list[jobs.Failure] = field(default_factory=list)
    trace: tracing.BatchTrace | None = None  # its spans' makings, when the worker traces (docs/tracing.md)


#: Ends a queue between the threads.
END = None


@dataclass(slots=True)
class TakenBatch:
    """Jobs one take started, with their frames, for the main thread to check (jobs.check_batch) and run."""

    taken: list[Taken]
    batch_wait: float  # seconds the take waited for more jobs after its first (a timing of each job)


class Slots:
    """Batches taken and not yet run: the feeder takes one more only while fewer than its limit are."""

    def __init__(self) -> None:
        self._taken = 0
        self._changed = threading.Condition()

    def acquire(self, limit: int, timeout: float) -> bool:
        """Count one more batch once fewer than ``limit`` are; False if that took past ``timeout``."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._taken < limit, timeout):
                return False
            self._taken += 1
            return True

    def release(self) -> None:
        with self._changed:
            self._taken -= 1
            self._changed.notify()


#: Batches in hand at most (running, waiting, being taken): two, three while the queue has a backlog.
SLOTS, SLOTS_WITH_BACKLOG = 2, 3
#: Batches run and waiting for the replier at most. Past it the main thread waits, and the feeder
#: with it (no slot is released): a replier behind the runs (Redis busy with this and other
#: workers' scripts) leaves no pile of computed, unanswered jobs (every heartbeat refreshes each
#: held job's records, and a crash would run them all again).
REPLIES_WAITING = 2


class Threads:
    """What the feeder, the replier and the main thread share."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.slots = Slots()
        self.batches: queue.Queue[TakenBatch | None] = queue.Queue()
        self.replies: queue.Queue[Outcome | None] = queue.Queue(maxsize=REPLIES_WAITING)
        #: The error that ended a thread (raised by the main thread), if any.
        self.fatal: BaseException | None = None
        #: Set when the GPU is gone: the feeder gives back what it takes instead of queueing it.
        self.device_lost = threading.Event()
        #: Set when the replier thread has died: nothing handed to it would be answered.
        self.replier_dead = threading.Event()

    def reply_later(self, outcome: Outcome | None) -> bool:
        """Hand ``outcome`` (END: no more) to the replier, once fewer than REPLIES_WAITING wait;
        waiting in short slices, so that signals get their turn. False when the replier is dead:
        the caller answers ``outcome`` itself."""
        while not self.replier_dead.is_set():
            try:
                self.replies.put(outcome, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def unsent_replies(self) -> list[Outcome]:
        """The outcomes a dead replier left in its queue."""
        left: list[Outcome] = []
        while True:
            try:
                outcome = self.replies.get_nowait()
            except queue.Empty:
                return left
            if outcome is not END:
                left.append(outcome)

    def fail(self, exc: BaseException) -> None:
        """End the worker for ``exc`` (the main thread raises it once the other threads are done);
        one that is not an Exception becomes one, so that the worker ends with exit status 1."""
        if not isinstance(exc, Exception):
            exc = RuntimeError(f"thread {threading.current_thread().name} died: {exc!r}")
        if self.fatal is None:
            self.fatal = exc
        self.stop.set()


def survive(stop: threading.Event, exc: Exception, what: str, in_a_row: int) -> int:
    """Log an unexpected error and wait a little; raise it once MAX_UNEXPECTED have come in a row
    (a fault of this worker, not of one record)."""
    in_a_row += 1
    if in_a_row >= MAX_UNEXPECTED:
        raise exc
    log.error("%s failed (%d in a row); the worker goes on", what, in_a_row, exc_info=exc)
    stop.wait(min(0.1 * 2**in_a_row, 2.0))
    return in_a_row


def acl_refusal(exc: Exception) -> ConfigurationError | None:
    """The ConfigurationError that ends the worker (exit 2) when Redis's ACL refused one of its
    commands: no job can be answered until the user's rights are fixed, and taking jobs it cannot
    answer would only fail them as WorkerLost later."""
    if isinstance(exc, ConfirmRefused):  # not a script's command: its message says what to add
        return ConfigurationError(f"this worker's answers are written but cannot be confirmed: {exc}")
    if not is_refused(exc):
        return None
    said = redis_message(exc)
    command = refused_command(said)
    which = f"the command {command}" if command else "a command ortq's scripts run"
    return ConfigurationError(
        f"Redis refused a command to this worker's user ({said}): its ACL lacks {which}; give it the "
        "worker rule of docs/security.md ('The worker')"
    )


class Feeder:
    """Stages **take** and **read**, on a thread of their own (the main thread checks)."""

    def __init__(
        self,
        threads: Threads,
        settings: Settings,
        book: Book,
        presence: Presence,
        max_batch: int,
        max_wait: float,
        burst: bool,
    ) -> None:
        self.threads = threads
        self.connection = book.connection
        released = lambda jobs: presence.ledger.leave(jobs, Left.RELEASED)  # noqa: E731
        self.intake = Intake(
            self.connection, book, settings, max_batch, max_wait, presence.hold, presence.starting, released
        )
        self.upkeep = Upkeep(book, settings)
        self.settings = settings
        self.presence = presence
        self.burst = burst
        self.thread = threading.Thread(target=self._run, name="ortq-feeder", daemon=True)

    def _run(self) -> None:
        try:
            self._feed()
        except BaseException as exc:  # handed to the main thread, which raises it
            self.threads.fail(exc)
        finally:
            self.threads.batches.put(END)

    def _feed(self) -> None:
        threads, backoff, unexpected = self.threads, 0.5, 0
        while not threads.stop.is_set():
            limit = SLOTS_WITH_BACKLOG if self.intake.backlog else SLOTS
            if not threads.slots.acquire(limit, timeout=0.25):
                continue
            try:
                taken = self._take()
                backoff, unexpected = 0.5, 0
            except REDIS_DOWN as exc:
                # Redis restarting or unreachable: wait and reconnect (redis-py reconnects on the
                # next command), backing off to at most 5 s, and never exit for it.
                threads.slots.release()
                log.error("Redis unavailable (%s); retrying in %.1f s", exc, backoff)
                threads.stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            except Exception as exc:
                # A record nobody foresaw (a refused script, a value the code mishandles): the
                # entries it came with stay in the intermediate list or started, where the rescue
                # and the recovery of orphans find them (and fail them WorkerLost if they do it
                # again). Only errors in a row past a bound end the worker, and an ACL refusal.
                threads.slots.release()
                if (refused := acl_refusal(exc)) is not None:
                    raise refused from exc
                unexpected = survive(threads.stop, exc, "taking jobs", unexpected)
                continue
            if taken is None:  # burst, and the queue is empty
                threads.slots.release()
                if not self.presence.ledger.held():
                    log.info("burst: the queue is empty")
                    return
                threads.stop.wait(0.01)  # what is in hand may still put a retry back on the queue
                continue
            if taken:
                self._hand_over(taken)
            else:
                threads.slots.release()

    def _take(self) -> list[Taken] | None:
        """Stages **take** and **read**: jobs started and their frames read (ortq.worker.intake)."""
        if self.intake.suspended():
            self.presence.set_state(self.connection, "suspended")
            self.threads.stop.wait(1.0)
            return [] if not self.burst else None
        held = self.presence.ledger.held()
        self.upkeep.between_takes(held)
        if not held:
            self.presence.set_state(self.connection, "idle")  # start.lua writes "busy"
        return self.intake.take(block=not self.burst)  # what it starts, it holds (Presence.hold)

    def _hand_over(self, taken: list[Taken]) -> None:
        """Hands a batch to the main thread, which checks and runs it; taken as the GPU went away, it
        goes back to the queue."""
        threads = self.threads
        if threads.device_lost.is_set():
            # Taken as the GPU went away: back to the queue for a fresh process (EXIT_DEVICE_LOST).
            why = f"worker {self.upkeep.book.worker_name} lost its device"
            hand_on(self.upkeep, self.presence.ledger, [t.started for t in taken], why)
            threads.slots.release()
            return
        threads.batches.put(TakenBatch(taken, self.intake.batch_wait))


class Replier:
    """The encode, reply and book-keep stages, on a thread of their own."""

    def __init__(
        self,
        threads: Threads,
        settings: Settings,
        book: Book,
        presence: Presence,
        metrics: Callable[[], WorkerMetrics | None],
    ) -> None:
        self.threads = threads
        self.settings = settings
        self.book = book
        self.presence = presence
        self.metrics = metrics
        self.thread = threading.Thread(target=self._run, name="ortq-replier", daemon=True)

    def _run(self) -> None:
        try:
            while (outcome := self.threads.replies.get()) is not END:
                self.answer(outcome, self.book)
        except BaseException as exc:  # a defect: the worker ends, the main thread answers what is left
            log.critical("the replier thread died", exc_info=exc)
            self.threads.replier_dead.set()
            self.threads.fail(exc)

    def answer(self, outcome: Outcome, book: Book) -> None:
        """Stages **encode** and **answer** for a batch, through ``book`` (the replier's own, or
        the main thread's when it answers itself). Each of its jobs leaves the worker: answered once
        its script ran, else released, whatever happens."""
        answered: list[StartedJob] = []
        try:
            self._encode_and_send(outcome, book, answered)
        except REDIS_DOWN as exc:  # past despite_outage's bound: the other workers take them back
            self.threads.fail(exc)
        except Exception as exc:
            # Redis refused a write (a record nobody foresaw): the jobs stay started, and are
            # taken back as this worker's own orphans once they are no longer held.
            log.error("answering %d job(s) failed: %s", len(outcome.held), exc, exc_info=exc)
            if (refused := acl_refusal(exc)) is not None:
                self.threads.fail(refused)
        finally:
            ledger = self.presence.ledger
            ledger.leave(answered, Left.ANSWERED)
            done = {job.execution_id for job in answered}
            ledger.leave([job for job in outcome.held if job.execution_id not in done], Left.RELEASED)
            if outcome.trace is not None:
                outcome.trace.end()

    def _encode_and_send(self, outcome: Outcome, book: Book, answered: list[StartedJob]) -> None:
        """Answer ``outcome``'s jobs, adding each to ``answered`` once its script has run."""
        finished: list[Finished] = []
        failures = list(outcome.failures)
        for computed in outcome.computed:  # encoded here, while the main thread runs the next batch
            answer = computed.encode(self.settings)
            if isinstance(answer, Finished):
                finished.append(answer)
            else:
                failures.append(answer)
        if outcome.trace is not None:
            outcome.trace.encoded(finished, failures)
        for failure in failures:
            self._fail(failure, book)
            answered.append(failure.started)
        presence = self.presence
        # Whether these are the last jobs held is known only with no start in flight (an "idle"
        # must not land after its "busy"). A start in flight is not waited for: its jobs keep the
        # worker busy (and if it took none, the feeder writes "idle" before its next take).
        last = False
        if presence.starting.acquire(blocking=False):
            try:
                last = presence.ledger.holds_only(outcome.held)
                if last:
                    if finished:
                        despite_outage("delivering results", lambda: book.finish(finished, state="idle"))
                        answered += [done.started for done in finished]
                    else:
                        despite_outage("going idle", lambda: presence.set_state(book.connection, "idle", force=True))
                    presence.state = "idle"
            finally:
                presence.starting.release()
        if finished and not last:  # the worker stays busy: start.lua wrote that
            despite_outage("delivering results", lambda: book.finish(finished, state=""))
            answered += [done.started for done in finished]
        metrics = self.metrics()
        if metrics is not None:
            metrics.jobs_succeeded([done.timings for done in finished])

    def _fail(self, failure: jobs.Failure, book: Book) -> None:
        started = failure.started

        def write() -> bool:
            return book.fail(
                started, failure.error, failure.ttl, failure.reason, failure.retry, state="", status=failure.status
            )

        if not despite_outage("failing a job", write):
            log.warning("job %s failed here (%s) but was taken back meanwhile", started.job_id, failure.error_type)
            return
        retrying = " (will retry)" if failure.retry else ""
        log.warning("job %s failed%s: %s", started.job_id, retrying, failure.reason[:2000])
        metrics = self.metrics()
        if metrics is not None and failure.retry is None:
            metrics.job_failed(failure.error_type, failure.timings)

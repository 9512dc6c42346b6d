"""The two threads that keep the session busy: while the main thread checks and runs a batch (ONNX
Runtime releases the GIL in ``Run``), the **feeder** already takes and reads the next one, and the
**replier** encodes the previous one's answers and writes them. Only the main thread calls
``Run``, except for one request at a time on an idle worker (``Feeder._alone``): the feeder runs
the batch it took itself, stages check to answer, when the main thread has none in hand and the
take left no backlog (no other batch to overlap it with), sparing a hand-over (a thread's wake-up,
~0.1-0.2 ms on a loaded machine); the first take that leaves a backlog goes back to the overlap.
Still one session, one ``Run`` at a time. The main thread checks each batch (decode, the
model's signature) itself: the feeder then spends its time in Redis round trips, and its start
script is on its way while the main thread still works on the batch before (under the GIL, one
thread computes at a time).

The feeder takes a batch *ahead* (while another runs) only while that pays (``Ahead``, the
``--prefetch`` option): by default only while the last run was short next to a take's round trip
to Redis, and then at most one batch waits beside the one running, and a second only while the
queue has a backlog (the last start left jobs on it; ``Slots``). A long run's next batch is taken
once the run ends: a job taken ahead is started (RQ's records say so) and held by this worker
while it waits, out of reach of an idle neighbour. Each thread has its own Redis connection. A
job is held (its records kept fresh by the heartbeat) from its start until it is answered, handed
on or released (ortq.worker.ownership, whose rule every path here keeps); the scripts are fenced,
so a job taken back from this worker meanwhile is answered once all the same.

A stop (SIGTERM, RQ's shutdown command, a thread's death) hands the batches taken ahead (handed
over while the main thread had another) and not begun back to the queue at once (the feeder as soon
as it sees the stop, the main thread for one it gets after it), and the main thread finishes only
the batch it is running, or the one taken for it while it was idle (or the feeder the one it
runs itself). A thread that dies
ends the worker: the replier's makes the main thread answer what is left itself, then end (exit
status 1; the pool starts a fresh process).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
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
from ortq.worker.upkeep import REDIS_OUTAGE_LIMIT, Upkeep, despite_outage

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
    #: Handed over while the main thread had another batch in hand: taken ahead of it (a stop
    #: hands it back; one taken for an idle main thread runs).
    ahead: bool = False


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


#: Batches in hand at most (running, waiting, being taken) while taking ahead pays: two, three while
#: the queue has a backlog.
SLOTS, SLOTS_WITH_BACKLOG = 2, 3
#: ``--prefetch`` auto: a batch is taken ahead only while the last one ran (checked and run, on the
#: main thread) for less than AHEAD_RATIO start round trips, or AHEAD_FLOOR seconds if more (see
#: Ahead).
AHEAD_RATIO, AHEAD_FLOOR = 20.0, 0.01


class Ahead:
    """How many batches the feeder may hold beyond the one running: ``--prefetch`` N, or auto.

    Taking the next batch while one runs saves, once a batch, the take's time (a start's round
    trip to Redis, two without a backlog); it costs a job started and held here for the whole run
    in hand, which an idle neighbour could have run meanwhile, and which a stop must hand back.
    Auto takes ahead only while the last run took less than ``AHEAD_RATIO`` start round trips
    (measured, smoothed), at least ``AHEAD_FLOOR`` seconds: the overlap then saves a twentieth of a
    batch's time or more, and a job taken ahead waits a few milliseconds. A longer run's next
    batch is taken once the run ends (the take then costs under 5% of the batch). Before the first
    run, and after a take that found the queue empty (the runs before may say nothing of the next
    jobs), nothing is known: no batch is taken ahead until one has run.

    Only the run that was is known, not the one in hand: at a switch from short jobs to long ones
    a batch taken ahead (behind the last short one) waits out the first long run.
    """

    def __init__(self, prefetch: int | None = None) -> None:
        self.prefetch = prefetch  # None: auto
        #: Seconds the last batch took on the main thread (check and run); None: not known.
        self.last_run: float | None = None
        #: A start's round trip (seconds, smoothed); None: none measured yet.
        self.round_trip: float | None = None

    def ran(self, seconds: float) -> None:
        self.last_run = seconds

    def forget(self) -> None:
        self.last_run = None

    def took(self, round_trip: float) -> None:
        """A start script's round trip, measured by the feeder."""
        self.round_trip = round_trip if self.round_trip is None else 0.8 * self.round_trip + 0.2 * round_trip

    def bound(self) -> float:
        """Auto: runs shorter than this are worth taking ahead for."""
        return max(AHEAD_FLOOR, AHEAD_RATIO * (self.round_trip or 0.0))

    def pays(self) -> bool:
        """Whether the next batch is to be taken while the one in hand runs."""
        if self.prefetch is not None:
            return self.prefetch > 0
        return self.last_run is not None and self.last_run < self.bound()

    def limit(self, backlog: bool) -> int:
        """Batches in hand at most (running, waiting, being taken), for ``Slots.acquire``."""
        if self.prefetch is not None:
            return 1 + self.prefetch
        if not self.pays():
            return 1
        return SLOTS_WITH_BACKLOG if backlog else SLOTS


#: Batches run and waiting for the replier at most. Past it the main thread waits, and the feeder
#: with it (no slot is released): a replier behind the runs (Redis busy with this and other
#: workers' scripts) leaves no pile of computed, unanswered jobs (every heartbeat refreshes each
#: held job's records, and a crash would run them all again).
REPLIES_WAITING = 2


class Threads:
    """What the feeder, the replier and the main thread share."""

    def __init__(self, stop: threading.Event, prefetch: int | None = None) -> None:
        self.stop = stop
        self.slots = Slots()
        #: How many batches the feeder takes ahead (``--prefetch``), and what auto goes by.
        self.ahead = Ahead(prefetch)
        #: Batches handed to the main thread that it has not yet checked and run (waiting or running).
        self._in_hand = 0
        self._in_hand_lock = threading.Lock()
        self.batches: queue.Queue[TakenBatch | None] = queue.Queue()
        self.replies: queue.Queue[Outcome | None] = queue.Queue(maxsize=REPLIES_WAITING)
        #: The error that ended a thread (raised by the main thread), if any.
        self.fatal: BaseException | None = None
        #: Set when the GPU is gone: the feeder gives back what it takes instead of queueing it.
        self.device_lost = threading.Event()
        #: Set when the replier thread has died: nothing handed to it would be answered.
        self.replier_dead = threading.Event()
        #: Batches handed to the main thread, and batches the feeder ran and answered itself (one
        #: request at a time on an idle worker: Feeder._alone), counted for tests and benches.
        self.handed, self.ran_alone = 0, 0
        #: The feeder is checking, running or answering a batch itself (the main thread has none).
        self.running_alone = False

    def handed_over(self) -> bool:
        """Count a batch handed to the main thread; True when it is taken ahead (another is in hand)."""
        with self._in_hand_lock:
            self._in_hand += 1
            self.handed += 1
            return self._in_hand > 1

    def main_idle(self) -> bool:
        """Whether the main thread has no batch in hand (none waiting, none being checked or run)."""
        with self._in_hand_lock:
            return self._in_hand == 0

    def done_with(self) -> None:
        """The main thread has run a batch handed over (or handed it back)."""
        with self._in_hand_lock:
            self._in_hand -= 1

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
        run_alone: Callable[[TakenBatch, Book], None],
    ) -> None:
        """``run_alone``: checks, runs and answers a batch on the calling thread (the worker's)."""
        self.threads = threads
        self.run_alone = run_alone
        self.connection = book.connection
        released = lambda jobs: presence.ledger.leave(jobs, Left.RELEASED)  # noqa: E731
        self.intake = Intake(
            self.connection, book, settings, max_batch, max_wait, presence.hold, presence.starting, released
        )
        self.intake.on_round_trip = threads.ahead.took
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
            try:
                self._hand_back()
            finally:
                self.threads.batches.put(END)

    def _hand_back(self) -> None:
        """A stop: the batches taken ahead that the main thread has not begun go back to the
        queue now, for other workers, not after the run in hand (the main thread hands back one it
        gets from here on itself). One taken for an idle main thread stays: it runs. Not at a
        burst's end: nothing waits then."""
        threads = self.threads
        if not threads.stop.is_set():
            return
        waiting: list[TakenBatch] = []
        runs: list[TakenBatch] = []  # taken for an idle main thread (the first, if any)
        while True:
            try:
                batch = threads.batches.get_nowait()
            except queue.Empty:
                break
            if batch is not END:
                (waiting if batch.ahead else runs).append(batch)
        for batch in runs:  # back for the main thread, before END
            threads.batches.put(batch)
        try:
            hand_back(self.upkeep, self.presence, threads, [t.started for b in waiting for t in b.taken])
        finally:
            for _ in waiting:
                threads.done_with()
                threads.slots.release()

    def _feed(self) -> None:
        threads, backoff, unexpected = self.threads, 0.5, 0
        while not threads.stop.is_set():
            limit = threads.ahead.limit(self.intake.backlog)
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
            if taken and self._alone():
                self._run_alone(taken)
            elif taken:
                self._hand_over(taken)
            else:  # nothing came within a slice: the runs before say nothing of the next jobs
                threads.ahead.forget()
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

    def _alone(self) -> bool:
        """Whether the batch just taken is run here, not handed over: one request at a time on an
        idle worker (the main thread has nothing in hand and the take left no backlog). Handing it
        over would cost a thread's wake-up (~0.1-0.2 ms on a loaded machine) and gain nothing: no
        other batch is there to overlap it with. A take that leaves a backlog goes back to the
        overlap (the next batch is taken while this one runs), and so does ``--prefetch`` N > 0
        (N batches taken ahead whatever the runs)."""
        threads = self.threads
        if self.intake.backlog or (threads.ahead.prefetch or 0) > 0:
            return False
        return not threads.device_lost.is_set() and threads.main_idle()

    def _run_alone(self, taken: list[Taken]) -> None:
        """Stages **check** to **answer** of a batch on this thread (the main thread waits for the
        next one it is handed). What it raises ends the worker (DeviceLost, errors in a row)."""
        threads = self.threads
        threads.ran_alone += 1
        threads.running_alone = True
        try:
            self.run_alone(TakenBatch(taken, self.intake.batch_wait), self.intake.book)
        finally:
            threads.running_alone = False
            threads.slots.release()

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
        threads.batches.put(TakenBatch(taken, self.intake.batch_wait, threads.handed_over()))


def hand_back(upkeep: Upkeep, presence: Presence, threads: Threads, held: Sequence[StartedJob]) -> None:
    """Jobs taken ahead that will not run here (the worker stops) back at the head of the queue:
    handed on (ortq.worker.ownership), for the other workers to run."""
    if not held:
        return
    me = upkeep.book.worker_name
    lost = threads.device_lost.is_set()
    why = f"worker {me} lost its device" if lost else f"worker {me} stopped before running it (taken ahead)"
    log.info("worker %s stops: %d job(s) taken ahead and not begun go back to the queue", me, len(held))
    hand_on(upkeep, presence.ledger, held, why, REDIS_OUTAGE_LIMIT if lost else 10.0)


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

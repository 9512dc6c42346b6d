"""The ortq worker: one process, one ONNX Runtime session, one model queue, and its loop.

A job goes through eight named stages:

=========  ===========  ==========================================================================
stage      thread       where
=========  ===========  ==========================================================================
take       feeder       ``Intake.take``: BLMOVE, then start.lua starts a batch (RQ's started records)
read       feeder       its request frames: inline in start.lua's reply, beside it, or in one read
check      main         ``jobs.check_batch``: each job decoded and checked alone (a bad one fails alone)
group      main         ``batch.group``: jobs whose inputs can share a run (``--max-batch``)
run        main         ``Worker._run_group``: one ``session.run`` a group (``LoadedModel.run``)
split      main         ``batch.split``: the outputs cut back per job
encode     replier      ``jobs.Computed.encode``: each job's response frame
answer     replier      ``Replier.answer``: finish.lua writes every reply, then RQ's records
=========  ===========  ==========================================================================

(reply first: nobody who has seen the response is told the job still runs). The feeder and the
replier (ortq.worker.overlap) overlap Redis and the next batch's take with the run; the main
thread calls ``session.run``, and answers a batch itself when nothing waits behind it. One request
at a time on an idle worker (the main thread has nothing in hand, the take left no backlog) is not
handed over: the feeder runs stages check to answer itself (``Worker._run_alone``), and only while
the main thread has no batch, so there is still one ``session.run`` at a time.

Every job the worker holds leaves it exactly once: answered, handed on (put back on the queue by
this worker) or released to the recovery of orphans, whatever fails on the way; the rule, and which
path ends a job which way, are in ortq.worker.ownership.

The worker is an RQ worker to every RQ tool (ortq.rqcompat writes RQ's records), but no RQ code
runs in it: nothing from RQ is subclassed or patched. Its exit status says why it ended: 0 only
when it was asked to stop (a signal, RQ's shutdown command, the end of a burst), EXIT_DEVICE_LOST
when the GPU went away, EXIT_CONFIGURATION when Redis's ACL refuses it a command, EXIT_CRASHED for
anything else.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from typing import Any

import redis

from ortq import keys, tracing, wire
from ortq.errors import (
    EXIT_CONFIGURATION,
    EXIT_CRASHED,
    EXIT_DEVICE_LOST,
    ConfigurationError,
    DeviceLost,
    JobStopped,
    JobTimeout,
)
from ortq.metrics import WorkerMetrics
from ortq.redisfunctions import ensure_functions
from ortq.redisurls import redacted_url
from ortq.replication import Confirm
from ortq.rqcompat.book import Book, StartedJob
from ortq.settings import REDIS_DOWN, Settings
from ortq.wire import Layout
from ortq.worker import jobs
from ortq.worker.batch import group, split
from ortq.worker.beat import Beat
from ortq.worker.devicelost import DeviceLostMatcher
from ortq.worker.identity import WorkerIdentity
from ortq.worker.overlap import END, Feeder, Outcome, Replier, TakenBatch, Threads, hand_back, survive
from ortq.worker.ownership import hand_on
from ortq.worker.presence import Presence
from ortq.worker.session import LoadedModel
from ortq.worker.signals import StopSignals
from ortq.worker.stops import COMMANDED, STOP_POLL_SECONDS, Stops
from ortq.worker.upkeep import REDIS_OUTAGE_LIMIT, Upkeep
from ortq.worker.watchdog import DEFAULT_STALL_SECONDS, Progress

log = logging.getLogger("ortq.worker")


class Worker:
    """Serves one model's queue with one loaded model until it is stopped."""

    def __init__(
        self,
        model: LoadedModel,
        identity: WorkerIdentity,
        settings: Settings,
        name: str,
        *,
        max_batch: int = 1,
        max_wait_ms: float = 0.0,
        prefetch: int | None = None,
        burst: bool = False,
        device_lost_pattern: str | None = None,
        metrics: WorkerMetrics | None = None,
        stall_seconds: float = DEFAULT_STALL_SECONDS,
        job_timeout: float | None = None,
    ) -> None:
        """``prefetch``: batches taken ahead while one runs (ortq.worker.overlap.Ahead; None:
        auto); ``stall_seconds``: a run lasting longer is taken as hung (ortq.worker.watchdog; 0:
        never); ``job_timeout``: seconds a run may take for jobs that set no timeout of their own."""
        self.model = model
        self.identity = identity
        self.settings = settings
        self.name = name
        self.max_batch = max_batch
        self.burst = burst
        self.metrics = metrics
        self.queue_name = keys.queue_name(identity.model)
        self.connection = settings.connect()
        self.presence = Presence(name, self.queue_name, identity, model.signature, settings)
        #: What every answer says served it (wire.Served): producers check it (docs/wire-format.md).
        self.served = wire.Served(identity.version, model.signature.digest)
        #: Every job the worker holds, and how each left (ortq.worker.ownership).
        self.ledger = self.presence.ledger
        self.upkeep = Upkeep(self._book(self.connection), settings)
        self.is_device_lost = DeviceLostMatcher(device_lost_pattern)
        self.progress = Progress(stall_seconds)
        #: Jobs whose stop was requested, and the run in flight (ortq.worker.stops).
        self.stops = Stops()
        self.job_timeout = job_timeout
        self.stop_requested = threading.Event()
        self._beat_upkeep: Upkeep | None = None
        # The threads beside the main one (ortq.worker.overlap), each with its own connection.
        self.threads = Threads(self.stop_requested, prefetch)
        self.feeder = Feeder(
            self.threads,
            settings,
            self._book(settings.connect(check=False)),
            self.presence,
            max_batch,
            max_wait_ms / 1000,
            burst,
            self._run_alone,
        )
        answering = self._book(settings.connect(check=False))
        self.replier = Replier(self.threads, settings, answering, self.presence, lambda: self.metrics)
        self.tracing = tracing.for_worker(identity.model, name)  # decided once; None: no tracing at all
        self._fed_out = False  # the feeder's END has been seen
        self._unanswered: list[StartedJob] = []  # the batch in hand when the device was lost
        self._unexpected = 0  # errors in a row running batches that neither Redis nor a job explains

    def _book(self, connection: redis.Redis) -> Book:
        """The scripts on ``connection``, for this worker and queue."""
        return Book(
            connection,
            self.name,
            self.queue_name,
            executions=self.settings.rq_executions,
            version=self.identity.version,
            parked_ttl=self.settings.request_ttl,
            confirm=Confirm.of(self.settings),
        )

    # ------------------------------------------------------------------ lifecycle

    def serve(self, handle_signals: bool = True) -> int:
        """Register, serve until stopped, unregister; returns the process's exit status.
        ``handle_signals``: SIGINT/SIGTERM (SIGBREAK on Windows) ask for a warm stop; only the main
        thread can install them (tests serve from another thread and call request_stop)."""
        if handle_signals:
            self._install_signal_handlers()
        self.presence.register(self.connection)
        ensure_functions(self.connection)  # before producers see this worker: their FCALLs then work
        # The feeder's and the replier's connections open now, not at their first take and answer:
        # once producers see the worker it holds all of its connections (operations.md counts them).
        for connection in (self.feeder.connection, self.replier.book.connection):
            connection.ping()
        beat = Beat(
            lambda: self.settings.connect(check=False),
            self.name,
            self.settings.heartbeat_seconds,
            self._heartbeat,
            self._upkeep_beside,
            self.request_stop,
            lambda job_id: self._stop_jobs({job_id: COMMANDED}),  # RQ's stop-job command
            self._poll_stops,
            STOP_POLL_SECONDS,
        )
        beat.start()  # subscribed to RQ's command channel before anyone sees the worker
        self._heartbeat(self.connection)  # ortq's record out: producers and `ortq info` see it now
        where = redacted_url(self.settings.redis_url)
        log.info("worker %s serving model %r on %s from Redis at %s", self.name, self.identity.model,
                 self.identity.provider, where)  # fmt: skip
        status = EXIT_CRASHED
        try:
            self._loop()
            status = 0
        except DeviceLost:
            status = EXIT_DEVICE_LOST
        except ConfigurationError as exc:  # what only the operator can fix, e.g. an ACL refusal
            log.critical("%s", exc)
            status = EXIT_CONFIGURATION
        except REDIS_DOWN as exc:
            log.critical("Redis at %s stayed unreachable while this worker held undelivered work: %s", where, exc)
        except Exception:
            log.exception("the worker's loop ended unexpectedly")
        finally:
            self._ready(False)
            if held := self.ledger.jobs():  # every path above lets its jobs go: this is a defect
                log.error("worker %s still held %d job(s) when it ended; requeueing them", self.name, len(held))
                hand_on(self.upkeep, self.ledger, held, f"worker {self.name} ended still holding it", patience=10.0)
            beat.stop()
            self.presence.unregister(self.connection)
        log.info("worker %s stopped (exit status %d)", self.name, status)
        return status

    def request_stop(self, signum: int | None = None, _frame: Any = None) -> None:
        """A warm stop: finish the batch running, hand back those taken ahead (ortq.worker.overlap),
        unregister, exit 0. For a stop signal, with its number (ortq.worker.signals: Kubernetes
        sends SIGTERM, and /ready answers 503 at once)."""
        if self.stop_requested.is_set():
            log.warning("worker %s is already stopping; it finishes its current batch first", self.name)
        else:
            why = signal.Signals(signum).name if signum is not None else "stop requested"
            log.info("%s: worker %s takes no more jobs, finishes the batch it is running and hands back any taken "
                     "ahead (%d job(s) held), then unregisters and exits; /ready answers 503 from now", why,
                     self.name, len(self.ledger.held()))  # fmt: skip
        self.stop_requested.set()
        self.feeder.intake.unblocker.unblock()  # an idle feeder's read ends now, not within its slice
        self._ready(False)

    def _install_signal_handlers(self) -> None:
        StopSignals(self.request_stop).install()  # seen at once, even during session.run

    def _ready(self, ready: bool) -> None:
        if self.metrics is not None:
            self.metrics.set_ready(ready and not self.stop_requested.is_set())

    # ------------------------------------------------------------------ the heartbeat thread's work

    def _heartbeat(self, connection: redis.Redis) -> None:
        if (lasted := self.progress.stalled_for()) is not None:
            self._end_stalled(connection, lasted)
        stops = self.presence.heartbeat(connection)
        if self.settings.rq_executions and (held := self.ledger.jobs()):
            self._upkeep_on(connection).book.record_executions(held)
        if stops or self.stops.any:  # new requests, or old ones of jobs that may have left: forgotten
            self._stop_jobs(stops)
        self._ready(True)

    def _poll_stops(self, connection: redis.Redis) -> None:
        """Between heartbeats: the stop requests of jobs held a poll interval or more (a job that
        ends sooner is not worth a round trip; the heartbeat reads every held job's anyway)."""
        if stops := self.presence.requested_stops(connection, STOP_POLL_SECONDS):
            self._stop_jobs(stops)

    def _stop_jobs(self, job_ids: dict[str, bytes | None]) -> None:
        """Stop these jobs (ortq.worker.stops), those of them this worker holds."""
        held = [job.job_id for job in self.ledger.jobs()]
        if new := set(job_ids) & set(held) - {i for i in held if self.stops.requested(i)}:
            log.info("stop requested for job(s) %s: not run, or their run stopped", ", ".join(sorted(new)))
        self.stops.request(job_ids, held)

    def _end_stalled(self, connection: redis.Redis, lasted: float) -> None:
        """The run in flight has lasted past ``stall_seconds``: taken as hung (ortq.worker.watchdog).
        No more beats: every held job is handed on, the worker unregistered, and the process exits
        from this thread with EXIT_DEVICE_LOST, the main thread being stuck in ``Run``."""
        log.critical(
            "no run has ended for %.0f s (--stall-seconds %g): the device or its driver is taken to be hung; "
            "requeueing this worker's %d job(s) and exiting with status %d",
            lasted,
            self.progress.stall_seconds,
            len(self.ledger.held()),
            EXIT_DEVICE_LOST,
        )
        self.stop_requested.set()
        self._ready(False)
        # The feeder first ends its take (a BLMOVE in flight would pop a job requeued below), so
        # that what it took is held, and handed on with the rest.
        # (Not when the feeder is the thread stuck in the run: one request at a time, Feeder._alone.)
        if not self.threads.running_alone:
            self.feeder.thread.join(self.feeder.intake.slice + self.settings.socket_timeout)
        why = f"worker {self.name}'s run stalled (no run ended for {lasted:.0f} s)"
        hand_on(self._upkeep_on(connection), self.ledger, self.ledger.jobs(), why, patience=10.0)
        self.presence.unregister(connection)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_DEVICE_LOST)

    def _upkeep_beside(self, connection: redis.Redis) -> None:
        self._upkeep_on(connection).run()

    def _upkeep_on(self, connection: redis.Redis) -> Upkeep:
        """The heartbeat thread's upkeep, on its connection."""
        if self._beat_upkeep is None or self._beat_upkeep.book.connection is not connection:
            self._beat_upkeep = Upkeep(self._book(connection), self.settings)
        return self._beat_upkeep

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        """The main thread runs batches while the feeder and the replier do the rest
        (ortq.worker.overlap). Returns once the feeder ends (stop requested, burst done); raises
        what ended another thread, or DeviceLost."""
        threads, feeder, replier = self.threads, self.feeder, self.replier
        feeder.thread.start()
        replier.thread.start()
        try:
            self._run_batches()
            if isinstance(threads.fatal, DeviceLost):  # the feeder's, running a lone request itself
                raise threads.fatal
        except DeviceLost as exc:
            log.critical("%s; requeueing this worker's jobs and exiting with status %d", exc, EXIT_DEVICE_LOST)
            raise
        finally:
            self.stop_requested.set()
            # Jobs that will not run here: the batch in hand when the device was lost, and batches
            # the feeder queued that this thread, ending early (the device lost, an error), will not
            # run. They are handed on (back at the head of the queue for a fresh worker), once the
            # feeder has ended: it would take them again.
            leftovers = list(self._unanswered)
            while not self._fed_out and (batch := threads.batches.get()) is not END:
                leftovers += [t.started for t in batch.taken]
            feeder.thread.join()
            if leftovers:
                lost = threads.device_lost.is_set()
                why = f"worker {self.name} lost its device" if lost else f"worker {self.name} ended before running it"
                hand_on(self.upkeep, self.ledger, leftovers, why, REDIS_OUTAGE_LIMIT if lost else 10.0)
            if threads.reply_later(END):
                replier.thread.join()
            for outcome in threads.unsent_replies():  # a dead replier's: answered here
                self.replier.answer(outcome, self.upkeep.book)
        if threads.fatal is not None:
            raise threads.fatal

    def _run_batches(self) -> None:
        while True:
            try:
                batch = self.threads.batches.get(timeout=0.5)  # a timeout: signals get their turn
            except queue.Empty:
                continue
            if batch is END:
                self._fed_out = True
                return
            if batch.ahead and self.stop_requested.is_set():  # taken ahead, not begun: back to the queue
                try:
                    hand_back(self.upkeep, self.presence, self.threads, [t.started for t in batch.taken])
                finally:
                    self.threads.done_with()
                    self.threads.slots.release()
                continue
            outcome = Outcome([t.started for t in batch.taken])
            try:
                self._run_batch(batch, outcome)
            finally:
                self.threads.done_with()
                self.threads.slots.release()
                idle = self.threads.batches.empty() and self.threads.replies.empty()
                # Nothing to run next: answering here is sooner than waking the replier (on a
                # loaded machine a thread's wake-up costs a sequential request ~0.1 ms). A dead
                # replier's work is done here too.
                if idle or not self.threads.reply_later(outcome):
                    self.replier.answer(outcome, self.upkeep.book)

    def _run_alone(self, batch: TakenBatch, book: Book) -> None:
        """A batch the feeder took for an idle worker (ortq.worker.overlap.Feeder._alone), checked,
        run and answered (through ``book``, the feeder's) on the feeder's thread: no hand-over.
        Raises what ends the worker (DeviceLost, errors in a row): the feeder hands it to the main
        thread, which says it and ends the worker."""
        outcome = Outcome([t.started for t in batch.taken])
        try:
            self._run_batch(batch, outcome)
        finally:
            self.replier.answer(outcome, book)

    def _run_batch(self, batch: TakenBatch, outcome: Outcome) -> None:
        """Check and run ``batch`` into ``outcome``, on whichever thread has it (one at a time:
        the feeder runs one only while the main thread has none in hand). Raises DeviceLost, and
        an unexpected error once MAX_UNEXPECTED came in a row; ``outcome`` is answered after."""
        began = time.perf_counter()
        try:
            self._check_and_run(batch, outcome)
            self._unexpected = 0
        except DeviceLost:
            # From now on the feeder gives back what it takes; this batch's unanswered jobs stay
            # held (not taken back as orphans meanwhile) until _loop gives them back.
            self.threads.device_lost.set()
            self.stop_requested.set()
            answered = [c.member.started for c in outcome.computed] + [f.started for f in outcome.failures]
            ids = {job.execution_id for job in answered}
            self._unanswered = [t.started for t in batch.taken if t.started.execution_id not in ids]
            outcome.held = answered
            raise
        except Exception as exc:
            # What was not answered stays started, and is taken back as this worker's own orphan.
            self._unexpected = survive(self.stop_requested, exc, "running a batch", self._unexpected)
        finally:
            # Before the slot is released: the feeder's next take goes by it (overlap.Ahead).
            self.threads.ahead.ran(time.perf_counter() - began)

    def _check_and_run(self, batch: TakenBatch, outcome: Outcome) -> None:
        """Stages **check**, **group**, **run** and **split** for a batch (the replier encodes and answers)."""
        batching = self.max_batch > 1
        if self.tracing is not None:  # docs/tracing.md
            outcome.trace = self.tracing.batch(batch.taken)
        pending, outcome.failures = jobs.check_batch(
            batch.taken,
            self.identity.model,
            self.model.signature,
            self.settings,
            batching,
            batch.batch_wait,
            self.served,
        )
        for members in group(pending, lambda p: p.key, self.max_batch, lambda p: p.rows):
            self._run_group(members, outcome)

    def _run_group(self, members: list[jobs.Pending], outcome: Outcome) -> None:
        """One group: one run, the outputs split per job and encoded. If the run fails, each job
        runs alone so that only the bad one fails."""
        if self.stops.any:  # stops requested before the run: those jobs are not run
            requested = [m for m in members if self.stops.applies(m.job.job_id, m.proof)]
            for member in requested:
                outcome.failures.append(self._failure(member, JobStopped("stopped on request before it ran")))
            members = [m for m in members if m not in requested]
            if not members:
                return
        t0 = time.perf_counter()
        # Each job's own timeout, else the worker's default; the group runs under the smallest.
        timeouts = [m.job.timeout if m.job.timeout is not None and m.job.timeout > 0 else self.job_timeout
                    for m in members]  # fmt: skip
        timeout = min((t for t in timeouts if t is not None), default=None)
        options = self.model.run_options()
        stopped = False
        try:
            self.progress.run_began()
            self.stops.run_began({m.job.job_id: m.proof for m in members}, options)
            try:
                outputs = self.model.run(jobs.group_inputs(members), timeout=timeout, options=options)
            finally:
                self.progress.run_ended()
                stopped = self.stops.run_ended()
            per_job = split(outputs, [m.rows for m in members]) if len(members) > 1 else [outputs]
        except Exception as exc:
            self._run_failed(members, outcome, exc, stopped)
            return
        run = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.batch_ran(len(members))
        if outcome.trace is not None:
            outcome.trace.ran(t0, run, members)
        result_ttl, size = self.settings.result_ttl, len(members)
        # Outputs split from one run look alike for jobs of as many rows: one layout for them.
        layouts: dict[int, Layout | None] = {}
        for member, outputs_of_job in zip(members, per_job, strict=True):
            ttl = jobs.ttl_of(member.job.result_ttl, result_ttl)
            if member.rows not in layouts:
                layouts[member.rows] = jobs.layout_of(outputs_of_job)
            outcome.computed.append(jobs.Computed(member, outputs_of_job, run, size, ttl, layouts[member.rows]))

    def _run_failed(self, members: list[jobs.Pending], outcome: Outcome, exc: Exception, stopped: bool) -> None:
        """A group's run raised ``exc``: stopped on request (``stopped``), past its timeout, the
        device lost, or an error of one of its jobs (then each runs alone, so only that one fails)."""
        if stopped:
            error = JobStopped("stopped on request while it ran")
            outcome.failures += [self._failure(member, error) for member in members]
            return
        if isinstance(exc, JobTimeout):
            for member in members:  # running them again would only time out again
                outcome.failures.append(self._failure(member, exc))
            return
        if self.is_device_lost(exc):
            raise DeviceLost(f"the device is lost: {type(exc).__name__}: {exc}") from exc
        if len(members) > 1:
            log.warning("batched run of %d jobs failed (%s); running them one by one", len(members), exc)
            for member in members:
                self._run_group([member], outcome)
            return
        outcome.failures.append(self._failure(members[0], exc))

    def _failure(self, member: jobs.Pending, exc: BaseException) -> jobs.Failure:
        return jobs.failure_of(member, exc, member.timings, self.settings)

"""The ortq worker: one process, one ONNX Runtime session, one model queue, and its loop.

Each turn of the loop goes through named stages: **take** jobs and **read** their request frames
(ortq.worker.intake), **check** each job on its own (a bad one fails alone), **group** compatible
jobs, **run** each group as one ``session.run``, **split** the outputs back per job, **reply** to
every job and **book-keep** RQ's records in the same script call (reply first: nobody who has seen
the response is told the job still runs).

The worker is an RQ worker to every RQ tool (ortq.rqcompat writes RQ's records), but no RQ code
runs in it: nothing from RQ is subclassed or patched. Its exit status says why it ended: 0 only
when it was asked to stop (a signal, RQ's shutdown command, the end of a burst), EXIT_DEVICE_LOST
when the GPU went away, EXIT_CRASHED for anything else.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from ortq import keys, wire
from ortq.errors import (
    EXIT_CRASHED,
    EXIT_DEVICE_LOST,
    DeviceLost,
    InvalidInput,
    InvalidJob,
    JobTimeout,
    OrtqError,
    RequestExpired,
    UnknownJobFunction,
)
from ortq.metrics import WorkerMetrics
from ortq.producer.priority import ensure_functions
from ortq.rqcompat.book import Book, Finished, Retry, StartedJob
from ortq.rqjob import MAX_SECONDS, JobRecord
from ortq.serializer import MsgpackSerializer
from ortq.settings import REDIS_DOWN, Settings, redacted_url
from ortq.worker.batch import batch_key, concat, group, split
from ortq.worker.beat import Beat
from ortq.worker.devicelost import DeviceLostMatcher
from ortq.worker.identity import WorkerIdentity
from ortq.worker.intake import Intake, Taken
from ortq.worker.presence import Presence
from ortq.worker.session import LoadedModel
from ortq.worker.upkeep import Upkeep, despite_outage

log = logging.getLogger("ortq.worker")

#: Unexpected errors in a row (none of Redis being down, none of a job's own) that end the loop.
MAX_UNEXPECTED = 5


@dataclass
class _Pending:
    """A job whose request decoded and fits the model, waiting for its group's run."""

    job: JobRecord
    started: StartedJob
    inputs: dict[str, np.ndarray]
    timings: dict[str, float]
    rows: int
    nonce: bytes | None


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
        burst: bool = False,
        device_lost_pattern: str | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.model = model
        self.identity = identity
        self.settings = settings
        self.name = name
        self.max_batch = max_batch
        self.burst = burst
        self.metrics = metrics
        self.queue_name = keys.queue_name(identity.model)
        self.connection = settings.connect()
        self.book = Book(self.connection, name, self.queue_name)
        self.presence = Presence(name, self.queue_name, identity, model.signature, settings)
        self.intake = Intake(self.connection, self.book, settings, max_batch, max_wait_ms / 1000)
        self.upkeep = Upkeep(self.book, settings)
        self.is_device_lost = DeviceLostMatcher(device_lost_pattern)
        self.stop_requested = threading.Event()
        self._beat_upkeep: Upkeep | None = None

    # ------------------------------------------------------------------ lifecycle

    def serve(self, handle_signals: bool = True) -> int:
        """Register, serve until stopped, unregister; returns the process's exit status.
        ``handle_signals``: SIGINT/SIGTERM (SIGBREAK on Windows) ask for a warm stop; only the main
        thread can install them (tests serve from another thread and call request_stop)."""
        if handle_signals:
            self._install_signal_handlers()
        self.presence.register(self.connection)
        ensure_functions(self.connection)  # before producers see this worker: their FCALLs then work
        beat = Beat(
            lambda: self.settings.connect(check=False),
            self.name,
            self.settings.heartbeat_seconds,
            self._heartbeat,
            self._upkeep_beside,
            self.request_stop,
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
        except REDIS_DOWN as exc:
            log.critical("Redis at %s stayed unreachable while this worker held undelivered work: %s", where, exc)
        except Exception:
            log.exception("the worker's loop ended unexpectedly")
        finally:
            self._ready(False)
            beat.stop()
            self.presence.unregister(self.connection)
        log.info("worker %s stopped (exit status %d)", self.name, status)
        return status

    def request_stop(self, *_: Any) -> None:
        """A warm stop: finish the batch in hand, unregister, exit 0."""
        if self.stop_requested.is_set():
            log.warning("worker %s is already stopping; it finishes its current batch first", self.name)
        self.stop_requested.set()
        self._ready(False)

    def _install_signal_handlers(self) -> None:
        for name in ("SIGINT", "SIGTERM", "SIGBREAK"):  # SIGBREAK: CTRL_BREAK_EVENT on Windows
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), self.request_stop)

    def _ready(self, ready: bool) -> None:
        if self.metrics is not None:
            self.metrics.set_ready(ready and not self.stop_requested.is_set())

    # ------------------------------------------------------------------ the heartbeat thread's work

    def _heartbeat(self, connection: redis.Redis) -> None:
        self.presence.heartbeat(connection)
        self._ready(True)

    def _upkeep_beside(self, connection: redis.Redis) -> None:
        if self._beat_upkeep is None or self._beat_upkeep.book.connection is not connection:
            self._beat_upkeep = Upkeep(Book(connection, self.name, self.queue_name), self.settings)
        self._beat_upkeep.run()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        backoff = 0.5
        unexpected = 0  # errors in a row that neither Redis nor a job explains
        while not self.stop_requested.is_set():
            try:
                taken = self._take()
                backoff = 0.5
            except REDIS_DOWN as exc:
                # Redis restarting or unreachable: wait and reconnect (redis-py reconnects on the
                # next command), backing off to at most 5 s, and never exit for it.
                log.error("Redis unavailable (%s); retrying in %.1f s", exc, backoff)
                self.stop_requested.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            except Exception as exc:
                # A record nobody foresaw (a refused script, a value our code mishandles): the
                # entries it came with stay in the intermediate list or started, where the rescue
                # and the recovery of orphans find them (and fail them WorkerLost if they do it
                # again). The worker serves on; only errors in a row past a bound end it (exit 1),
                # for its supervisor to start a fresh one.
                unexpected = self._survive(exc, "taking jobs", unexpected)
                continue
            if taken is None:
                log.info("burst: the queue is empty")
                return
            if taken:
                try:
                    self._process(taken)
                    unexpected = 0
                except (DeviceLost, *REDIS_DOWN):
                    raise
                except Exception as exc:
                    unexpected = self._survive(exc, "answering a batch", unexpected)

    def _survive(self, exc: Exception, what: str, in_a_row: int) -> int:
        """Log an unexpected error of the loop and wait a little; raise it once MAX_UNEXPECTED
        have come in a row (a fault of this worker, not of one record)."""
        in_a_row += 1
        if in_a_row >= MAX_UNEXPECTED:
            raise exc
        log.error("%s failed (%d in a row); the worker goes on", what, in_a_row, exc_info=exc)
        self.stop_requested.wait(min(0.1 * 2**in_a_row, 2.0))
        return in_a_row

    def _take(self) -> list[Taken] | None:
        """Stage 1-2: take jobs and read their frames (ortq.worker.intake)."""
        if self.intake.suspended():
            self._set_state("suspended")
            self.stop_requested.wait(1.0)
            return [] if not self.burst else None
        self.upkeep.while_idle()
        self._set_state("idle")
        taken = self.intake.take(block=not self.burst)
        if taken:
            self.presence.hold([t.started for t in taken])
        return taken

    def _set_state(self, state: str) -> None:
        self.presence.set_state(self.connection, state)

    def _process(self, taken: list[Taken]) -> None:
        """Stages 3-8 for one batch: check, group, run, split, reply, book-keep."""
        pending = [p for p in (self._check(t) for t in taken) if p is not None]
        finished: list[Finished] = []
        try:
            for members in group(pending, lambda p: batch_key(p.inputs), self.max_batch, lambda p: p.rows):
                finished += self._run_group(members)
        except DeviceLost as exc:
            self._give_back(pending, finished, exc)
            raise
        finally:
            if finished:
                despite_outage("delivering results", lambda: self.book.finish(finished))
            else:
                despite_outage("going idle", lambda: self._set_state("idle"))
            self.presence.release()

    def _check(self, taken: Taken) -> _Pending | None:
        """Stage 3: decode and check one job's request; fail the job (and return None) if it is bad."""
        started = taken.started
        job = JobRecord.parse(started.job_id, started.fields)
        timings: dict[str, float] = {}
        if job.enqueued_at is not None:
            timings["queue"] = max(0.0, started.started_at.timestamp() - job.enqueued_at.timestamp())
        if self.max_batch > 1:
            timings["batch_wait"] = self.intake.batch_wait
        nonce = None
        try:
            if started.oversized is not None:  # not read: what it would have said is unknown
                raise InvalidJob(f"job field {started.oversized!r} is larger than an ortq job's can be")
            if job.forbidden is not None:
                log.error("refusing job %s: %s", job.job_id, job.forbidden)
                raise UnknownJobFunction(job.forbidden)
            waited = timings.get("queue")
            if job.ttl is not None and job.ttl > 0 and waited is not None and waited > job.ttl:
                raise RequestExpired(
                    f"job {job.job_id} waited {waited:.1f} s for a worker, past its ttl of {job.ttl} s"
                )
            frame = taken.frame
            if frame is None:
                raise RequestExpired(
                    f"the request tensors of job {job.job_id} were gone when a worker took it "
                    "(its ttl passed, or they were deleted)"
                )
            if isinstance(frame, OrtqError):
                raise frame
            t0 = time.perf_counter()
            request = wire.decode_request(frame, max_bytes=self.settings.max_frame_bytes)
            nonce = request.nonce
            self.model.signature.check_inputs(request.inputs)
            rows = _rows(request.inputs) if self.max_batch > 1 else 1
            timings["decode"] = time.perf_counter() - t0
        except Exception as exc:
            self._fail(started, job, exc, timings, nonce)
            return None
        return _Pending(job, started, request.inputs, timings, rows, nonce)

    def _run_group(self, members: list[_Pending]) -> list[Finished]:
        """Stages 4-6 for one group: one run, the outputs split per job and encoded. If the run
        fails, each job runs alone so that only the bad one fails."""
        t0 = time.perf_counter()
        timeouts = [m.job.timeout for m in members if m.job.timeout is not None and m.job.timeout > 0]
        try:
            outputs = self.model.run(concat([m.inputs for m in members]), timeout=min(timeouts, default=None))
            per_job = split(outputs, [m.rows for m in members]) if len(members) > 1 else [outputs]
        except JobTimeout as exc:
            for member in members:  # running them again would only time out again
                self._fail(member.started, member.job, exc, member.timings, member.nonce)
            return []
        except Exception as exc:
            if self.is_device_lost(exc):
                raise DeviceLost(f"the device is lost: {type(exc).__name__}: {exc}") from exc
            if len(members) > 1:
                log.warning("batched run of %d jobs failed (%s); running them one by one", len(members), exc)
                return [f for m in members for f in self._run_group([m])]
            member = members[0]
            self._fail(member.started, member.job, exc, member.timings, member.nonce)
            return []
        run = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.batch_ran(len(members))
        finished = []
        for member, outputs_of_job in zip(members, per_job, strict=True):
            timings = {**member.timings, "run": run}
            t1 = time.perf_counter()
            frame = wire.encode_response(outputs_of_job, timings, member.nonce)
            timings["encode"] = time.perf_counter() - t1
            if self.metrics is not None:
                self.metrics.job_succeeded(timings)
            summary = {
                "reply_key": keys.reply_key(member.job.job_id),
                "outputs": {name: [str(v.dtype), list(v.shape)] for name, v in outputs_of_job.items()},
                "batch_size": len(members),
                "timings": timings,
            }
            ttl = _ttl(member.job.result_ttl, self.settings.result_ttl)
            finished.append(Finished(member.started, frame, ttl, MsgpackSerializer.dumps(summary)))
        return finished

    def _fail(
        self, started: StartedJob, job: JobRecord, exc: BaseException, timings: dict[str, float], nonce: bytes | None
    ) -> None:
        """Fail one started job: its error reply, RQ's failure records; or, when it has retries
        left and the failure is not the job's own fault (an OrtqError: bad input, expiry, a
        timeout), put it back for another attempt."""
        error_type = type(exc).__name__
        message = str(exc) or error_type
        retry = None
        if job.retries_left > 0 and not isinstance(exc, OrtqError):
            wait = job.retry_interval()
            # Its hash lives as a queued job's does (ortq.producer.enqueue): its wait, then failure_ttl.
            waiting = min(job.ttl, self.settings.request_ttl) if job.ttl and job.ttl > 0 else self.settings.request_ttl
            ttl = wait + waiting + _ttl(job.failure_ttl, self.settings.failure_ttl)
            retry = Retry(job.retries_left - 1, time.time() + wait if wait else None, ttl)
        error = wire.encode_error(error_type, message, timings, nonce)
        ttl = _ttl(job.failure_ttl, self.settings.failure_ttl)
        reason = f"{error_type}: {message}"
        if not despite_outage("failing a job", lambda: self.book.fail(started, error, ttl, reason, retry, state="")):
            log.warning(
                "job %s failed here (%s) but was taken back by another worker meanwhile", job.job_id, error_type
            )
            return
        log.warning("job %s failed%s: %s", job.job_id, " (will retry)" if retry else "", reason[:2000])
        if self.metrics is not None and retry is None:
            self.metrics.job_failed(error_type, timings)

    def _give_back(self, pending: list[_Pending], finished: list[Finished], exc: DeviceLost) -> None:
        """The GPU is gone: requeue every job of the batch that has no answer yet; the session
        cannot run again, so a fresh process must take over (EXIT_DEVICE_LOST)."""
        log.critical("%s; requeueing this worker's jobs and exiting with status %d", exc, EXIT_DEVICE_LOST)
        answered = {f.started.job_id for f in finished}
        for item in pending:
            if item.started.job_id not in answered:
                despite_outage(
                    "requeueing after device loss",
                    lambda item=item: self.upkeep.take_back(  # type: ignore[misc]
                        item.started.job_id, item.started.execution_id, self.name, f"worker {self.name} lost its device"
                    ),
                )
        self.stop_requested.set()


def _rows(inputs: dict[str, np.ndarray]) -> int:
    """The rows a job adds to a batch: every input's first dimension, which must agree."""
    sizes = {name: value.shape[0] if value.ndim else None for name, value in inputs.items()}
    distinct = set(sizes.values())
    if len(distinct) != 1 or None in distinct:
        raise InvalidInput(f"with batching every input of a job needs the same first dimension (its rows); got {sizes}")
    return int(distinct.pop() or 0)


def _ttl(from_job: int | None, default: int) -> int:
    """The job's own result/failure ttl when it is a positive number of seconds, else ortq's."""
    return min(from_job, MAX_SECONDS) if from_job is not None and from_job > 0 else default

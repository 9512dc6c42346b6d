"""The RQ worker that owns one ONNX Runtime session and runs ortq jobs on it.

It is an RQ ``SimpleWorker`` (no fork, so the session lives as long as the process), so
RQ's registries, statuses, worker records, maintenance and failure handling stay RQ's; what
it replaces is the per-job path. RQ's costs ~20 round trips and two zlib passes per job;
this one costs three: the dequeue (BLMOVE, as RQ), then bookkeeping.py's ``start`` script
(RQ's "started" writes + the job hash + the request frame) and, after ``session.run``, its
``finish`` script, which pushes the reply before RQ's "finished" writes. Failed jobs go
through RQ's own ``handle_job_failure``, after their error reply.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from rq.defaults import DEFAULT_WORKER_TTL
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.utils import now
from rq.worker import WorkerStatus

from ortq import keys, wire
from ortq.errors import EXIT_DEVICE_LOST, DeviceLost, JobTimeout, OrtqError, RequestExpired, UnknownJobFunction
from ortq.rqjob import MAX_SECONDS, JobRecord, OrtqJob
from ortq.serializer import MsgpackSerializer
from ortq.settings import REDIS_DOWN, Settings
from ortq.worker.base import PublishingWorker, WorkerIdentity
from ortq.worker.batch import batch_key, concat, group, split
from ortq.worker.bookkeeping import Bookkeeping, FinishedJob, StartedJob
from ortq.worker.devicelost import DeviceLostMatcher
from ortq.worker.maintenance import Maintenance, despite_outage
from ortq.worker.pulse import Pulse
from ortq.worker.session import LoadedModel

log = logging.getLogger("ortq.worker")

#: Errors caused by the job itself: retrying them cannot help, so they are never retried.
_PERMANENT_ERRORS = (
    "InvalidInput",
    "UnsupportedDtype",
    "WireFormatError",
    "PayloadTooLarge",
    "UnknownJobFunction",
    "RequestExpired",
)


class OrtqWorker(PublishingWorker):
    """One process, one session, one model queue."""

    def __init__(
        self,
        model: LoadedModel,
        identity: WorkerIdentity,
        settings: Settings,
        name: str | None = None,
        max_batch: int = 1,
        max_wait_ms: float = 0.0,
        device_lost_pattern: str | None = None,
    ) -> None:
        connection = settings.connect()
        queue = Queue(
            keys.queue_name(identity.model), connection=connection, serializer=MsgpackSerializer, job_class=OrtqJob
        )
        super().__init__(queue, identity, settings, model.signature.to_json(), name)
        self.model = model
        self.bookkeeping = Bookkeeping(connection, self.name, queue.name, DEFAULT_WORKER_TTL + 60)
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000
        self._batch: list[StartedJob] = []
        self._batch_wait = 0.0
        self._idle_slice = 1.0 if sys.platform == "win32" else min(settings.block_slice, settings.heartbeat_seconds)
        self.maintenance = Maintenance(connection, self.bookkeeping, settings, queue, self.name)
        self.is_device_lost = DeviceLostMatcher(device_lost_pattern)
        #: Set when a run failed because the GPU is gone; the worker then stops (see serve.py).
        self.device_lost: DeviceLost | None = None
        #: Set when an unexpected error ended the work loop (see serve.py's exit status).
        self.crashed: Exception | None = None
        self.pulse: Pulse[list[_Pending]] = Pulse(self._beat_during_run, settings.heartbeat_seconds)

    def register_birth(self) -> None:
        # ortq's record (what producers and tests wait for) is not published here but by the
        # first heartbeat of the work loop: only then are the signal handlers installed, so a
        # worker that is seen as ready can always be stopped cleanly.
        super().register_birth()
        self.pulse.start()
        log.info("worker %s serving model %r on %s", self.name, self.identity.model, self.identity.provider)

    def register_death(self) -> None:
        self.pulse.stop()
        super().register_death()

    # ----------------------------------------------------------- the per-job path

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[OrtqJob, Queue] | None:
        with self._noting_crashes():
            return self._dequeue(timeout, max_idle_time)

    def _dequeue(self, timeout: int | None, max_idle_time: int | None) -> tuple[OrtqJob, Queue] | None:
        """Take the next job (BLMOVE into RQ's intermediate list, as RQ does), start it and, when
        batching, up to ``max_batch - 1`` more; the batch is kept for ``execute_job``.

        Returns None when ``timeout`` (or ``max_idle_time``) passes with nothing to do, or at
        once in burst mode (``timeout`` None) when the queue is empty.
        """
        queue = self.queues[0]
        self.set_state(WorkerStatus.IDLE)
        idle_until = None if max_idle_time is None else time.monotonic() + max_idle_time
        backoff = 0.5
        while True:
            if self._stop_requested:  # a shutdown command (base.py) while idle
                return None
            try:
                self.heartbeat()
                if self.should_run_maintenance_tasks:
                    self.run_maintenance_tasks()
                self.maintenance.run()
                if timeout is None:  # burst: never block
                    raw_id = self._pop(queue, None)
                    if raw_id is None:
                        return None
                else:
                    # Block in short slices: on Windows a signal does not interrupt a blocking
                    # socket read, so a stop request is only seen once the read returns.
                    left = math.inf if idle_until is None else idle_until - time.monotonic()
                    raw_id = self._pop(queue, max(0.01, min(self._idle_slice, left)))
                    if raw_id is None:
                        if idle_until is not None and time.monotonic() >= idle_until:
                            return None
                        continue
                # Busy from here: a stop request now waits for the job instead of abandoning it
                # between the start script (status "started") and its run.
                self._state = WorkerStatus.BUSY
                batch = self.bookkeeping.start(raw_id, self.max_batch - 1)
                waited = time.perf_counter()
                batch += self._wait_for_more(queue, len(batch))
                self._batch_wait = time.perf_counter() - waited
                while batch:  # RQ's code paths get the first job as RQ loads it
                    try:
                        first = self._full_job(batch[0])
                    except Exception as exc:  # a forged hash RQ cannot read: fail it, never crash
                        bad = batch.pop(0)
                        forbidden = JobRecord.parse(bad.job_id, bad.job_hash).forbidden
                        if forbidden is not None:
                            self._reject(bad, "UnknownJobFunction", forbidden, {})
                        else:
                            self._reject(bad, "InvalidJob", f"RQ cannot read this job's record: {exc!r}"[:500], {})
                        continue
                    self._batch = batch
                    return first, queue
                self._state = WorkerStatus.IDLE
                # Its hash expired while it waited (its ttl passed): RQ skips such jobs too.
            except REDIS_DOWN as exc:
                # Redis restarting or unreachable: wait and reconnect (redis-py reconnects on the
                # next command), backing off to at most 5 s, and never exit for it.
                self._state = WorkerStatus.IDLE
                log.error("Redis unavailable (%s); retrying in %.1f s", exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                if self._stop_requested:
                    return None

    def _pop(self, queue: Queue, block: float | None) -> bytes | None:
        if block is None:
            return self.connection.lmove(queue.key, queue.intermediate_queue_key)  # type: ignore[return-value]
        # Redis >= 6 takes fractional timeouts; redis-py's annotation says int.
        return self.connection.blmove(queue.key, queue.intermediate_queue_key, block)  # type: ignore[arg-type,return-value]

    def _wait_for_more(self, queue: Queue, have: int) -> list[StartedJob]:
        """Fill the batch with jobs that arrive within ``max_wait`` of the first."""
        more: list[StartedJob] = []
        deadline = time.monotonic() + self.max_wait
        while 0 < have + len(more) < self.max_batch and (left := deadline - time.monotonic()) > 0.001:
            raw_id = self._pop(queue, left)
            if raw_id is None:
                break
            more += self.bookkeeping.start(raw_id, self.max_batch - have - len(more) - 1)
        return more

    def _full_job(self, started: StartedJob) -> OrtqJob:
        """The job as RQ loads it, for RQ's own code paths (failure handling saves it whole)."""
        job = OrtqJob(id=started.job_id, connection=self.connection, serializer=MsgpackSerializer)
        job.restore(started.job_hash)
        job.started_at = started.started_at
        return job

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Run the batch ``dequeue_job_and_maintain_ttl`` took (``job`` is its first job).

        Each job is checked on its own and a bad one fails alone; the good ones run in groups of
        batch-compatible inputs, and all of them are replied to and finished in one round trip.
        """
        with self._noting_crashes():
            self._execute(queue)

    @contextlib.contextmanager
    def _noting_crashes(self) -> Iterator[None]:
        """Remember an unexpected error on its way to RQ's work loop, which logs it and quits:
        serve.py then exits with EXIT_CRASHED, not 0."""
        try:
            yield
        except StopRequested:  # RQ's signal handler, for a stop while idle: a clean exit
            raise
        except Exception as exc:
            self.crashed = exc
            raise

    def _execute(self, queue: Queue) -> None:
        batch, self._batch = self._batch, []
        pending: list[_Pending] = []
        for started in batch:
            item = self._prepare(started, queue)
            if item is not None:
                pending.append(item)
        finished: list[FinishedJob] = []
        try:
            for members in group(pending, lambda p: batch_key(p.inputs), self.max_batch, lambda p: p.rows):
                finished += self._run_group(members, queue)
        except DeviceLost as exc:
            self._give_back(pending, finished, exc)
        if finished:
            despite_outage("delivering results", lambda: self.bookkeeping.finish(finished))
        self.execution = None
        self._state = WorkerStatus.IDLE

    def _give_back(self, pending: list[_Pending], finished: list[FinishedJob], exc: DeviceLost) -> None:
        """The GPU is gone: requeue every job of the batch that has no answer yet, and stop; the
        session cannot run again, so a fresh process must take over (serve.py's exit status)."""
        log.critical("%s; requeueing this worker's jobs and exiting with status %d", exc, EXIT_DEVICE_LOST)
        answered = {f.started.job_id for f in finished}
        for item in pending:
            if item.job.job_id not in answered:
                despite_outage(
                    "requeueing after device loss",
                    lambda item=item: self.maintenance.take_back(  # type: ignore[misc]
                        item.job.job_id, item.started.execution_id, f"worker {self.name} lost its device"
                    ),
                )
        self.device_lost = exc
        self._stop_requested = True
        if self.metrics is not None:
            self.metrics.set_ready(False)

    def _prepare(self, started: StartedJob, queue: Queue) -> _Pending | None:
        """Decode and check one job's request; fail the job (and return None) if it is bad."""
        job = JobRecord.parse(started.job_id, started.job_hash)
        timings: dict[str, float] = {}
        if job.enqueued_at is not None:
            timings["queue"] = max(0.0, started.started_at.timestamp() - job.enqueued_at.timestamp())
        if self.max_batch > 1:
            timings["batch_wait"] = self._batch_wait
        try:
            if job.forbidden is not None:
                log.error("refusing job %s: %s", job.job_id, job.forbidden)
                raise UnknownJobFunction(job.forbidden)
            waited = timings.get("queue")
            if job.ttl is not None and job.ttl > 0 and waited is not None and waited > job.ttl:
                raise RequestExpired(
                    f"job {job.job_id} waited {waited:.1f} s for a worker, past its ttl of {job.ttl} s"
                )
            if started.frame is None:
                raise RequestExpired(
                    f"the request tensors of job {job.job_id} were gone when a worker took it "
                    "(its ttl passed, or they were deleted)"
                )
            t0 = time.perf_counter()
            request = wire.decode_request(started.frame, max_bytes=self.settings.max_frame_bytes)
            self.model.signature.check_inputs(request.inputs)
            timings["decode"] = time.perf_counter() - t0
        except Exception as exc:
            self._fail(started, queue, exc, timings)
            return None
        rows = next(iter(request.inputs.values())).shape[0] if self.max_batch > 1 and request.inputs else 1
        return _Pending(job, started, request.inputs, timings, rows)

    def _beat_during_run(self, members: list[_Pending]) -> None:
        """What RQ's heartbeats would keep fresh, for a run that is still going: the worker's
        hash and ortq's records, and each running job's started-registry entry and execution."""
        with self.connection.pipeline(transaction=False) as pipe:
            super().heartbeat(self.worker_ttl + 60, pipeline=pipe)
            self._publish(pipe)
            self.bookkeeping.refresh_started(pipe, [(m.started, m.job.timeout) for m in members])
            pipe.execute()
        self.maintenance.while_running()

    def _run_group(self, members: list[_Pending], queue: Queue) -> list[FinishedJob]:
        """One run for the group; if it fails, each job runs alone so that only the bad one fails."""
        t0 = time.perf_counter()
        timeouts = [m.job.timeout for m in members if m.job.timeout is not None and m.job.timeout > 0]
        try:
            with self.pulse.running(members):
                outputs = self.model.run(concat([m.inputs for m in members]), timeout=min(timeouts, default=None))
            per_job = split(outputs, [m.rows for m in members]) if len(members) > 1 else [outputs]
        except JobTimeout as exc:
            for member in members:  # running them again would only time out again
                self._fail(member.started, queue, exc, member.timings)
            return []
        except Exception as exc:
            if self.is_device_lost(exc):
                raise DeviceLost(f"the device is lost: {type(exc).__name__}: {exc}") from exc
            if len(members) > 1:
                log.warning("batched run of %d jobs failed (%s); running them one by one", len(members), exc)
                return [f for m in members for f in self._run_group([m], queue)]
            self._fail(members[0].started, queue, exc, members[0].timings)
            return []
        run = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.batch_ran(len(members))
        finished = []
        for member, outputs_of_job in zip(members, per_job, strict=True):
            timings = {**member.timings, "run": run}
            t1 = time.perf_counter()
            frame = wire.encode_response(outputs_of_job, timings)
            timings["encode"] = time.perf_counter() - t1
            if self.metrics is not None:
                self.metrics.job_succeeded(timings)
            summary = {
                "reply_key": keys.reply_key(member.job.job_id),
                "outputs": {name: [str(v.dtype), list(v.shape)] for name, v in outputs_of_job.items()},
                "batch_size": len(members),
                "timings": timings,
            }
            ttl = self._ttl(member.job.result_ttl, self.settings.result_ttl)
            finished.append(FinishedJob(member.started, frame, ttl, summary))
        return finished

    @staticmethod
    def _ttl(from_job: int | None, default: int) -> int:
        """The job's own result/failure ttl when it is a positive number of seconds, else ortq's."""
        return min(from_job, MAX_SECONDS) if from_job is not None and from_job > 0 else default

    def _fail(self, started: StartedJob, queue: Queue, exc: BaseException, timings: dict[str, float]) -> None:
        """Fail one started job: its error reply first (unless it will be retried), then RQ's own
        failure path (failed registry, retries); neither when another worker has taken it back."""
        despite_outage("failing a job", lambda: self._fail_once(started, queue, exc, timings))

    def _fail_once(self, started: StartedJob, queue: Queue, exc: BaseException, timings: dict[str, float]) -> None:
        error_type = type(exc).__name__
        message = str(exc) or error_type
        try:
            job = self._full_job(started)  # the full record: RQ's failure path writes all of it back
        except Exception as unreadable:  # a forged hash RQ cannot read: fail it without RQ
            self._reject(started, error_type, f"{message} (and RQ cannot read its record: {unreadable!r})", timings)
            return
        job.ended_at = now()
        if isinstance(exc, OrtqError) or error_type in _PERMANENT_ERRORS:
            job.retries_left = None  # the job itself is wrong: another attempt would fail the same way
        will_retry = bool(job.should_retry)
        error = None if will_retry else wire.encode_error(error_type, message, timings)
        if not self.bookkeeping.fail(started, error, self._ttl(job.failure_ttl, self.settings.failure_ttl)):
            log.warning("job %s failed here (%s) but was taken back by another worker meanwhile", job.id, error_type)
            return
        log.warning("job %s failed%s: %s: %s", job.id, " (will retry)" if will_retry else "", error_type, message)
        if self.metrics is not None and not will_retry:
            self.metrics.job_failed(error_type, timings)
        # What RQ keeps in memory about a job it has started, for its failure path.
        self.execution = Execution(started.execution_id, job.id, self.connection, worker_name=self.name)
        self.execution.created_at = started.started_at
        self.handle_job_failure(job, queue, exc_string=f"{error_type}: {message}")
        self.set_state(WorkerStatus.IDLE)

    def _reject(self, started: StartedJob, error_type: str, message: str, timings: dict[str, float]) -> None:
        """Fail a job whose RQ record RQ cannot load (so RQ's failure path cannot run): the error
        reply, status failed and the failed registry, written by one fenced script."""
        log.error("job %s failed without RQ: %s: %s", started.job_id, error_type, message)
        error = wire.encode_error(error_type, message, timings)
        self.bookkeeping.recover(
            started.job_id, started.execution_id, -1, self.settings.failure_ttl, error, f"{error_type}: {message}"
        )
        if self.metrics is not None:
            self.metrics.job_failed(error_type, timings)


@dataclass
class _Pending:
    """A job whose request decoded and fits the model, waiting for its group's run."""

    job: JobRecord
    started: StartedJob
    inputs: dict[str, np.ndarray]
    timings: dict[str, float]
    rows: int

"""The RQ worker that owns one ONNX Runtime session and runs ortq jobs on it.

It is an RQ ``SimpleWorker`` (no fork, so the session lives as long as the process), so
RQ's registries, statuses, worker records and maintenance stay true; what it replaces is
the per-job path. RQ's own path costs ~20 round trips and two zlib passes per job; this
one costs three pipelines after the dequeue:

1. start: GET the request frame + RQ's "started" bookkeeping (execution, registry, status);
2. reply: RPUSH the response frame to the job's reply list, which the producer is blocked on;
3. finish: RQ's "finished"/"failed" bookkeeping and deletion of the request frame.

The reply goes out before RQ's bookkeeping so that a producer's latency does not include it.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import DeferredJobRegistry, FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.utils import now
from rq.worker import SimpleWorker, WorkerStatus
from rq.worker_registration import clean_worker_registry

from ortq import keys, wire
from ortq.errors import OrtqError, RequestExpired, UnknownJobFunction
from ortq.rqjob import OrtqJob
from ortq.serializer import MsgpackSerializer
from ortq.settings import Settings
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

#: Seconds between worker heartbeats that are not part of a job's own pipelines.
_HEARTBEAT_EVERY = 5.0


@dataclass
class WorkerIdentity:
    """What the worker publishes under ``ortq:worker:<name>``, besides its live counters."""

    model: str
    model_path: str
    provider: str
    device_id: int | None
    fell_back_to_cpu: bool
    host: str
    pid: int
    extra: dict[str, Any] = field(default_factory=dict)


class OrtqWorker(SimpleWorker):
    """One process, one session, one model queue."""

    def __init__(
        self,
        model: LoadedModel,
        identity: WorkerIdentity,
        settings: Settings,
        name: str | None = None,
    ) -> None:
        connection = settings.connect()
        queue = Queue(
            keys.queue_name(identity.model),
            connection=connection,
            serializer=MsgpackSerializer,
            job_class=OrtqJob,
        )
        super().__init__(
            [queue],
            name=name,
            connection=connection,
            serializer=MsgpackSerializer,
            job_class=OrtqJob,
            queue_class=Queue,
        )
        self.model = model
        self.identity = identity
        self.settings = settings
        self._last_beat = 0.0
        self._signature_json = json.dumps({"model": identity.model, **model.signature.to_json()})

    # ----------------------------------------------------------- records ortq publishes

    def record(self) -> dict[str, Any]:
        ident = self.identity
        return {
            "name": self.name,
            "model": ident.model,
            "model_path": ident.model_path,
            "provider": ident.provider,
            "device_id": ident.device_id,
            "fell_back_to_cpu": ident.fell_back_to_cpu,
            "host": ident.host,
            "pid": ident.pid,
            "queue": keys.queue_name(ident.model),
            "state": self.get_state(),
            "signature": self.model.signature.to_json(),
            **ident.extra,
        }

    def _publish(self, pipe: Any) -> None:
        ttl = self.worker_ttl + 60
        pipe.set(keys.worker_key(self.name), json.dumps(self.record()), ex=ttl)
        pipe.sadd(keys.WORKERS_SET, self.name)
        pipe.set(keys.signature_key(self.identity.model), self._signature_json, ex=self.settings.request_ttl)

    def register_birth(self) -> None:
        super().register_birth()
        with self.connection.pipeline(transaction=False) as pipe:
            self._publish(pipe)
            pipe.execute()
        log.info("worker %s serving model %r on %s", self.name, self.identity.model, self.identity.provider)

    def register_death(self) -> None:
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.delete(keys.worker_key(self.name))
            pipe.srem(keys.WORKERS_SET, self.name)
            pipe.execute()
        super().register_death()

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's heartbeat in one round trip, refreshing ortq's records too; standalone beats are
        rate-limited because RQ calls this several times per job and the TTL is minutes long."""
        if pipeline is not None:
            super().heartbeat(timeout, pipeline=pipeline)
            return
        if time.monotonic() - self._last_beat < _HEARTBEAT_EVERY and timeout is None:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            super().heartbeat(timeout, pipeline=pipe)
            self._publish(pipe)
            pipe.execute()
        self._last_beat = time.monotonic()

    def set_state(self, state: str, pipeline: Any = None) -> None:
        if pipeline is None and state == self._state:
            return  # RQ re-announces IDLE before every dequeue; it is already written
        super().set_state(state, pipeline=pipeline)

    # ----------------------------------------------------------- platform and maintenance

    def _install_signal_handlers(self) -> None:
        super()._install_signal_handlers()
        sigbreak = getattr(signal, "SIGBREAK", None)  # CTRL_BREAK_EVENT on Windows
        if sigbreak is not None:
            signal.signal(sigbreak, self.request_stop)

    def clean_registries(self) -> None:
        """RQ's registry maintenance, with this worker's job class and death penalty.

        RQ's own ``clean_registries`` builds registries whose death penalty is hard-coded to
        SIGALRM, which does not exist on Windows; OrtqJob makes sure no callback is imported.
        """
        for queue in self.queues:
            if not queue.acquire_maintenance_lock():
                continue
            for registry_class in (
                FinishedJobRegistry,
                StartedJobRegistry,
                FailedJobRegistry,
                DeferredJobRegistry,
            ):
                registry_class(
                    name=queue.name,
                    connection=self.connection,
                    job_class=OrtqJob,
                    serializer=MsgpackSerializer,
                    death_penalty_class=self.death_penalty_class,
                ).cleanup(exception_handlers=self._exc_handlers)
            clean_worker_registry(queue)
            queue.intermediate_queue.cleanup(self, queue)
            queue.release_maintenance_lock()
        self.last_cleaned_at = now()  # type: ignore[assignment]  # RQ annotates it as None only

    # ----------------------------------------------------------- the per-job path

    def execute_job(self, job: Job, queue: Queue) -> None:
        assert isinstance(job, OrtqJob)  # this worker's job_class: see __init__
        reason = job.forbidden_reason()
        if reason is not None:
            log.error("refusing job %s: %s", job.id, reason)
            self._fail_unstarted(job, queue, UnknownJobFunction(reason))
            return

        frame = self._start(job, queue)
        started = time.time()
        timings: dict[str, float] = {}
        if job.enqueued_at is not None:
            timings["queue"] = max(0.0, started - job.enqueued_at.timestamp())
        try:
            if frame is None:
                raise RequestExpired(
                    f"the request tensors of job {job.id} were gone when a worker took it "
                    "(its ttl passed, or they were deleted)"
                )
            t0 = time.perf_counter()
            request = wire.decode_request(frame, max_bytes=self.settings.max_frame_bytes)
            self.model.signature.check_inputs(request.inputs)
            t1 = time.perf_counter()
            outputs = self.model.run(request.inputs)
            t2 = time.perf_counter()
            timings.update(decode=t1 - t0, run=t2 - t1)
            response = wire.encode_response(outputs, timings)
            timings["encode"] = time.perf_counter() - t2
        except Exception as exc:
            self._fail_started(job, queue, exc, timings)
            return
        result_ttl = self.settings.result_ttl if job.result_ttl is None else job.result_ttl
        self._reply(job, response, result_ttl, JobStatus.FINISHED)
        self._finish(job, queue, outputs, timings)

    def _start(self, job: OrtqJob, queue: Queue) -> bytes | None:
        """Mark the job started (what RQ's prepare_execution + prepare_job_execution write) and
        fetch its request frame, in one round trip."""
        ttl = self.get_heartbeat_ttl(job)
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.get(keys.request_key(job.id))
            self.execution = Execution.create(job, ttl, pipeline=pipe, worker_name=self.name)
            self.set_state(WorkerStatus.BUSY, pipeline=pipe)
            self.set_current_job_id(job.id, pipeline=pipe)
            self.set_current_job_working_time(0, pipeline=pipe)
            super().heartbeat(ttl, pipeline=pipe)
            job.prepare_for_execution(self.name, pipeline=pipe)
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            frame: bytes | None = pipe.execute()[0]
        return frame

    def _reply(self, job: OrtqJob, frame: bytes, ttl: int, status: JobStatus) -> None:
        """Push the response; the job's status changes with it, so that no reader who has seen
        the response is told the job is still running while RQ's bookkeeping follows."""
        key = keys.reply_key(job.id)
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.delete(key)  # a job is answered once, even if it ran twice
            pipe.rpush(key, frame)
            pipe.expire(key, max(1, ttl))
            pipe.hset(job.key, "status", status.value)
            pipe.execute()

    def _finish(self, job: OrtqJob, queue: Queue, outputs: dict[str, Any], timings: dict[str, float]) -> None:
        """RQ's success bookkeeping (what handle_job_success writes) in one round trip."""
        job.ended_at = now()
        assert job.started_at is not None  # set by _start
        job._result = {
            "reply_key": keys.reply_key(job.id),
            "outputs": {name: [str(value.dtype), list(value.shape)] for name, value in outputs.items()},
            "timings": timings,
        }
        result_ttl = job.get_result_ttl(self.settings.result_ttl)
        execution = self.execution
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.delete(keys.request_key(job.id))
            self.increment_successful_job_count(pipeline=pipe)
            self.increment_total_working_time(job.ended_at - job.started_at, pipe)
            job._handle_success(
                result_ttl,
                pipeline=pipe,
                worker_name=self.name,
                execution_id=execution.id if execution else None,
                execution_started_at=execution.created_at if execution else None,
                execution_ended_at=job.ended_at,
            )
            job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
            self.cleanup_execution(job, pipeline=pipe)
            self.set_state(WorkerStatus.IDLE, pipeline=pipe)
            pipe.execute()
        log.debug("job %s finished in %.1f ms", job.id, 1000 * sum(timings.values()))

    def _fail_started(self, job: OrtqJob, queue: Queue, exc: BaseException, timings: dict[str, float]) -> None:
        error_type = type(exc).__name__
        message = str(exc) or error_type
        job.ended_at = now()
        permanent = isinstance(exc, OrtqError) or error_type in _PERMANENT_ERRORS
        if permanent:
            job.retries_left = None  # the input itself is wrong: another attempt would fail the same way
        will_retry = bool(job.should_retry)
        log.warning("job %s failed%s: %s: %s", job.id, " (will retry)" if will_retry else "", error_type, message)
        if not will_retry:
            ttl = job.failure_ttl or self.settings.failure_ttl
            self._reply(job, wire.encode_error(error_type, message, timings), ttl, JobStatus.FAILED)
            self.connection.delete(keys.request_key(job.id))
        self.handle_job_failure(job, queue, exc_string=f"{error_type}: {message}")
        self.set_state(WorkerStatus.IDLE)

    def _fail_unstarted(self, job: OrtqJob, queue: Queue, exc: OrtqError) -> None:
        """Fail a job that was refused before anything of it ran (it names a foreign callable)."""
        job.retries_left = None
        ttl = job.failure_ttl or self.settings.failure_ttl
        self._reply(job, wire.encode_error(type(exc).__name__, str(exc)), ttl, JobStatus.FAILED)
        job.ended_at = now()
        self.connection.delete(keys.request_key(job.id))
        self.connection.lrem(queue.intermediate_queue_key, 1, job.id)
        self.handle_job_failure(job, queue, exc_string=f"{type(exc).__name__}: {exc}")

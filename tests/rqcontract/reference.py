"""What RQ's own worker writes: RQ's ``SimpleWorker`` (burst, in-process) runs each scenario.

Every scenario enqueues with RQ's ``Queue.enqueue`` under fresh ids, with every lifetime given
explicitly (:data:`DURATIONS`), and returns its snapshots by stage:

* ``queued``: after the enqueue, before any worker ran;
* ``started``: from inside the running job;
* ``heartbeat`` (``success`` only): inside the job again, after RQ's ``maintain_heartbeats``, the
  beat RQ's forking worker sends every ``job_monitoring_interval`` while a job runs;
* ``ended``: after the worker handled the job, while it is still registered (idle);
* the ``worker`` scenario instead: ``birth`` (after ``register_birth``), ``busy`` (inside its
  first job), ``idle`` (after its two jobs: counters), ``death`` (after ``register_death``).
"""

from __future__ import annotations

import inspect
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import redis
from rq import Queue, Retry, SimpleWorker, get_current_job
from rq.defaults import DEFAULT_JOB_MONITORING_INTERVAL, DEFAULT_MAINTENANCE_TASK_INTERVAL, DEFAULT_WORKER_TTL

from ortq.serializer import MsgpackSerializer
from tests.rqcontract import jobs
from tests.rqcontract.snapshot import Snapshot, snapshot

RESULT_TTL = 700
FAILURE_TTL = 1500
JOB_TTL = 2400
JOB_TIMEOUT = 900
RETRY_INTERVALS = [300, 600]  # what ortq writes for retries=2, retry_backoff=300
# Every lifetime a scenario can produce, by name: key TTLs and registry scores read as these names
# (within classify.DURATION_TOLERANCE seconds). Spaced apart so that no two can be confused.
DURATIONS = {
    "result_ttl": RESULT_TTL,
    "failure_ttl": FAILURE_TTL,
    "ttl": JOB_TTL,
    "ttl+failure_ttl": JOB_TTL + FAILURE_TTL,  # how long ortq's producer keeps a queued job's hash
    "job_timeout": JOB_TIMEOUT,
    "job_timeout+60": JOB_TIMEOUT + 60,  # SimpleWorker's heartbeat TTL for a job
    "job_timeout+120": JOB_TIMEOUT + 120,  # an execution's registry score: heartbeat TTL + 60
    "retry_interval": RETRY_INTERVALS[0],
    "worker_ttl": DEFAULT_WORKER_TTL,
    "worker_ttl+60": DEFAULT_WORKER_TTL + 60,
    "job_monitoring_interval+60": DEFAULT_JOB_MONITORING_INTERVAL + 60,  # a worker's TTL after a heartbeat
    "maintenance_interval": DEFAULT_MAINTENANCE_TASK_INTERVAL,
}
SCENARIOS = ("success", "failure", "retry_now", "retry_later", "worker")
Stages = dict[str, Snapshot]


@dataclass(frozen=True)
class Ids:
    """One scenario's identifiers, fresh each time, and their placeholders."""

    queue: str
    worker: str
    jobs: tuple[str, ...]

    @classmethod
    def fresh(cls, scenario: str, job_count: int = 1) -> Ids:
        token = uuid4().hex[:12]
        return cls(f"rqc-{scenario}-{token}", f"rqcw-{token}", tuple(uuid4().hex for _ in range(job_count)))

    @property
    def placeholders(self) -> dict[str, str]:
        names = {self.queue: "<queue>", self.worker: "<worker>"}
        if len(self.jobs) == 1:
            return {**names, self.jobs[0]: "<job>"}
        return {**names, **{job: f"<job{n}>" for n, job in enumerate(self.jobs, 1)}}


class PromptSimpleWorker(SimpleWorker):
    """RQ's SimpleWorker, less a wait at its end that is no part of what RQ writes.

    Its teardown sends UNSUBSCRIBE for its command channel, then stops the thread listening there;
    redis-py 8's ``PubSubWorkerThread.stop()`` joins that thread. A thread that has already read the
    UNSUBSCRIBE reply when ``stop()`` comes is waiting for a new subscription, for RQ's
    ``sleep_time`` (60 s): the test waited a minute, whenever the thread won that race (mostly
    under load, as with pytest-xdist). Its run flag cleared before the UNSUBSCRIBE, it ends at the reply.
    """

    def unsubscribe(self) -> None:
        running = getattr(self.pubsub_thread, "_running", None)  # redis-py's PubSubWorkerThread's flag
        if running is not None:
            running.clear()
        super().unsubscribe()  # type: ignore[no-untyped-call]


class ReferenceWorker(PromptSimpleWorker):
    """RQ's SimpleWorker, reporting the moments around its birth and death to ``on_stage``."""

    on_stage: Callable[[str], None] | None = None

    def _stage(self, name: str) -> None:
        if self.on_stage is not None:
            self.on_stage(name)

    def register_birth(self) -> None:
        super().register_birth()  # type: ignore[no-untyped-call]
        self._stage("birth")

    def register_death(self) -> None:
        self._stage("idle")
        super().register_death()  # type: ignore[no-untyped-call]
        self._stage("death")

    def beat(self) -> None:
        """RQ's heartbeat for the job this worker runs (its signature gained ``execution`` in RQ 3)."""
        job = get_current_job()
        assert job is not None
        if "execution" in inspect.signature(self.maintain_heartbeats).parameters:
            self.maintain_heartbeats(job, self.execution)  # type: ignore[call-arg, unused-ignore]
        else:
            self.maintain_heartbeats(job)  # type: ignore[call-arg, unused-ignore]


@contextmanager
def _signals_restored() -> Iterator[None]:
    """work() installs its own SIGINT/SIGTERM handlers and leaves them: give pytest its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _enqueue(queue: Queue, job_id: str, func: Callable[..., Any], arg: object, retry: Retry | None = None) -> None:
    queue.enqueue(
        func, arg, job_id=job_id, result_ttl=RESULT_TTL, failure_ttl=FAILURE_TTL, ttl=JOB_TTL,
        job_timeout=JOB_TIMEOUT, retry=retry,
    )  # fmt: skip


def _run(connection: redis.Redis, ids: Ids, stages: dict[str, str], max_jobs: int | None) -> Stages:
    """Run a burst worker on the scenario's queue; ``stages`` maps our moment names to stage names.

    Moments: birth, running (inside the job), heartbeat (inside the job, after a heartbeat), idle, death.
    """
    taken: Stages = {}

    def take(moment: str) -> None:
        stage = stages.get(moment)
        if stage is not None and stage not in taken:
            taken[stage] = snapshot(connection, ids.placeholders, DURATIONS)

    queue = Queue(ids.queue, connection=connection, serializer=MsgpackSerializer)
    worker = ReferenceWorker([queue], name=ids.worker, connection=connection, serializer=MsgpackSerializer)
    worker.on_stage = take

    hook_errors: list[Exception] = []  # RQ would record them as the job's failure: raise them here

    def running() -> None:
        try:
            take("running")
            if "heartbeat" in stages:
                worker.beat()
                take("heartbeat")
        except Exception as exc:
            hook_errors.append(exc)
            raise

    jobs.while_running = running
    try:
        with _signals_restored():
            worker.work(burst=True, max_jobs=max_jobs, logging_level="CRITICAL")
    finally:
        jobs.while_running = None
    if hook_errors:
        raise hook_errors[0]
    missing = set(stages.values()) - taken.keys()
    if missing:
        raise AssertionError(f"the reference run never reached {sorted(missing)}")
    return taken


def _job_scenario(connection: redis.Redis, scenario: str, func: Callable[..., Any], arg: object,
                  retry: Retry | None = None, heartbeat: bool = False) -> Stages:  # fmt: skip
    ids = Ids.fresh(scenario)
    queue = Queue(ids.queue, connection=connection, serializer=MsgpackSerializer)
    _enqueue(queue, ids.jobs[0], func, arg, retry)
    queued = snapshot(connection, ids.placeholders, DURATIONS)
    # One job only: a requeued job would otherwise run again in the same burst.
    moments = {"running": "started", "idle": "ended"} | ({"heartbeat": "heartbeat"} if heartbeat else {})
    ran = _run(connection, ids, moments, max_jobs=1)
    return {"queued": queued, **ran}


def success(connection: redis.Redis) -> Stages:
    return _job_scenario(connection, "success", jobs.succeed, 3, heartbeat=True)


def failure(connection: redis.Redis) -> Stages:
    return _job_scenario(connection, "failure", jobs.fail, "reference failure")


def retry_now(connection: redis.Redis) -> Stages:
    return _job_scenario(connection, "retry_now", jobs.fail, "retried at once", Retry(max=2))


def retry_later(connection: redis.Redis) -> Stages:
    return _job_scenario(connection, "retry_later", jobs.fail, "retried later", Retry(max=2, interval=RETRY_INTERVALS))


def worker(connection: redis.Redis) -> Stages:
    """One worker's own records: born, busy with its first job, idle after a success and a failure, dead."""
    ids = Ids.fresh("worker", job_count=2)
    queue = Queue(ids.queue, connection=connection, serializer=MsgpackSerializer)
    _enqueue(queue, ids.jobs[0], jobs.succeed, 1)
    _enqueue(queue, ids.jobs[1], jobs.fail, "counted failure")
    moments = {"birth": "birth", "running": "busy", "idle": "idle", "death": "death"}
    return _run(connection, ids, moments, max_jobs=None)


def run_all(connection: redis.Redis) -> dict[str, Stages]:
    """Every scenario, by name (:data:`SCENARIOS`)."""
    runs: dict[str, Callable[[redis.Redis], Stages]] = {
        "success": success, "failure": failure, "retry_now": retry_now, "retry_later": retry_later, "worker": worker,
    }  # fmt: skip
    return {name: runs[name](connection) for name in SCENARIOS}

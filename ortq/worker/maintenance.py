"""What an idle worker does between jobs so that no job is stranded: take back jobs of dead
workers, put back jobs a lost reply left in the intermediate list, and requeue retries whose
backoff has passed (RQ leaves the first two to a cleanup that runs every 10 minutes and the last
to a separate scheduler process)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from rq.queue import Queue
from rq.registry import ScheduledJobRegistry

from ortq import keys, wire
from ortq.rqjob import OrtqJob
from ortq.serializer import MsgpackSerializer
from ortq.settings import REDIS_DOWN, Settings
from ortq.worker.bookkeeping import Bookkeeping

log = logging.getLogger("ortq.worker")

T = TypeVar("T")

#: Longest Redis outage a worker rides out while it holds finished work (outputs or an error it
#: has not delivered yet); past it, it exits and the surviving workers take its jobs back.
REDIS_OUTAGE_LIMIT = 120.0

#: How many times a job may be taken back from a dead worker before it is failed instead.
MAX_RECOVERIES = 2


class Maintenance:
    """The idle-time scans of one worker, each rate-limited (they cost a few round trips)."""

    def __init__(
        self, connection: redis.Redis, bookkeeping: Bookkeeping, settings: Settings, queue: Queue, worker_name: str
    ) -> None:
        self.connection = connection
        self.bookkeeping = bookkeeping
        self.settings = settings
        self.queue = queue
        self.worker_name = worker_name
        self._last_recovery_scan = 0.0
        self._last_retry_scan = 0.0

    def run(self) -> None:
        """Called by the worker only while it runs no job (its own started jobs are orphans then)."""
        beat = self.settings.heartbeat_seconds
        if time.monotonic() - self._last_recovery_scan >= beat / 2:
            self._last_recovery_scan = time.monotonic()
            self.recover_abandoned(dead_after=3 * beat)
            for job_id in self.bookkeeping.rescue_intermediate(grace=3 * beat):
                log.warning("job %s was left in the intermediate list (a lost dequeue reply); requeued", job_id)
        if time.monotonic() - self._last_retry_scan >= 1.0:
            self._last_retry_scan = time.monotonic()
            self.enqueue_due_retries()

    def while_running(self) -> None:
        """Called from the heartbeat thread during a run: other workers' abandoned jobs are taken
        back even when every worker of the model is busy with long runs."""
        self.recover_abandoned(dead_after=3 * self.settings.heartbeat_seconds, own=False)

    def recover_abandoned(self, dead_after: float, own: bool = True) -> None:
        """Take back jobs whose worker died mid-run (SIGKILL, OOM, a GPU reset): their started
        entry stays while their worker's heartbeat, kept up even during a run (pulse.py), stops.
        Such a job is requeued at the front, or failed with WorkerLost once it has been taken back
        MAX_RECOVERIES times (a job that crashes every worker must not crash them all)."""
        for job_id, execution_id, owner in self.bookkeeping.abandoned(dead_after, own):
            if owner == self.worker_name:
                message = "this worker's reply to starting the job was lost (Redis restarted or the connection dropped)"
            else:
                message = f"worker {owner} stopped sending heartbeats while running this job (it died or hung)"
            self.take_back(job_id, execution_id, message)

    def take_back(self, job_id: str, execution_id: str, message: str) -> None:
        """Requeue one started job at the front (or fail it, past MAX_RECOVERIES), saying why."""
        error = wire.encode_error("WorkerLost", f"{message}; it was taken back {MAX_RECOVERIES} times")
        outcome = self.bookkeeping.recover(job_id, execution_id, MAX_RECOVERIES, self.settings.failure_ttl, error)
        if outcome:
            log.warning("job %s: %s; %s", job_id, message, outcome)

    def enqueue_due_retries(self) -> None:
        """Move retries whose backoff has passed from RQ's scheduled registry back to the queue
        (what RQ's scheduler process would do), under a short lock so that of several workers one
        moves each job."""
        queue = self.queue
        registry = ScheduledJobRegistry(queue.name, connection=self.connection, serializer=MsgpackSerializer)
        due = registry.get_jobs_to_schedule(int(time.time()))
        lock = keys.PREFIX + "retry-lock:" + queue.name
        if not due or not self.connection.set(lock, self.worker_name, nx=True, ex=5):
            return
        with self.connection.pipeline() as pipe:
            for job in OrtqJob.fetch_many(due, connection=self.connection, serializer=MsgpackSerializer):
                if job is not None:
                    queue._enqueue_job(job, pipeline=pipe, at_front=True)
            for job_id in due:
                registry.remove(job_id, pipeline=pipe)
            pipe.execute()
        self.connection.delete(lock)


def despite_outage(what: str, call: Callable[[], T]) -> T:
    """``call()``, retried through a Redis outage of up to REDIS_OUTAGE_LIMIT seconds: what it
    writes (answers, failures) exists nowhere else. The scripts are fenced, so a call that ran
    but whose reply was lost does nothing the second time."""
    delay = 0.5
    deadline = time.monotonic() + REDIS_OUTAGE_LIMIT
    while True:
        try:
            return call()
        except REDIS_DOWN as exc:
            if time.monotonic() > deadline:
                raise
            log.error("%s: Redis unavailable (%s); retrying in %.1f s", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

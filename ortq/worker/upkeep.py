"""What keeps a model's queue whole whatever happens to its workers, done by each worker between
and beside its runs: take back the jobs of dead workers, put back jobs a lost dequeue reply left
in the intermediate list, move due retries back to the queue, RQ's registry cleanup, and ortq's
Redis function (for high-priority enqueues) loaded. RQ leaves the first two to a cleanup that runs
every 10 minutes and the third to a separate scheduler process.

Each task is bounded (a fixed number of entries per call) and rate-limited.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import ClassVar, TypeVar

from ortq import wire
from ortq.redisfunctions import ensure_functions
from ortq.rqcompat.book import Book
from ortq.rqcompat.records import prune_workers
from ortq.settings import REDIS_DOWN, Settings

log = logging.getLogger("ortq.worker")

T = TypeVar("T")

#: Longest Redis outage a worker rides out while it holds finished work (outputs or an error it
#: has not delivered yet); past it, it exits and the surviving workers take its jobs back.
REDIS_OUTAGE_LIMIT = 120.0

#: Calls of the registry cleanup in one run at most (each removes at most book.MAINTAIN_LIMIT
#: entries a registry, ~2 ms of Redis).
MAINTAIN_CALLS = 10

#: Heartbeat intervals without a heartbeat after which a worker counts as dead: its started jobs
#: are taken back, a dequeue it left in the intermediate list is rescued, and ``ortq info`` and the
#: dashboard show it as gone.
DEAD_AFTER_BEATS = 3

#: How many times a job may be taken back from a dead worker before it is failed instead.
MAX_RECOVERIES = 2


class Upkeep:
    """The tasks, rate-limited, on one connection (the heartbeat thread's, or the main thread's)."""

    #: Seconds between runs of the tasks that do not follow the heartbeat (the recovery of orphans and
    #: the rescue do: every half and every whole ``heartbeat_seconds``).
    EVERY: ClassVar[dict[str, float]] = {"retries": 1.0, "registries": 60.0, "functions": 30.0}

    def __init__(self, book: Book, settings: Settings) -> None:
        self.book = book
        self.settings = settings
        self._due: dict[str, float] = {}

    def _every(self, task: str, seconds: float) -> bool:
        now = time.monotonic()
        if now < self._due.get(task, 0.0):
            return False
        self._due[task] = now + seconds
        return True

    def run(self) -> None:
        """The tasks that take no job of this worker's own: safe beside a run."""
        beat = self.settings.heartbeat_seconds
        if self._every("recover", beat / 2):
            self.recover_abandoned(own=False)
        if self._every("rescue", beat):
            self.rescue()
        if self._every("retries", self.EVERY["retries"]):
            self.book.due_retries()
        if self._every("registries", self.EVERY["registries"]):
            self.maintain()
            prune_workers(self.book.connection, self.book.queue.name)
        if self._every("functions", self.EVERY["functions"]):
            ensure_functions(self.book.connection)

    def between_takes(self, held: frozenset[str]) -> None:
        """Called between takes: a started job of this worker's own that it does not hold (``held``:
        execution ids) is one whose start reply was lost (a Redis restart, a dropped connection), or
        one it let go after a failed answer."""
        if self._every("own", self.settings.heartbeat_seconds / 2):
            self.recover_abandoned(own=True, held=held)

    def maintain(self) -> None:
        """RQ's registry cleanup, in bounded calls: a registry with more expired entries than a few
        calls remove (millions of forged ones) is worked through at most MAINTAIN_CALLS calls a
        second, never blocking Redis for longer than one."""
        for _ in range(MAINTAIN_CALLS):
            removed, more = self.book.maintain()
            for key in removed:
                log.error("removed %s: it held a value of the wrong type (not written by RQ or ortq)", key)
            if not more:
                return
        self._due["registries"] = time.monotonic() + 1.0  # the rest in a second

    def rescue(self) -> None:
        for _ in range(10):  # a long hostile list is worked through in bounded steps
            rescued, removed, full = self.book.rescue(grace=DEAD_AFTER_BEATS * self.settings.heartbeat_seconds)
            for job_id in rescued:
                log.warning("job %s was left in the intermediate list (a lost dequeue reply); requeued", job_id)
            if removed:
                log.warning("removed %d entries of %s that were no queued job", removed, self.book.queue.intermediate)
            if not full:
                return

    def recover_abandoned(self, own: bool, held: frozenset[str] = frozenset()) -> None:
        """Take back jobs whose worker died mid-run (SIGKILL, OOM, a GPU reset): their started
        entry stays while their worker's heartbeat, kept up even during a run, stops. Such a job is
        requeued at the front, or failed with WorkerLost once it has been taken back
        MAX_RECOVERIES times (a job that crashes every worker must not crash them all)."""
        me = self.book.worker_name
        dead_after = DEAD_AFTER_BEATS * self.settings.heartbeat_seconds
        for job_id, execution_id, owner in self.book.abandoned(dead_after, own, held):
            if owner == me:
                message = "this worker's reply to starting the job was lost (Redis restarted or the connection dropped)"
            else:
                message = f"worker {owner} stopped sending heartbeats while running this job (it died or hung)"
            self.take_back(job_id, execution_id, owner, message)

    def take_back(self, job_id: str, execution_id: str, owner: str, message: str) -> None:
        """Requeue one started job at the front (or fail it, past MAX_RECOVERIES), saying why."""
        text = f"{message}; it was taken back {MAX_RECOVERIES} times"
        error = wire.encode_error("WorkerLost", text)
        outcome = self.book.recover(
            job_id, execution_id, owner, MAX_RECOVERIES, self.settings.failure_ttl, error, f"WorkerLost: {text}"
        )
        if outcome:
            log.warning("job %s: %s; %s", job_id, message, outcome)


def despite_outage(what: str, call: Callable[[], T], limit: float = REDIS_OUTAGE_LIMIT) -> T:
    """``call()``, retried through a Redis outage of up to ``limit`` seconds: what it writes
    (answers, failures) exists nowhere else. The scripts are fenced, so a call that ran but whose
    reply was lost does nothing the second time."""
    delay = 0.5
    deadline = time.monotonic() + limit
    while True:
        try:
            return call()
        except REDIS_DOWN as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            log.error("%s: Redis unavailable (%s); retrying in %.1f s", what, exc, min(delay, left))
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)

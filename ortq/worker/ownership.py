"""Job ownership: the rule every path of the worker keeps, and the ledger that keeps count.

**The rule.** A job is *held* by this worker from the moment the reply of the start script that
marked it started here is read (``Ledger.hold``, inside the take) until it leaves by exactly one
of three ways, whatever happens meanwhile (a Redis error at any call, a thread that dies, a stop,
a lost device, a stalled run):

- **answered**: its finish or fail script ran. The reply is written (or, for a retry, the job is
  back on its queue or scheduled); or the script found the job taken back meanwhile and wrote
  nothing, the scripts being fenced by the job's started entry.
- **handed on**: this worker put it back on its queue itself (``recover.lua``, counted against
  the job's recoveries, so that a job that keeps breaking workers ends as ``WorkerLost``): its
  device is lost, its run stalled, or the worker ends with jobs it will not run.
- **released**: let go with nothing written, because Redis could not take a word about it (the
  call that would have read its frame, answered or handed it on failed). Its started entry stays;
  once released, no heartbeat refreshes it, and the recovery of this worker's own orphans
  (``Upkeep.between_takes``, every half heartbeat) takes it back as soon as Redis answers, or the
  other workers do once this worker's heartbeat stops.

While a job is held, the heartbeat keeps its records fresh and no recovery takes it back, so a
held job that never left would stay ``started`` for as long as the worker lives: that is the
failure this module exists to rule out. A job whose start reply was lost is never held: it is an
orphan of this worker's from the start, taken back by the same recovery.

The ledger logs and counts a job that leaves twice or was never held (a defect in the worker, not
in the job); the tests assert none does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from enum import Enum

from ortq.rqcompat.book import StartedJob
from ortq.worker.upkeep import REDIS_OUTAGE_LIMIT, Upkeep, despite_outage

log = logging.getLogger("ortq.worker")


class Left(Enum):
    """How a held job left the worker."""

    ANSWERED = "answered"
    HANDED_ON = "handed on"
    RELEASED = "released"


class Ledger:
    """The jobs this worker holds, by execution id; safe to use from every worker thread."""

    def __init__(self) -> None:
        self._held: dict[str, StartedJob] = {}
        self._lock = threading.Lock()
        #: Jobs that left without being held (twice, or never held): each one a defect of the worker.
        self.defects = 0

    def hold(self, jobs: Iterable[StartedJob]) -> None:
        """A start script marked ``jobs`` started for this worker, and its reply was read."""
        with self._lock:
            self._held.update((job.execution_id, job) for job in jobs)

    def leave(self, jobs: Iterable[StartedJob], how: Left) -> None:
        """``jobs`` left the worker ``how``: no heartbeat refreshes them any more."""
        with self._lock:
            for job in jobs:
                if self._held.pop(job.execution_id, None) is None:
                    self.defects += 1
                    log.error("job %s left (%s) but was not held: a defect of the worker", job.job_id, how.value)

    def held(self) -> frozenset[str]:
        """The execution ids of the jobs held now."""
        with self._lock:
            return frozenset(self._held)

    def jobs(self) -> list[StartedJob]:
        """The jobs held now."""
        with self._lock:
            return list(self._held.values())

    def first(self) -> StartedJob | None:
        """One job held now, or None."""
        with self._lock:
            return next(iter(self._held.values()), None)

    def holds_only(self, jobs: Sequence[StartedJob]) -> bool:
        """Whether the worker holds nothing besides ``jobs``: answering them leaves it idle."""
        with self._lock:
            return self._held.keys() <= {job.execution_id for job in jobs}


def hand_on(
    upkeep: Upkeep, ledger: Ledger, jobs: Sequence[StartedJob], why: str, patience: float = REDIS_OUTAGE_LIMIT
) -> None:
    """Put held ``jobs`` back at the head of their queue, each in one fenced call (a job taken back
    or answered meanwhile is left as it is), saying ``why``: handed on. Those Redis does not take
    within ``patience`` seconds in all are released instead (the recovery of orphans finds them)."""
    me = upkeep.book.worker_name
    deadline = time.monotonic() + patience
    for job in jobs:
        try:
            despite_outage(
                "requeueing a job",
                lambda job=job: upkeep.take_back(job.job_id, job.execution_id, me, why),  # type: ignore[misc]
                limit=deadline - time.monotonic(),
            )
        except Exception as exc:
            log.error("job %s could not be requeued (%s); it is left to the recovery of orphans", job.job_id, exc)
            ledger.leave([job], Left.RELEASED)
        else:
            ledger.leave([job], Left.HANDED_ON)

"""The first two stages of the worker's loop: take jobs off the model's queue and read their
request frames, as few round trips as possible and with memory bounded by ``max_frame_bytes``.

One job: ``BLMOVE`` (into RQ's intermediate list, as RQ does, so that a lost reply loses no job),
then one round trip with ``start.lua`` (RQ's "started" records; with batching it pops up to
``max_batch - 1`` more) and ``GETRANGE`` of the first request frame. While the queue has a
backlog (the last start left jobs on it), a take is a single round trip: ``start.lua`` pops the
batch itself and returns its small frames (no list in between: what it pops it starts in the same
atomic call, and a start whose reply is lost is taken back as this worker's own orphan).
``GETRANGE 0 max_frame_bytes`` returns at most one byte more than the limit, so a frame that is too
large is known to be so without being read (a ``GET`` would fetch a 400 MiB frame whole before its
size could be checked); a batch's other frames come in one more pipelined round trip, each bounded
the same way.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import cast

import redis

from ortq import keys, wire
from ortq import redisfaults as faults
from ortq.errors import InvalidJob, OrtqError, PayloadTooLarge
from ortq.rqcompat import layout
from ortq.rqcompat.book import Book, Skipped, StartedJob
from ortq.settings import Settings, redis_message
from ortq.worker.largeframes import read_large_frames
from ortq.worker.unblock import Unblocker

log = logging.getLogger("ortq.worker")

#: Request frames of a batch up to this size come back inside the start script's reply (one round
#: trip fewer); larger ones are read with GETRANGE (ortq.worker.largeframes), outside Lua. Redis 7's
#: Lua hashes every byte of a string entering it (~1.3 ns a byte; docs/results/performance-history.md, fifth pass):
#: a smaller size saves Redis that and costs the worker a round trip a batch.
INLINE_FRAME_BYTES = 64 * 1024


@dataclass(slots=True)
class Taken:
    """A started job and its request frame: the bytes, None when there is none (its ttl passed, or
    it was deleted), or the error that fails the job without decoding anything."""

    started: StartedJob
    frame: bytes | bytearray | OrtqError | None


class Intake:
    """Takes jobs for one worker: blocking in short slices, so that stop requests are seen."""

    def __init__(
        self,
        connection: redis.Redis,
        book: Book,
        settings: Settings,
        max_batch: int,
        max_wait: float,
        on_started: Callable[[list[StartedJob]], None] = lambda started: None,
        starting: AbstractContextManager[object] | None = None,
        on_released: Callable[[list[StartedJob]], None] = lambda released: None,
    ) -> None:
        """``on_started`` is called with the jobs of each start script, inside ``starting`` (held
        from sending the script until then): from then on the worker holds them
        (ortq.worker.ownership), and a take either returns them or, when a later call of the same
        take fails, passes them to ``on_released`` before it raises."""
        self.connection = connection
        self.on_started = on_started
        self.on_released = on_released
        self.starting = starting if starting is not None else nullcontext()
        self.book = book
        #: The model whose queue this is: its jobs' request keys are named by it.
        self.model = book.queue.name[len(keys.PREFIX) :]
        self.settings = settings
        self.max_batch = max_batch
        self.max_wait = max_wait
        # Neither Windows nor PEP 475 lets a signal cut a blocking socket read short: a stop request
        # is seen when the read returns.
        self.slice = 1.0 if sys.platform == "win32" else min(1.0, settings.block_slice)
        #: Ends the blocking read above at a stop (its connection's id is read at each connect).
        self.unblocker = Unblocker(connection, settings, window=self.slice)
        #: Seconds the last batch waited for more jobs after its first (a timing in each response).
        self.batch_wait = 0.0
        self._suspended = False
        self._suspension_checked = -1.0
        #: The last start left jobs on the queue: the next take needs no BLMOVE (see take).
        self.backlog = False
        #: Told each start script's round trip in seconds (the feeder's rule for taking ahead:
        #: ortq.worker.overlap.Ahead).
        self.on_round_trip: Callable[[float], None] = lambda seconds: None

    def take(self, block: bool) -> list[Taken] | None:
        """The next job and, batching, the jobs after it; [] when none came within one slice, and
        None (only without ``block``: burst mode) when the queue is empty."""
        if self.backlog:
            # The last start left jobs queued: the start script pops the next batch itself, with no
            # BLMOVE first (one round trip a batch, not two, under load). Had others taken them
            # meanwhile, it starts none, and the BLMOVE below waits as usual.
            taken = self._start(b"", self.max_batch)
            if taken:
                return self._filled(taken)
        queue = self.book.queue
        try:
            if block:
                # Redis >= 6 takes fractional timeouts; redis-py's annotation says int. A stop ends
                # this read at once (ortq.worker.unblock: Redis answers nil, no job moved).
                self.unblocker.blocking.set()
                try:
                    raw = cast(bytes | None, self.connection.blmove(queue.queue, queue.intermediate, self.slice))  # type: ignore[arg-type]
                finally:
                    self.unblocker.blocking.clear()
            else:
                raw = cast(bytes | None, self.connection.lmove(queue.queue, queue.intermediate))
        except redis.ResponseError as exc:
            if not faults.is_wrong_type(exc):
                # NOREPLICAS, READONLY, UNBLOCKED: a primary that may not take writes now (a
                # failover: docs/ha.md), which the feeder rides out with a backoff as an outage;
                # an ACL refusal, which the feeder turns into exit 2.
                if faults.is_refused(exc):
                    raise
                raise redis.ConnectionError(f"Redis refused the take: {redis_message(exc)}") from exc
            # WRONGTYPE: the queue or its intermediate list holds something else (written by
            # someone with write access): remove it, say so, and go on serving.
            log.error("taking a job failed (%s); checking the queue's keys", exc)
            for key in self.book.maintain()[0]:
                log.error("removed %s: it held a value of the wrong type (not written by RQ or ortq)", key)
            return []
        if raw is None:
            # Jobs parked for this version are this worker's too: an idle worker's next take starts
            # them, and a burst worker is not done while any wait (it would leave them to no one).
            self.backlog = self._parked()
            return [] if block or self.backlog else None
        return self._filled(self._start(raw, self.max_batch - 1))

    def _parked(self) -> bool:
        """Whether jobs pinned to this worker's version were parked for it by workers of another
        (start.lua): an idle worker asks once a slice, and its next take starts them."""
        if not self.book.version:
            return False
        try:
            return bool(self.connection.llen(keys.parked_key(self.model, self.book.version)))
        except redis.ResponseError:  # no list: the next park replaces it
            return False

    def _filled(self, taken: list[Taken]) -> list[Taken]:
        """``taken`` and the jobs that arrive within ``max_wait`` after it. Never raises: the jobs
        in hand are held, and go to the main thread whatever the calls for more came to."""
        waited = time.perf_counter()
        taken += self._wait_for_more(len(taken))
        self.batch_wait = time.perf_counter() - waited
        return taken

    def _start(self, first: bytes, more: int) -> list[Taken]:
        """Start ``first`` (b"": none, the queue's first) and up to ``more`` queued after it, and
        read their frames."""
        limit = self.settings.max_frame_bytes
        first_text = first.decode(errors="replace")

        def read_first(pipe: redis.client.Pipeline) -> None:  # in the start's round trip
            if first:
                pipe.getrange(keys.request_key(self.model, first_text), 0, limit)

        with self.starting:
            sent = time.perf_counter()
            reply, moment, first_frame = self.book.start(first, more, min(limit, INLINE_FRAME_BYTES), read_first)
            if isinstance(reply, Exception):
                raise reply
            self.on_round_trip(time.perf_counter() - sent)
            started, skipped = self.book.parse_start(reply, moment)
            self.backlog = self.book.backlog(reply) > 0
            self.on_started(started)
        try:  # held from here: returned below, or released if a read fails
            frames: dict[str, object] = {}
            if first and started and started[0].job_id == first_text:
                frames[first_text] = first_frame[0]
            frames.update((job.job_id, job.frame) for job in started if job.frame is not None)
            # The others' frames not returned inline, except those too large to read (start.lua gave their sizes).
            rest = [job for job in started if job.job_id not in frames and 0 <= job.frame_size <= limit]
            if rest:
                names = [keys.request_key(self.model, job.job_id) for job in rest]
                read = read_large_frames(self.connection, names, limit)
                frames.update(zip((job.job_id for job in rest), read, strict=True))
            taken = [Taken(job, _frame(job, frames.get(job.job_id), limit)) for job in started]
        except BaseException:
            self.on_released(started)
            raise
        for entry in skipped:  # after the reads: what fails here concerns no job this worker holds
            self._skip(entry)
        return taken

    def _skip(self, skipped: Skipped) -> None:
        """Log a queue entry that was not started, and answer it where it can be answered."""
        if skipped.reason == "parked":  # not skipped: left for a worker of the version it is pinned to
            log.debug("job %.80r of %s parked for the version it is pinned to", skipped.entry, self.book.queue.name)
            return
        what = _SKIPPED.get(skipped.reason, skipped.reason)
        if skipped.reason.startswith("status:"):
            what = f"a second queue entry of a job that is already {skipped.reason[7:]}"
        if skipped.reason.startswith("type:"):
            what = f"its job record ({layout.job_key('<id>')}) is a {skipped.reason[5:]}, not a hash"
        log.warning("queue entry %.80r of %s skipped: %s", skipped.entry, self.book.queue.name, what)
        if skipped.answerable:
            # Fixed words: this error carries no proof (its request was not read), and a producer
            # takes such an error for its job's answer (docs/wire-format.md, "The proof").
            message = f"this job cannot run: {what}"
            error = wire.encode_error(InvalidJob.__name__, message)
            try:
                self.book.reject(skipped, error, self.settings.failure_ttl)
            except Exception as exc:  # no job of this worker's waits on it: the take goes on
                log.error("answering queue entry %.80r failed: %s", skipped.entry, exc)

    def _wait_for_more(self, have: int) -> list[Taken]:
        """Fill the batch with jobs that arrive within ``max_wait`` of the first."""
        more: list[Taken] = []
        deadline = time.monotonic() + self.max_wait
        queue = self.book.queue
        try:
            while 0 < have + len(more) < self.max_batch and (left := deadline - time.monotonic()) > 0.001:
                raw = cast(bytes | None, self.connection.blmove(queue.queue, queue.intermediate, left))  # type: ignore[arg-type]
                if raw is None:
                    break
                more += self._start(raw, self.max_batch - have - len(more) - 1)
        except Exception as exc:
            # The batch so far is held and read: it runs. What this call left behind is found as
            # every lost reply's is (a BLMOVE's by the rescue, a start's by the own-orphan recovery);
            # the next take meets the error again if it lasts.
            log.error("waiting for more jobs failed (%s); running the %d in hand", exc, have + len(more))
        return more

    def suspended(self) -> bool:
        """``rq suspend`` is in force: take no new job. Asked at most once a second."""
        now = time.monotonic()
        if now >= self._suspension_checked + 1.0:
            self._suspension_checked = now
            self._suspended = bool(self.connection.exists(layout.suspended_key()))
        return self._suspended


#: Why ``start`` skipped a queue entry, for the log.
_SKIPPED = {
    "id": f"not a job id ({layout.JOB_ID.pattern})",
    "answered": "its job was answered already (a job runs once: an id pushed again is a replay)",
    "gone": "its job record expired",
    "origin": "its job record names another queue (the job is its own model's workers' to run)",
    "pin": "its job record pins a version by a name no ortq producer writes",
}


def _frame(job: StartedJob, reply: object, limit: int) -> bytes | bytearray | OrtqError | None:
    """The request frame, or why there is none to decode: None when there is no request key (its
    ttl passed), an error when it is no string or larger than the limit (then it was not read
    past the limit, or, in a batch, not at all)."""
    if job.frame_size == -1:
        return None
    if job.frame_size == -2 or isinstance(reply, Exception):
        return InvalidJob(f"the request key of job {job.job_id} holds no string")
    if job.frame_size > limit or (isinstance(reply, bytes | bytearray) and len(reply) > limit):
        return PayloadTooLarge(f"the request frame is over max_frame_bytes ({limit}); it was not read")
    return reply if isinstance(reply, bytes | bytearray) and len(reply) == job.frame_size else None

"""How ``AsyncProducer`` waits for replies: one reader task per producer, not one blocking
connection per awaiting coroutine.

Every job some coroutine awaits is *registered*; the reader keeps its reply stream covered by an
``XREAD BLOCK`` (one XREAD names up to 256 streams) and resolves the waiting futures as replies
arrive. At most ``reads`` XREADs are in flight at once, each on a connection of the reader's own
small pool, so a thousand concurrent ``await infer()`` use a handful of connections:

* a job registered while every read in flight covers other jobs gets a read of its own (with all
  other uncovered jobs) while fewer than ``reads`` are in flight, so that its reply is not held up
  behind a slow job's read;
* a read that returns (a reply came, or its block slice ran out) hands its still-unanswered jobs
  back, and the next read covers them together with every other uncovered job: reads merge;
* when all ``reads`` are in flight and jobs have waited uncovered for STARVED_SECONDS, the read
  that can best be merged with them is cut short (cancelled: redis-py drops that connection and
  opens a new one for the next read). Under load reads return often and this is rare; it bounds
  how long a fast job can wait behind slow ones.

A read that fails because Redis is unreachable backs off (0.05 s doubling to 1 s) and is tried
again: replies are kept in Redis, so a wait rides out a restart; one that outlasts its timeout says
BrokerUnavailable rather than ResultTimeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from ortq import redisfaults, wire
from ortq.errors import BrokerUnavailable, OrtqError, ResultTimeout
from ortq.producer import responses

log = logging.getLogger("ortq")

#: Most reply streams one XREAD names.
MAX_STREAMS = 256
#: Seconds a job may stay uncovered while all reads are in flight before one of them is cut short.
STARVED_SECONDS = 0.02


@dataclass(eq=False)
class _Waiter:
    job_id: str
    model: str
    proof: bytes | None
    future: asyncio.Future[wire.Response]


@dataclass(eq=False)
class _Read:
    ids: frozenset[str]
    started: float
    backing_off: bool = False


class ReplyReader:
    """Waits for the replies of many jobs at once through ``client`` (its own pool: at most
    ``reads`` connections), each blocking read at most ``block`` seconds."""

    def __init__(self, client: redis.asyncio.Redis, *, max_bytes: int, block: float, reads: int) -> None:
        self.client = client
        self._max_bytes = max_bytes
        self._block_ms = max(1, int(block * 1000))
        self._max_reads = reads
        self._waiters: dict[str, list[_Waiter]] = {}
        self._reads: dict[asyncio.Task[None], _Read] = {}
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._outage = redisfaults.Outage()
        self._failing = False  # the last read failed for want of Redis, and none went through since
        self._outage_at = -math.inf  # loop time of the last such failure
        self._closed = False

    # ------------------------------------------------------------------ waiting

    async def wait(
        self,
        job_ids: Sequence[str],
        models: Sequence[str],
        proofs: Sequence[bytes | None],
        timeout: float,
        late: str | None,
    ) -> list[wire.Response]:
        """The responses of ``job_ids`` (each of its model in ``models``), in order. Raises the first
        error (in order) of a job whose reply cannot be read or does not answer its request (its
        proof in ``proofs``), and ResultTimeout (BrokerUnavailable if Redis failed meanwhile) when
        some are not in after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        waiters = [self._add(*job, loop) for job in zip(job_ids, models, proofs, strict=True)]
        try:
            if waiters:
                await asyncio.wait(
                    [w.future for w in waiters],
                    timeout=None if math.isinf(timeout) else timeout,
                    return_when=asyncio.FIRST_EXCEPTION,
                )
            for waiter in waiters:
                if waiter.future.done() and (error := waiter.future.exception()) is not None:
                    raise error
            missing = sum(not w.future.done() for w in waiters)
            if missing:
                message = late or f"{missing} of {len(job_ids)} jobs had no result within {timeout:g} s"
                if self._failing or self._outage_at >= started:
                    assert self._outage.last is not None
                    raise redisfaults.failure(self._outage.last, message)
                raise ResultTimeout(message)
            return [w.future.result() for w in waiters]
        finally:
            for waiter in waiters:
                self._remove(waiter)

    def _add(self, job_id: str, model: str, proof: bytes | None, loop: asyncio.AbstractEventLoop) -> _Waiter:
        if self._closed:
            raise BrokerUnavailable("the producer is closed (aclose): it waits for nothing any more")
        waiter = _Waiter(job_id, model, proof, loop.create_future())
        self._waiters.setdefault(job_id, []).append(waiter)
        if self._changed is None:
            self._changed = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(self._changed), name="ortq-reply-reader")
        self._changed.set()
        return waiter

    def _remove(self, waiter: _Waiter) -> None:
        waiters = self._waiters.get(waiter.job_id, [])
        if waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[waiter.job_id]
        if not waiter.future.done():
            waiter.future.cancel()
        elif not waiter.future.cancelled():
            waiter.future.exception()  # retrieved: asyncio would log an exception no one looked at

    # ------------------------------------------------------------------ the reader task

    async def _run(self, changed: asyncio.Event) -> None:
        while True:
            changed.clear()
            self._start_reads()
            if self._victim() is None:
                await changed.wait()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), STARVED_SECONDS)
            if not changed.is_set() and (victim := self._victim()) is not None:
                victim.cancel()

    def _uncovered(self) -> list[str]:
        covered: set[str] = set()
        for read in self._reads.values():
            covered |= read.ids
        return [job_id for job_id in self._waiters if job_id not in covered]

    def _start_reads(self) -> None:
        uncovered = self._uncovered()
        loop = asyncio.get_running_loop()
        while uncovered and len(self._reads) < self._max_reads:
            ids, uncovered = uncovered[:MAX_STREAMS], uncovered[MAX_STREAMS:]
            read = _Read(frozenset(ids), loop.time())
            # Each job's model now, while it is awaited: its reply key is named by it.
            models = {job_id: self._waiters[job_id][0].model for job_id in ids}
            task = asyncio.create_task(self._read(models, read))
            self._reads[task] = read
            task.add_done_callback(self._read_done)

    def _victim(self) -> asyncio.Task[None] | None:
        """The read to cut short for jobs left uncovered: the one whose still-awaited jobs fit in
        one read together with them (fewest first, then oldest); None when no cut would help."""
        if self._failing or len(self._reads) < self._max_reads:
            return None
        uncovered = len(self._uncovered())
        if not uncovered:
            return None
        best: tuple[int, float, asyncio.Task[None]] | None = None
        for task, read in self._reads.items():
            live = sum(job_id in self._waiters for job_id in read.ids)
            if read.backing_off or live + uncovered > MAX_STREAMS:
                continue
            if best is None or (live, read.started) < best[:2]:
                best = (live, read.started, task)
        return None if best is None else best[2]

    def _read_done(self, task: asyncio.Task[None]) -> None:
        read = self._reads.pop(task, None)
        if not task.cancelled() and (exc := task.exception()) is not None and read is not None:
            # Not a Redis error (those are handled in _read): fail its jobs rather than leave them hanging.
            log.error("reading ortq replies failed: %r", exc)
            self._fail(read.ids, BrokerUnavailable(f"reading replies failed: {type(exc).__name__}: {exc}"))
        if self._changed is not None:
            self._changed.set()

    async def _read(self, models: dict[str, str], read: _Read) -> None:
        """One XREAD of the replies of ``models``' jobs (job id -> its model)."""
        try:
            streams = responses.reply_streams((model, job_id) for job_id, model in models.items())
            reply = await self.client.xread(streams, block=self._block_ms)  # type: ignore[arg-type]
        except redis.RedisError as exc:
            if not redisfaults.is_down(exc):
                await self._refused(models, exc)
                return
            self._failing = True
            self._outage_at = asyncio.get_running_loop().time()
            read.backing_off = True  # its jobs stay covered meanwhile: no read is sent in a tight loop
            await asyncio.sleep(self._outage.failed(exc, "could not read replies"))
            return
        self._failing = False
        self._outage.recovered()
        self._deliver(reply)

    def _deliver(self, reply: Any) -> None:
        for job_id, frame in responses.frames_in(reply).items():
            for waiter in self._waiters.pop(job_id, []):
                if waiter.future.done():
                    continue
                if isinstance(frame, OrtqError):
                    waiter.future.set_exception(type(frame)(str(frame)))
                    continue
                try:
                    response = responses.read_response(frame, job_id, waiter.proof, self._max_bytes)
                except OrtqError as exc:
                    waiter.future.set_exception(exc)
                else:
                    waiter.future.set_result(response)

    async def _refused(self, models: dict[str, str], exc: redis.RedisError) -> None:
        """XREAD refused: each key is read alone; a job whose reply key is no stream fails
        (CorruptRecord), replies found are delivered, the other jobs are read again. A refusal of
        the read itself (ACL) fails them all."""
        ids = list(models)
        refusal = responses.read_refusal(exc)
        if refusal is not None:
            self._fail(ids, refusal)
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for job_id, model in models.items():
                    responses.add_probe(pipe, model, job_id)
                probes = await pipe.execute(raise_on_error=False)
        except redis.RedisError as again:
            self._fail(ids, redisfaults.failure(again, "could not read replies"))
            return
        for job_id, probe in zip(ids, probes, strict=True):
            if (wrong := responses.wrong_reply(models[job_id], job_id, probe)) is not None:
                self._fail([job_id], wrong)
            elif isinstance(probe, redis.RedisError):
                self._fail([job_id], redisfaults.failure(probe, "could not read replies"))
            else:
                self._deliver(probe)

    def _fail(self, ids: Sequence[str] | frozenset[str], error: OrtqError) -> None:
        for job_id in ids:
            for waiter in self._waiters.pop(job_id, []):
                if not waiter.future.done():
                    waiter.future.set_exception(type(error)(str(error)))

    async def aclose(self) -> None:
        """Stop reading; whoever still waits gets BrokerUnavailable."""
        self._closed = True
        tasks = [*self._reads, *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail(list(self._waiters), BrokerUnavailable("the producer was closed (aclose) while waiting for replies"))
        await self.client.aclose()

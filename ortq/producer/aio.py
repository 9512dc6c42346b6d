"""``ortq.AsyncProducer``: ``ortq.Producer`` for asyncio services (FastAPI, aiohttp), on ``redis.asyncio``.

The same methods, options, checks and errors as ``Producer`` (what both send and check is shared
as I/O-free steps: ``steps``), awaited instead of blocking. Connections are shared by every coroutine:
commands go through one pool of at most ``max_connections``, and waiting for results through a
pool of at most ``max_reads`` more, where one XREAD at a time reads the producer's reply streams
for every awaiting coroutine (``replybook``, ``waiting``). One producer belongs to one event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, Unpack

import numpy as np
import redis
import redis.asyncio
import redis.asyncio.sentinel
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ortq import keys, redisfaults, redispack, sentinel, tracing, wire
from ortq.errors import BrokerUnavailable, ConfigurationError, ResultTimeout
from ortq.producer import cancelling, checks, enqueue, lookups, once, submitting, waiting
from ortq.producer.enqueue import SubmitOptions
from ortq.producer.replybook import ReplyBook
from ortq.producer.routes import Routes
from ortq.producer.steps import Await, Command, Read, Request, Round, Stepper, Steps
from ortq.redisurls import redacted_url
from ortq.settings import Settings
from ortq.signature import ModelSignature

log = logging.getLogger("ortq")
T = TypeVar("T")


class AsyncInferenceJob(enqueue.JobHandle["AsyncProducer"]):
    """A submitted job: ``await job.result()`` for its outputs, ``await job.status()`` to look at it."""

    async def status(self) -> str:
        """RQ's status of the job (queued, started, finished, failed, canceled, ...); JobNotFound
        when Redis has no record of it (never enqueued, or expired)."""
        return await self.producer._run(self.model, lookups.job_status(self.id))

    async def result(self, timeout: float = 30.0) -> dict[str, np.ndarray]:
        """The job's outputs, once its response arrives (at most ``timeout`` seconds): read-only views
        onto the received frame. InferenceFailed if the worker failed it, ResultTimeout if nothing came."""
        return enqueue.outputs_of(await self.producer.wait_response(self.id, self.model, timeout, self.proof), self)

    async def cancel(self) -> bool:
        """Take the job off its queue if no worker has started it, else ask the worker running it to stop
        it (within about half a second; it then fails with JobStopped, RQ's status ``stopped``); returns whether
        either was done (False: the job ended, or is unknown; or it is started and this handle, from
        ``job(id, model)``, lacks the nonce its stop token is made from)."""
        return await self.producer.cancel(self.id, self.model, self.proof)


@dataclass(frozen=True)
class _Redis:
    """What a producer holds per Redis: the commands' client, the client its waits read with, and
    what they read."""

    connection: redis.asyncio.Redis
    reader: redis.asyncio.Redis
    book: ReplyBook
    #: Whether the producer opened ``connection`` (and closes it).
    owned: bool


class AsyncProducer:
    """Submits jobs to ortq workers through Redis, from asyncio code.

    ``validate`` and ``allow_unknown_models`` are ``Producer``'s. ``connection``: a
    ``redis.asyncio.Redis`` of your own for commands (not closed by :meth:`aclose`); by default the
    producer opens a pool of at most ``max_connections``. Waiting uses ``max_reads`` connections of
    its own. Use ``async with AsyncProducer(...) as producer:`` (which checks the connection with a
    PING) or call :meth:`aclose` when done. Under a shard map (``settings.redis_shards``, as for
    ``Producer``) each other Redis gets a pool and a reader of the same sizes, opened at the first use
    of one of its models; ``connection`` is only ever ``redis_url``'s.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        settings: Settings | None = None,
        connection: redis.asyncio.Redis | None = None,
        validate: bool = True,
        allow_unknown_models: bool = False,
        max_connections: int = 10,
        max_reads: int = 4,
    ) -> None:
        self.settings = settings or Settings.from_env(redis_url=redis_url)
        if max_connections < 1 or max_reads < 1:
            raise ConfigurationError(f"max_connections and max_reads must be >= 1, got {max_connections}, {max_reads}")
        self.validate = validate
        self.allow_unknown_models = allow_unknown_models
        self.reply_name = keys.new_reply_name(self.settings.result_ttl)  # as Producer.reply_name
        self._block = redisfaults.block_seconds(self.settings, self.settings.socket_timeout)
        self._max_connections = max_connections
        self._max_reads = max_reads
        self._default = self._open_redis(self.settings.redis_url, connection)
        self.connection = self._default.connection
        shards = self.settings.shards
        self._routes = None if shards is None else Routes(shards, self._default, self._open_redis)
        self._signatures = checks.SignatureCache()
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False

    def _open_redis(self, redis_url: str, connection: redis.asyncio.Redis | None = None) -> _Redis:
        """The commands' pool (or ``connection``) and the reply reader for one Redis. Opens nothing
        yet: redis-py connects at the first command."""
        options = {
            "socket_timeout": self.settings.socket_timeout,
            "socket_connect_timeout": self.settings.socket_timeout,
            "health_check_interval": 30,
            "socket_read_size": 1 << 20,  # frames are large: fewer reads per frame
            # One retry, at once: a pooled connection that Redis closed (a restart) is reopened
            # unseen. No more: an unreachable Redis is BrokerUnavailable now, not after seconds of
            # backoff, and an enqueue MULTI is not sent again and again (each resend that follows
            # an EXEC whose answer was lost would queue its jobs once more).
            "retry": Retry(NoBackoff(), 1),
        }
        try:
            owned = connection is None
            if connection is None and sentinel.is_sentinel_url(redis_url):
                # redis-py's Sentinel pool (waiting for a free connection, as the one below does).
                connection = sentinel.async_connect(redis_url, self._max_connections, **options)
            elif connection is None:
                pool = redis.asyncio.BlockingConnectionPool.from_url(
                    redis_url, max_connections=self._max_connections, timeout=None, **options
                )
                pool.connection_class = redispack.packing(pool.connection_class)  # hiredis packs each command
                connection = redis.asyncio.Redis.from_pool(pool)
            reader_client = self._reader_client(connection, options)
        except ValueError as exc:  # a query option redis-py cannot read
            raise ConfigurationError(f"redis_url {redacted_url(redis_url)!r}: {exc}") from None
        return _Redis(connection, reader_client, ReplyBook(self.reply_name), owned)

    def _reader_client(self, connection: redis.asyncio.Redis, options: dict[str, Any]) -> redis.asyncio.Redis:
        """The waits' own pool: the same server and login as ``connection``'s, its blocks under
        its socket timeout (a wait rides out an outage itself, backing off). For a Sentinel
        group: the same sentinels' primary, so that both pools follow a failover."""
        pool = connection.connection_pool
        kwargs = {**pool.connection_kwargs, **options}
        if isinstance(pool, redis.asyncio.sentinel.SentinelConnectionPool):
            kwargs.pop("connection_pool")  # the Sentinel pool sets its own
            kwargs["connection_class"] = pool.connection_class
            return sentinel.async_primary(pool.sentinel_manager, pool.service_name, self._max_reads, **kwargs)
        reader_pool = redis.asyncio.BlockingConnectionPool(
            connection_class=pool.connection_class, max_connections=self._max_reads, timeout=None, **kwargs
        )
        return redis.asyncio.Redis.from_pool(reader_pool)

    def _redis_for(self, model: str) -> _Redis:
        return self._default if self._routes is None else self._routes.client(model)

    def connection_for(self, model: str) -> redis.asyncio.Redis:
        """The client of ``model``'s Redis: :attr:`connection`, unless the shard map puts the model
        on another Redis."""
        return self._redis_for(model).connection

    async def ping(self) -> None:
        """Check the connection: ConfigurationError for what only the settings can fix (a refused
        login or certificate, a server that is not Redis), BrokerUnavailable when Redis is unreachable."""
        try:
            await self.connection.ping()
        except redis.RedisError as exc:
            raise redisfaults.failure(exc, f"cannot reach Redis at {redacted_url(self.settings.redis_url)}") from exc

    async def aclose(self) -> None:
        """Stop waiting (whoever still waits gets BrokerUnavailable) and close the connections."""
        if self._background:
            await asyncio.wait(self._background, timeout=self.settings.socket_timeout)
        self._closed = True
        for each in [self._default, *([] if self._routes is None else self._routes.opened())]:
            each.book.close("the producer was closed (aclose) while waiting for replies")
            await each.reader.aclose()
            if each.owned:
                await each.connection.aclose()

    async def __aenter__(self) -> AsyncProducer:
        await self.ping()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ models

    async def signature(self, model: str, version: str | None = None) -> ModelSignature | None:
        """The signature the model's workers published (of ``version``; None: the current one, that
        of the worker that started last), or None if none has (yet)."""
        return await self._run(model, lookups.signature(self._signatures, model, version))

    async def workers(self, model: str) -> list[dict[str, Any]]:
        """The published records of the live workers serving ``model`` (on its Redis)."""
        return await self._run(model, lookups.workers(model))

    async def wait_for_workers(self, model: str, count: int = 1, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Wait until ``count`` workers serve ``model`` (they publish after warm-up); returns their records."""
        return await self._run(model, lookups.wait_for_workers(model, count, timeout))

    def job(self, job_id: str, model: str) -> AsyncInferenceJob:
        """A handle on a job submitted earlier (by any producer)."""
        return AsyncInferenceJob(self, job_id, keys.check_model_name(model))

    # ------------------------------------------------------------------ submitting

    async def submit(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        ttl: float | None = None,
        job_timeout: float | None = None,
        retries: int = 0,
        retry_backoff: float = 0,
        priority: str = "normal",
        version: str | None = None,
        job_id: str | None = None,
        unique: bool = False,
    ) -> AsyncInferenceJob:
        """Validate and enqueue one job; returns at once with a handle. The options are ``Producer.submit``'s."""
        jobs = await self.submit_many(
            model,
            [inputs],
            ttl=ttl,
            job_timeout=job_timeout,
            retries=retries,
            retry_backoff=retry_backoff,
            priority=priority,
            version=version,
            job_ids=None if job_id is None else [job_id],
            unique=unique,
        )
        return jobs[0]

    @tracing.sends_async  # one ortq.send span per call, when tracing is on (docs/tracing.md)
    async def submit_many(
        self,
        model: str,
        many_inputs: Iterable[Mapping[str, Any]],
        *,
        ttl: float | None = None,
        job_timeout: float | None = None,
        retries: int = 0,
        retry_backoff: float = 0,
        priority: str = "normal",
        version: str | None = None,
        job_ids: Iterable[str] | None = None,
        unique: bool = False,
    ) -> list[AsyncInferenceJob]:
        """Validate every job first (options, model, inputs, queue room), then enqueue them all in
        one MULTI/EXEC round trip."""
        options = checks.job_options(
            self.settings, ttl=ttl, job_timeout=job_timeout, retries=retries, retry_backoff=retry_backoff,
            priority=priority, version=version, reply=self.reply_name,
        )  # fmt: skip
        check = lookups.ModelCheck(self._signatures, self.validate, self.allow_unknown_models, self._routes)
        make = functools.partial(AsyncInferenceJob, self)
        book = self._redis_for(keys.check_model_name(model)).book
        steps = submitting.submit_many(self.settings, check, make, model, many_inputs, options, job_ids, unique, book)
        return await self._run(model, steps)

    async def infer(
        self, model: str, inputs: Mapping[str, Any], timeout: float = 30.0, **options: Unpack[SubmitOptions]
    ) -> dict[str, np.ndarray]:
        """Submit one job (``options``: those of :meth:`submit`) and await its outputs.

        If it times out (ResultTimeout, or the awaiting task is cancelled, as by ``asyncio.wait_for``
        or a client that went away), the job is taken off the queue if no worker has started it.
        """
        checks.wait_timeout(timeout)
        job = await self.submit(model, inputs, **options, **submitting.infer_options(self.settings))
        try:
            return await job.result(timeout)
        except ResultTimeout:
            await job.cancel()
            raise
        except asyncio.CancelledError:
            self._in_background(job.cancel())
            raise

    def _in_background(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("could not take an abandoned job off its queue: %s", exc)

    # ------------------------------------------------------------------ waiting

    async def wait_response(self, job_id: str, model: str, timeout: float, proof: bytes | None = None) -> wire.Response:
        """The job's response (see ``Producer.wait_response``)."""
        late = f"no result for job {job_id} within {timeout:g} s"
        return (
            await self._wait(self._redis_for(model), [job_id], [model], [proof], checks.wait_timeout(timeout), late)
        )[0]

    async def wait_responses(
        self,
        job_ids: Sequence[str],
        models: Sequence[str],
        timeout: float,
        proofs: Sequence[bytes | None] | None = None,
    ) -> list[wire.Response]:
        """The responses of many jobs (each of its model in ``models``), in order, waited for
        together; under a shard map each Redis's reader waits for its jobs at the same time."""
        proofs = list(proofs) if proofs is not None else [None] * len(job_ids)
        timeout = checks.wait_timeout(timeout)
        if self._routes is None:
            return await self._wait(self._default, job_ids, models, proofs, timeout, None)
        groups = self._routes.group(models)
        waits = [
            asyncio.ensure_future(
                self._wait(each, [job_ids[i] for i in at], [models[i] for i in at], [proofs[i] for i in at], timeout)
            )
            for each, at in groups
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for wait in waits:
                wait.cancel()  # after an error the others stop waiting too
            await asyncio.gather(*waits, return_exceptions=True)
        for wait in waits:
            if not wait.cancelled() and (error := wait.exception()) is not None:
                raise error
        responses: dict[int, wire.Response] = {}
        for (_, at), wait in zip(groups, waits, strict=True):
            responses.update(zip(at, wait.result(), strict=True))
        return [responses[i] for i in range(len(job_ids))]

    async def _wait(
        self,
        each: _Redis,
        job_ids: Sequence[str],
        models: Sequence[str],
        proofs: Sequence[bytes | None],
        timeout: float,
        late: str | None = None,
    ) -> list[wire.Response]:
        """The responses of jobs on one Redis, read through its waits' pool."""
        if self._closed:
            raise BrokerUnavailable("the producer is closed (aclose): it waits for nothing any more")
        deadline = time.monotonic() + timeout
        wait = waiting.Wait(job_ids, models, proofs, deadline, timeout, late)
        steps = waiting.wait_for_responses(
            wait, book=each.book, block=self._block, max_bytes=self.settings.max_frame_bytes
        )
        return await _run_on(each.reader, steps)

    async def results(self, jobs: Sequence[AsyncInferenceJob], timeout: float = 30.0) -> list[dict[str, np.ndarray]]:
        """The outputs of many jobs, in order, waited for together. Raises InferenceFailed for the
        first job (in order) that failed, ResultTimeout if some had no result in time."""
        models, proofs = [job.model for job in jobs], [job.proof for job in jobs]
        responses = await self.wait_responses([job.id for job in jobs], models, timeout, proofs)
        return [enqueue.outputs_of(response, job) for job, response in zip(jobs, responses, strict=True)]

    async def cancel(self, job_id: str, model: str, proof: bytes | None = None) -> bool:
        """Remove a queued job, or stop a started one with its ``proof`` (see AsyncInferenceJob.cancel)."""
        return await self._run(model, cancelling.cancel(job_id, model, proof))

    async def _run(self, model: str, steps: Steps[T]) -> T:
        """Send what ``steps`` ask for to ``model``'s Redis (its client looked up at each send: never
        before the steps' first checks, as a model's name) and hand each reply back, or the exception
        sending raised (what it means is the steps' to say), until they return."""
        return await _run_on(functools.partial(self.connection_for, model), steps)


async def _run_on(client: redis.asyncio.Redis | Callable[[], redis.asyncio.Redis], steps: Steps[T]) -> T:
    """Send what ``steps`` ask for through ``client`` (or ``client()``, asked at each send), each
    reply back, until they return; a cancelled await ends them where they stand."""
    stepper = Stepper(steps)
    try:
        while (request := stepper.next()) is not None:
            try:
                stepper.reply(await _send(client() if callable(client) else client, request))
            except Exception as exc:
                stepper.fail(exc)
    finally:
        stepper.close()
    return stepper.result


#: What redis-py's pool.get_connection is given: before 5.3 it needs the command's name (5.3
#: deprecated it: a warning when given).
_GET_CONNECTION_ARGS: tuple[str, ...] = ("XREAD",) if tuple(map(int, redis.__version__.split(".")[:2])) < (5, 3) else ()


async def _read(connection: redis.asyncio.Redis, request: Read) -> Any:
    """A blocking XREAD that its book may cut short (a stream added meanwhile): then None, as if its
    block ran out (a cancelled read's connection is dropped, and another opened).

    The read takes its connection itself: redis-py (8.2) loses a cancel that comes while it opens a
    connection, and its XREAD would then block on regardless, holding the connection (the only one
    where ``max_reads`` is 1) while the new stream's answer waits behind it. A read cut while it got
    its connection sends nothing."""
    cut = False

    def cut_short() -> None:
        nonlocal cut
        cut = True
        read.cancel()

    async def xread() -> Any:
        pool = connection.connection_pool
        reader = await pool.get_connection(*_GET_CONNECTION_ARGS)  # type: ignore[no-untyped-call]
        try:
            if cut:
                return None
            streams: dict[str, bytes] = request.args[0]
            await reader.send_command(
                "XREAD", "COUNT", request.kwargs["count"], "BLOCK", request.kwargs["block"],
                "STREAMS", *streams, *streams.values(),
            )  # fmt: skip
            return await connection.parse_response(reader, "XREAD")
        finally:
            await pool.release(reader)

    read = asyncio.ensure_future(xread())
    request.book.add_cut(cut_short)
    try:
        return await read
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this wait itself was cancelled
        return None
    finally:
        request.book.remove_cut(cut_short)


async def _send(connection: redis.asyncio.Redis, request: Request) -> Any:
    if isinstance(request, Read):
        return await _read(connection, request)
    if isinstance(request, Command):
        return await getattr(connection, request.name)(*request.args, **request.kwargs)
    if isinstance(request, Round):
        async with connection.pipeline(transaction=request.transaction) as pipe:
            request.queue(pipe)
            return await (once.execute_async(pipe) if request.once else pipe.execute(raise_on_error=False))
    if isinstance(request, Await):
        await request.book.wait_change_async(request.seen, request.seconds, request.job_ids)
        return None
    await asyncio.sleep(request.seconds)
    return None

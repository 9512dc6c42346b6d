"""``ortq.AsyncProducer``: ``ortq.Producer`` for asyncio services (FastAPI, aiohttp), on ``redis.asyncio``.

The same methods, options, checks and errors as ``Producer`` (the protocol is shared: ``checks``,
``enqueue``, ``faults``), awaited instead of blocking. Connections are shared by every coroutine:
commands go through one pool of at most ``max_connections``, and waiting for results through one
reader task (``replies.ReplyReader``) whose XREADs cover the reply streams of all awaited jobs at
once, on at most ``max_reads`` more connections. One producer belongs to one event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Unpack

import numpy as np
import redis
import redis.asyncio
import redis.asyncio.sentinel
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ortq import keys, sentinel, tracing, wire
from ortq.control import MAX_WORKERS
from ortq.errors import BrokerUnavailable, ConfigurationError, ResultTimeout
from ortq.producer import checks, enqueue, faults
from ortq.producer.enqueue import JobOptions, SubmitOptions, add_enqueue
from ortq.producer.replies import ReplyReader
from ortq.producer.routes import Routes
from ortq.settings import Settings, redacted_url
from ortq.signature import ModelSignature

log = logging.getLogger("ortq")


class AsyncInferenceJob(enqueue.JobHandle["AsyncProducer"]):
    """A submitted job: ``await job.result()`` for its outputs, ``await job.status()`` to look at it."""

    async def status(self) -> str:
        """RQ's status of the job (queued, started, finished, failed, canceled, ...); JobNotFound
        when Redis has no record of it (never enqueued, or expired)."""
        key = keys.job_key(self.id)
        try:
            raw = await self.producer.connection_for(self.model).hget(key, "status")
        except redis.RedisError as exc:
            doing = f"could not read the status of job {self.id}"
            raise faults.failure(exc, doing, f"the record of job {self.id} ({key}) is no job hash") from exc
        return enqueue.status_of(raw, self.id)

    async def result(self, timeout: float = 30.0) -> dict[str, np.ndarray]:
        """The job's outputs, once its response arrives (at most ``timeout`` seconds): read-only views
        onto the received frame. InferenceFailed if the worker failed it, ResultTimeout if nothing came."""
        return enqueue.outputs_of(await self.producer.wait_response(self.id, self.model, timeout, self.proof), self)

    async def cancel(self) -> bool:
        """Take the job off its queue if no worker has started it, else ask the worker running it to stop
        it (within a heartbeat; it then fails with JobStopped, RQ's status ``stopped``); returns whether
        either was done (False: the job ended, or is unknown)."""
        return await self.producer.cancel(self.id, self.model)


@dataclass(frozen=True)
class _Redis:
    """What a producer holds per Redis: the commands' client and the reader of its reply streams."""

    connection: redis.asyncio.Redis
    reader: ReplyReader
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
        self._max_connections = max_connections
        self._max_reads = max_reads
        self._default = self._open_redis(self.settings.redis_url, connection)
        self.connection = self._default.connection
        shards = self.settings.shards
        self._routes = None if shards is None else Routes(shards, self._default, self._open_redis)
        self._signatures = checks.SignatureCache()
        self._background: set[asyncio.Task[Any]] = set()

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
                connection = redis.asyncio.Redis.from_pool(pool)
            reader_client = self._reader_client(connection, options)
        except ValueError as exc:  # a query option redis-py cannot read
            raise ConfigurationError(f"redis_url {redacted_url(redis_url)!r}: {exc}") from None
        reader = ReplyReader(
            reader_client,
            max_bytes=self.settings.max_frame_bytes,
            block=faults.block_seconds(self.settings, self.settings.socket_timeout),
            reads=self._max_reads,
        )
        return _Redis(connection, reader, owned)

    def _reader_client(self, connection: redis.asyncio.Redis, options: dict[str, Any]) -> redis.asyncio.Redis:
        """The reader's own pool: the same server and login as ``connection``'s, its blocks under
        its socket timeout (the reader rides out an outage itself, backing off). For a Sentinel
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
            raise faults.failure(exc, f"cannot reach Redis at {redacted_url(self.settings.redis_url)}") from exc

    async def aclose(self) -> None:
        """Stop waiting (whoever still waits gets BrokerUnavailable) and close the connections."""
        if self._background:
            await asyncio.wait(self._background, timeout=self.settings.socket_timeout)
        for each in [self._default, *([] if self._routes is None else self._routes.opened())]:
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
        keys.check_model_name(model)
        key = keys.signature_key(model, None if version is None else keys.check_version_name(version))
        cached = self._signatures.get(key, time.monotonic())
        if cached is not None:
            return cached
        try:
            raw = await self.connection_for(model).get(key)
        except redis.RedisError as exc:
            doing = f"could not read the signature of {model!r}"
            raise faults.failure(exc, doing, f"the published signature of {model!r} ({key}) is no string") from exc
        signature = checks.parse_signature(raw, model)
        self._signatures.put(key, signature, time.monotonic())
        return signature

    async def _checked_model(self, model: str, version: str | None = None) -> ModelSignature | None:
        keys.check_model_name(model)
        if self.allow_unknown_models and not self.validate:
            return None
        signature = await self.signature(model, version)
        if signature is None and not self.allow_unknown_models:
            shard = None if self._routes is None else self._routes.where(model)
            records = await self._live_records(self.connection_for(model))
            raise checks.unknown_model(model, records, shard, version)
        return signature if self.validate else None

    async def _live_records(self, connection: redis.asyncio.Redis) -> list[dict[str, Any]]:
        """Every live worker's record on that Redis (hostile input: what cannot be read is skipped)."""
        try:
            raw_names = await connection.srandmember(keys.WORKERS_SET, MAX_WORKERS)
            names = checks.worker_names(raw_names or [])
            raws = await connection.mget([keys.worker_key(n) for n in names]) if names else []
        except redis.RedisError as exc:
            if faults.is_wrong_type(exc):  # not written by ortq: no worker to be found there
                return []
            raise faults.failure(exc, "could not read the worker records") from exc
        return checks.live_records(raws)

    async def workers(self, model: str) -> list[dict[str, Any]]:
        """The published records of the live workers serving ``model`` (on its Redis)."""
        records = await self._live_records(self.connection_for(model))
        return [record for record in records if record.get("model") == model]

    async def wait_for_workers(self, model: str, count: int = 1, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Wait until ``count`` workers serve ``model`` (they publish after warm-up); returns their records."""
        deadline = time.monotonic() + checks.wait_timeout(timeout)
        while True:
            found = await self.workers(model)
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise ResultTimeout(f"{len(found)} of {count} workers for model {model!r} after {timeout:g} s")
            await asyncio.sleep(0.1)

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
            priority=priority, version=version,
        )  # fmt: skip
        signature = await self._checked_model(model, version)
        many = list(many_inputs)
        nonces = [enqueue.new_nonce() for _ in many]
        size = self.settings.max_frame_bytes
        frames = [checks.encode_job(inputs, signature, nonce, size) for inputs, nonce in zip(many, nonces, strict=True)]
        chosen = None if job_ids is None else enqueue.check_job_ids(job_ids, len(frames))
        if not frames:
            return []
        connection = self.connection_for(model)
        if self.settings.max_queue_length:
            try:
                queued = await connection.llen(keys.queue_key(model))
            except redis.RedisError as exc:
                wrong = f"the queue of {model!r} ({keys.queue_key(model)}) is no list"
                raise faults.failure(exc, f"could not enqueue for {model!r}", wrong) from exc
            checks.check_room(model, queued, len(frames), self.settings.max_queue_length)
        try:
            if chosen is not None:
                return await self._enqueue_chosen(connection, model, frames, options, chosen, nonces, signature, unique)
            ids = await self._enqueue(connection, model, frames, options)
        except redis.RedisError as exc:
            error = faults.failure(exc, f"could not enqueue {len(frames)} job(s) for {model!r}")
            if isinstance(error, BrokerUnavailable):
                error = BrokerUnavailable(f"{error}; {enqueue.MAYBE_ENQUEUED}")
            raise error from exc
        digest = None if signature is None else signature.digest
        return [AsyncInferenceJob(self, i, model, nonce, digest, version) for i, nonce in zip(ids, nonces, strict=True)]

    async def _enqueue_chosen(
        self,
        connection: Any,
        model: str,
        frames: list[bytes],
        options: JobOptions,
        ids: list[str],
        nonces: list[bytes],
        signature: ModelSignature | None,
        unique: bool,
    ) -> list[AsyncInferenceJob]:
        """Enqueue each job under the id chosen for it unless a job of that id exists (never
        overwritten): by FCALL, or EVAL where this Redis lacks the function; see ``submit``."""
        calls = enqueue.FunctionCalls(
            len(ids),
            lambda pipe, i, by_eval: enqueue.add_enqueue_unique(pipe, model, frames[i], options, ids[i], by_eval),
        )
        await self._call_functions(connection, calls)
        digest = None if signature is None else signature.digest
        make = functools.partial(AsyncInferenceJob, self)
        return enqueue.chosen_handles(make, model, ids, nonces, calls.results, unique, digest, options.version)

    async def _enqueue(
        self, connection: redis.asyncio.Redis, model: str, frames: list[bytes], options: JobOptions
    ) -> list[str]:
        """``Producer._enqueue``, awaited: one MULTI, EVAL where FCALL found no function, and what
        Redis refused removed again and reported."""
        try:
            async with connection.pipeline(transaction=True) as pipe:
                ids = [add_enqueue(pipe, model, frame, options) for frame in frames]
                results = await pipe.execute(raise_on_error=False)
        except redis.ResponseError as exc:
            if not enqueue.is_refused_fcall(exc, options):
                raise
            async with connection.pipeline(transaction=True) as pipe:
                ids = [add_enqueue(pipe, model, frame, options, by_eval=True) for frame in frames]
                results = await pipe.execute(raise_on_error=False)
        by_eval, broken = enqueue.split_failures(results, ids)
        if by_eval:
            async with connection.pipeline(transaction=False) as pipe:
                for job_id in by_eval:
                    enqueue.add_enqueue_high_by_eval(pipe, model, job_id, options)
                again = await pipe.execute(raise_on_error=False)
            broken += [(job_id, r) for job_id, r in zip(by_eval, again, strict=True) if isinstance(r, Exception)]
        if broken:
            async with connection.pipeline(transaction=True) as pipe:
                for job_id, _ in broken:
                    pipe.delete(keys.request_key(model, job_id), keys.job_key(job_id))
                await pipe.execute(raise_on_error=False)
            raise enqueue.enqueue_failure(model, broken, len(ids))
        return ids

    async def infer(
        self, model: str, inputs: Mapping[str, Any], timeout: float = 30.0, **options: Unpack[SubmitOptions]
    ) -> dict[str, np.ndarray]:
        """Submit one job (``options``: those of :meth:`submit`) and await its outputs.

        If it times out (ResultTimeout, or the awaiting task is cancelled, as by ``asyncio.wait_for``
        or a client that went away), the job is taken off the queue if no worker has started it.
        """
        checks.wait_timeout(timeout)
        job = await self.submit(model, inputs, **options)
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
        reader = self._redis_for(model).reader
        return (await reader.wait([job_id], [model], [proof], checks.wait_timeout(timeout), late))[0]

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
            return await self._default.reader.wait(job_ids, models, proofs, timeout, None)
        groups = self._routes.group(models)
        waits = [
            asyncio.ensure_future(
                each.reader.wait(
                    [job_ids[i] for i in at], [models[i] for i in at], [proofs[i] for i in at], timeout, None
                )
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

    async def results(self, jobs: Sequence[AsyncInferenceJob], timeout: float = 30.0) -> list[dict[str, np.ndarray]]:
        """The outputs of many jobs, in order, waited for together. Raises InferenceFailed for the
        first job (in order) that failed, ResultTimeout if some had no result in time."""
        models, proofs = [job.model for job in jobs], [job.proof for job in jobs]
        responses = await self.wait_responses([job.id for job in jobs], models, timeout, proofs)
        return [enqueue.outputs_of(response, job) for job, response in zip(jobs, responses, strict=True)]

    async def cancel(self, job_id: str, model: str) -> bool:
        """Remove a queued job, or stop a started one (see AsyncInferenceJob.cancel)."""
        connection = self.connection_for(model)
        try:
            if not await connection.lrem(keys.queue_key(model), 0, job_id):
                return await self._request_stop(connection, job_id, model)
            async with connection.pipeline(transaction=True) as pipe:
                enqueue.add_cancel(pipe, job_id, model)
                await pipe.execute(raise_on_error=False)  # a job hash that is no hash: it is off the queue anyway
        except redis.RedisError as exc:
            wrong = f"the queue of {model!r} ({keys.queue_key(model)}) is no list"
            raise faults.failure(exc, f"could not cancel job {job_id}", wrong) from exc
        return True

    async def _request_stop(self, connection: Any, job_id: str, model: str) -> bool:
        """Mark a started job for its worker to stop (ortq.worker.stops)."""
        calls = enqueue.FunctionCalls(
            1, lambda pipe, i, by_eval: enqueue.add_request_stop(pipe, job_id, model, by_eval)
        )
        await self._call_functions(connection, calls)
        [reply] = calls.results
        if isinstance(reply, Exception):
            raise reply
        return bool(reply)

    async def _call_functions(self, connection: Any, calls: enqueue.FunctionCalls) -> None:
        """Send ``calls`` (by FCALL, then by EVAL where this Redis lacks the function)."""
        while calls.todo:
            async with connection.pipeline(transaction=False) as pipe:
                calls.queue(pipe)
                calls.take(await pipe.execute(raise_on_error=False))

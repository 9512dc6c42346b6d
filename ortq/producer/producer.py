"""``ortq.Producer``: push named numpy tensors to a model's queue and get the outputs back.

A producer needs numpy, msgpack and redis only; it never imports ONNX Runtime. What it checks and
sends is shared with ``ortq.AsyncProducer`` as I/O-free steps (``steps``: ``lookups``,
``submitting``, ``cancelling``, ``waiting``); this class sends what they ask, blocking.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, Unpack

import numpy as np
import redis

from ortq import keys, redisfaults, tracing, wire
from ortq.errors import ResultTimeout
from ortq.producer import cancelling, checks, enqueue, lookups, once, submitting, waiting
from ortq.producer.enqueue import SubmitOptions
from ortq.producer.replybook import ReplyBook
from ortq.producer.routes import Routes
from ortq.producer.steps import Await, Command, Request, Round, Stepper, Steps
from ortq.redisurls import redacted_url
from ortq.settings import Settings
from ortq.signature import ModelSignature

T = TypeVar("T")


class InferenceJob(enqueue.JobHandle["Producer"]):
    """A submitted job: wait for its outputs with :meth:`result`, look at it with :meth:`status`."""

    def status(self) -> str:
        """RQ's status of the job: queued, started, finished, failed, canceled, ...

        Raises JobNotFound when Redis has no record of it (never enqueued, or expired).
        """
        return self.producer._run(self.model, lookups.job_status(self.id))

    def result(self, timeout: float = 30.0) -> dict[str, np.ndarray]:
        """Block until the job's response arrives (at most ``timeout`` seconds) and return its outputs.

        The arrays are read-only views onto the received frame (no copy); ``.copy()`` one to write to it.
        Raises InferenceFailed if the worker failed the job, ResultTimeout if nothing arrived in time.
        """
        return enqueue.outputs_of(self.producer.wait_response(self.id, self.model, timeout, self.proof), self)

    def cancel(self) -> bool:
        """Take the job off its queue if no worker has started it, else ask the worker running it to stop
        it (within about half a second; it then fails with JobStopped, RQ's status ``stopped``); returns whether
        either was done (False: the job ended, or is unknown; or it is started and this handle, from
        ``job(id, model)``, lacks the nonce its stop token is made from)."""
        return self.producer.cancel(self.id, self.model, self.proof)


class Producer:
    """Submits jobs to ortq workers through Redis.

    ``validate``: check inputs against the signature the model's workers published before
    enqueueing (the worker checks again either way). ``allow_unknown_models``: enqueue for a model
    no worker has published a signature for (fire-and-forget before any worker starts); by default
    that raises UnknownModel and enqueues nothing, which is what a mistyped model name needs.

    ``settings.redis_shards`` (``$ORTQ_REDIS_SHARDS``) puts some models on other Redis instances
    (ortq/shards.py): each model's jobs, results, handles and worker records are then on its own
    Redis, through one client per Redis, opened at the first use of one of its models.
    ``connection``: a client of your own for ``redis_url`` (not for the other Redis instances).
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        settings: Settings | None = None,
        connection: redis.Redis | None = None,
        validate: bool = True,
        allow_unknown_models: bool = False,
    ) -> None:
        self.settings = settings or Settings.from_env(redis_url=redis_url)
        try:
            # One PING: a refused login or certificate is a ConfigurationError here, at once.
            self.connection = connection or self.settings.connect()
        except redis.RedisError as exc:
            raise redisfaults.failure(exc, f"cannot reach Redis at {redacted_url(self.settings.redis_url)}") from exc
        self.validate = validate
        self.allow_unknown_models = allow_unknown_models
        self._signatures = checks.SignatureCache()
        #: The name of this producer's reply streams (one a model: docs/wire-format.md, 4.1).
        self.reply_name = keys.new_reply_name(self.settings.result_ttl)
        self._books: dict[int, ReplyBook] = {}  # id of a Redis client -> the replies read through it
        self._block = self._block_seconds(self.connection)
        shards = self.settings.shards
        self._routes = None if shards is None else Routes(shards, self.connection, self._open_redis)

    def _open_redis(self, redis_url: str) -> redis.Redis:
        """A client for another Redis of the shard map (no PING: its first command says what is wrong)."""
        return self.settings.for_redis(redis_url).connect(check=False)

    def _block_seconds(self, connection: redis.Redis) -> float:
        socket_timeout = connection.connection_pool.connection_kwargs.get("socket_timeout")
        return redisfaults.block_seconds(self.settings, socket_timeout)

    def connection_for(self, model: str) -> redis.Redis:
        """The client of ``model``'s Redis: :attr:`connection`, unless the shard map puts the model
        on another Redis."""
        return self.connection if self._routes is None else self._routes.client(model)

    def _book(self, connection: redis.Redis) -> ReplyBook:
        """The replies read through ``connection`` (one book a Redis)."""
        book = self._books.get(id(connection))
        if book is None:
            book = self._books[id(connection)] = ReplyBook(self.reply_name)
        return book

    def close(self) -> None:
        self.connection.close()
        for client in [] if self._routes is None else self._routes.opened():
            client.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ models

    def signature(self, model: str, version: str | None = None) -> ModelSignature | None:
        """The signature the model's workers published (of ``version``; None: the current one, that
        of the worker that started last), or None if none has (yet)."""
        return self._run(model, lookups.signature(self._signatures, model, version))

    def workers(self, model: str) -> list[dict[str, Any]]:
        """The published records of the live workers serving ``model`` (on its Redis)."""
        return self._run(model, lookups.workers(model))

    def wait_for_workers(self, model: str, count: int = 1, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Wait until ``count`` workers serve ``model`` (they publish after warm-up); returns their records."""
        return self._run(model, lookups.wait_for_workers(model, count, timeout))

    def job(self, job_id: str, model: str) -> InferenceJob:
        """A handle on a job submitted earlier (by any producer)."""
        return InferenceJob(self, job_id, keys.check_model_name(model))

    # ------------------------------------------------------------------ submitting

    def submit(
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
    ) -> InferenceJob:
        """Validate and enqueue one job; returns at once with a handle to wait on.

        ``ttl``: seconds the job may wait for a worker before it is dropped.
        ``job_timeout``: seconds a worker may spend on it.
        ``retries``: times a failed run is tried again (never for bad input, timeouts or expiry),
        ``retry_backoff`` seconds after the first failure, doubling each time (0: at once).
        ``priority``: "high" jobs run before every "normal" one, in the order they were submitted.
        Seconds are whole: a fraction is rounded up; ttl and job_timeout are at least 1 s and every
        duration at most a year. A bad option raises ConfigurationError before anything is enqueued.
        """
        return self.submit_many(
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
        )[0]

    @tracing.sends  # one ortq.send span per call, when tracing is on (docs/tracing.md)
    def submit_many(
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
    ) -> list[InferenceJob]:
        """Validate every job first (options, model, inputs, queue room), then enqueue them all in
        one MULTI/EXEC round trip; see :meth:`submit` for the options."""
        options = checks.job_options(
            self.settings, ttl=ttl, job_timeout=job_timeout, retries=retries, retry_backoff=retry_backoff,
            priority=priority, version=version, reply=self.reply_name,
        )  # fmt: skip
        check = lookups.ModelCheck(self._signatures, self.validate, self.allow_unknown_models, self._routes)
        make = functools.partial(InferenceJob, self)
        book = self._book(self.connection_for(keys.check_model_name(model)))
        steps = submitting.submit_many(self.settings, check, make, model, many_inputs, options, job_ids, unique, book)
        return self._run(model, steps)

    def infer(
        self, model: str, inputs: Mapping[str, Any], timeout: float = 30.0, **options: Unpack[SubmitOptions]
    ) -> dict[str, np.ndarray]:
        """Submit one job (``options``: those of :meth:`submit`) and wait for its outputs.

        On ResultTimeout the job is taken off the queue if no worker has started it, so that no
        worker spends time on an answer nobody waits for.
        """
        checks.wait_timeout(timeout)
        job = self.submit(model, inputs, **options, **submitting.infer_options(self.settings))
        try:
            return job.result(timeout)
        except ResultTimeout:
            job.cancel()
            raise

    # ------------------------------------------------------------------ waiting

    def wait_response(self, job_id: str, model: str, timeout: float, proof: bytes | None = None) -> wire.Response:
        """Wait for the response of ``model``'s job ``job_id`` (its entry in its producer's reply
        stream, read with XREAD, which leaves it there until it expires); with ``proof``
        (JobHandle.proof), check that it answers that request."""
        deadline = time.monotonic() + checks.wait_timeout(timeout)
        late = f"no result for job {job_id} within {timeout:g} s"
        connection = self.connection_for(model)
        return self._wait(connection, waiting.Wait([job_id], [model], [proof], deadline, timeout, late))[0]

    def wait_responses(
        self,
        job_ids: Sequence[str],
        models: Sequence[str],
        timeout: float,
        proofs: Sequence[bytes | None] | None = None,
    ) -> list[wire.Response]:
        """The responses of many jobs (each of its model in ``models``), in order: one XREAD returns
        every reply that is there, or blocks until the first of them arrives, and so on until all
        are in. Under a shard map, jobs on several Redis instances are waited for one Redis after
        the other against one deadline, their replies kept by Redis meanwhile."""
        deadline = time.monotonic() + checks.wait_timeout(timeout)
        proofs = proofs if proofs is not None else [None] * len(job_ids)
        if self._routes is None:
            return self._wait(self.connection, waiting.Wait(job_ids, models, proofs, deadline, timeout))
        responses: dict[int, wire.Response] = {}
        for number, (connection, positions) in enumerate(self._routes.group(models)):
            ids, of = [job_ids[i] for i in positions], [models[i] for i in positions]
            # After the first Redis, look once even if the time is up: these replies may be in.
            wait = waiting.Wait(ids, of, [proofs[i] for i in positions], deadline, timeout, None, number > 0)
            found = self._wait(connection, wait)
            responses.update(zip(positions, found, strict=True))
        return [responses[i] for i in range(len(job_ids))]

    def _wait(self, connection: redis.Redis, wait: waiting.Wait) -> list[wire.Response]:
        block = self._block if connection is self.connection else self._block_seconds(connection)
        book = self._book(connection)
        steps = waiting.wait_for_responses(wait, book=book, block=block, max_bytes=self.settings.max_frame_bytes)
        return _run_on(lambda: connection, steps)

    def results(self, jobs: Sequence[InferenceJob], timeout: float = 30.0) -> list[dict[str, np.ndarray]]:
        """The outputs of many jobs, in order, waited for together (see wait_responses).

        Raises InferenceFailed for the first job (in order) that failed, ResultTimeout if some had
        no result in time.
        """
        responses = self.results_of(jobs, timeout)
        return [enqueue.outputs_of(response, job) for job, response in zip(jobs, responses, strict=True)]

    def results_of(self, jobs: Sequence[InferenceJob], timeout: float = 30.0) -> list[wire.Response]:
        """The responses of many jobs, in order, each checked against its request (its proof)."""
        models, proofs = [job.model for job in jobs], [job.proof for job in jobs]
        responses = self.wait_responses([job.id for job in jobs], models, timeout, proofs)
        return [enqueue.check_served(response, job) for job, response in zip(jobs, responses, strict=True)]

    def cancel(self, job_id: str, model: str, proof: bytes | None = None) -> bool:
        """Remove a queued job, or stop a started one with its ``proof`` (see InferenceJob.cancel)."""
        return self._run(model, cancelling.cancel(job_id, model, proof))

    def _run(self, model: str, steps: Steps[T]) -> T:
        """Send what ``steps`` ask for to ``model``'s Redis, each reply back, until they return."""
        return _run_on(lambda: self.connection_for(model), steps)


def _run_on(client: Callable[[], redis.Redis], steps: Steps[T]) -> T:
    """Send what ``steps`` ask for through ``client()`` (asked at each send: never before the steps'
    first checks, as a model's name) and hand each reply back, or the exception sending raised
    (what it means is the steps' to say), until they return."""
    stepper = Stepper(steps)
    try:
        while (request := stepper.next()) is not None:
            try:
                stepper.reply(_send(client(), request))
            except Exception as exc:
                stepper.fail(exc)
    finally:
        stepper.close()  # after an interrupt: a read begun is ended
    return stepper.result


def _send(connection: redis.Redis, request: Request) -> Any:
    if isinstance(request, Command):
        return getattr(connection, request.name)(*request.args, **request.kwargs)
    if isinstance(request, Round):
        with connection.pipeline(transaction=request.transaction) as pipe:
            request.queue(pipe)
            return once.execute(pipe) if request.once else pipe.execute(raise_on_error=False)
    if isinstance(request, Await):
        request.book.wait_change(request.seen, request.seconds, request.job_ids)
        return None
    time.sleep(request.seconds)
    return None

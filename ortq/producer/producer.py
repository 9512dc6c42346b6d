"""``ortq.Producer``: push named numpy tensors to a model's queue and get the outputs back.

A producer needs numpy, msgpack and redis only; it never imports ONNX Runtime. What it checks and
sends is shared with ``ortq.AsyncProducer`` (``checks``, ``enqueue``, ``faults``); this class does
the blocking I/O.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Unpack, cast

import numpy as np
import redis

from ortq import keys, tracing, wire
from ortq.control import MAX_WORKERS
from ortq.errors import BrokerUnavailable, OrtqError, ResultTimeout
from ortq.producer import checks, enqueue, faults
from ortq.producer.enqueue import JobOptions, SubmitOptions, add_enqueue
from ortq.producer.routes import Routes
from ortq.settings import Settings, redacted_url
from ortq.signature import ModelSignature

#: Most reply streams one XREAD names: the oldest pending jobs (replies mostly come in order; the
#: others are read as the window moves on). A wide window costs every wake-up as many keys sent and
#: looked up, for each of the jobs still pending: quadratic in a large drain.
_XREAD_STREAMS = 16


class InferenceJob(enqueue.JobHandle["Producer"]):
    """A submitted job: wait for its outputs with :meth:`result`, look at it with :meth:`status`."""

    def status(self) -> str:
        """RQ's status of the job: queued, started, finished, failed, canceled, ...

        Raises JobNotFound when Redis has no record of it (never enqueued, or expired).
        """
        key = keys.job_key(self.id)
        try:
            raw = self.producer.connection_for(self.model).hget(key, "status")
        except redis.RedisError as exc:
            doing = f"could not read the status of job {self.id}"
            raise faults.failure(exc, doing, f"the record of job {self.id} ({key}) is no job hash") from exc
        return enqueue.status_of(cast(bytes | None, raw), self.id)

    def result(self, timeout: float = 30.0) -> dict[str, np.ndarray]:
        """Block until the job's response arrives (at most ``timeout`` seconds) and return its outputs.

        The arrays are read-only views onto the received frame (no copy); ``.copy()`` one to write to it.
        Raises InferenceFailed if the worker failed the job, ResultTimeout if nothing arrived in time.
        """
        return enqueue.outputs_of(self.producer.wait_response(self.id, self.model, timeout, self.proof), self)

    def cancel(self) -> bool:
        """Take the job off its queue if no worker has started it, else ask the worker running it to stop
        it (within a heartbeat; it then fails with JobStopped, RQ's status ``stopped``); returns whether
        either was done (False: the job ended, or is unknown)."""
        return self.producer.cancel(self.id, self.model)


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
            raise faults.failure(exc, f"cannot reach Redis at {redacted_url(self.settings.redis_url)}") from exc
        self.validate = validate
        self.allow_unknown_models = allow_unknown_models
        self._signatures = checks.SignatureCache()
        self._block = self._block_seconds(self.connection)
        shards = self.settings.shards
        self._routes = None if shards is None else Routes(shards, self.connection, self._open_redis)

    def _open_redis(self, redis_url: str) -> redis.Redis:
        """A client for another Redis of the shard map (no PING: its first command says what is wrong)."""
        return self.settings.for_redis(redis_url).connect(check=False)

    def _block_seconds(self, connection: redis.Redis) -> float:
        socket_timeout = connection.connection_pool.connection_kwargs.get("socket_timeout")
        return faults.block_seconds(self.settings, socket_timeout)

    def connection_for(self, model: str) -> redis.Redis:
        """The client of ``model``'s Redis: :attr:`connection`, unless the shard map puts the model
        on another Redis."""
        return self.connection if self._routes is None else self._routes.client(model)

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
        keys.check_model_name(model)
        key = keys.signature_key(model, None if version is None else keys.check_version_name(version))
        cached = self._signatures.get(key, time.monotonic())
        if cached is not None:
            return cached
        try:
            raw = self.connection_for(model).get(key)
        except redis.RedisError as exc:
            doing = f"could not read the signature of {model!r}"
            raise faults.failure(exc, doing, f"the published signature of {model!r} ({key}) is no string") from exc
        signature = checks.parse_signature(cast(bytes | None, raw), model)
        self._signatures.put(key, signature, time.monotonic())
        return signature

    def _checked_model(self, model: str, version: str | None = None) -> ModelSignature | None:
        """The signature to check inputs against (None: none to check); UnknownModel when the model
        has none and unknown models are not allowed."""
        keys.check_model_name(model)
        if self.allow_unknown_models and not self.validate:
            return None
        signature = self.signature(model, version)
        if signature is None and not self.allow_unknown_models:
            shard = None if self._routes is None else self._routes.where(model)
            raise checks.unknown_model(model, self._live_records(self.connection_for(model)), shard, version)
        return signature if self.validate else None

    def _live_records(self, connection: redis.Redis) -> list[dict[str, Any]]:
        """Every live worker's record on that Redis (hostile input: what cannot be read is skipped)."""
        try:
            raw_names = connection.srandmember(keys.WORKERS_SET, MAX_WORKERS)
            names = checks.worker_names(raw_names or [])
            raws = connection.mget([keys.worker_key(n) for n in names]) if names else []
        except redis.RedisError as exc:
            if faults.is_wrong_type(exc):  # not written by ortq: no worker to be found there
                return []
            raise faults.failure(exc, "could not read the worker records") from exc
        return checks.live_records(raws)

    def workers(self, model: str) -> list[dict[str, Any]]:
        """The published records of the live workers serving ``model`` (on its Redis)."""
        records = self._live_records(self.connection_for(model))
        return [record for record in records if record.get("model") == model]

    def wait_for_workers(self, model: str, count: int = 1, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Wait until ``count`` workers serve ``model`` (they publish after warm-up); returns their records."""
        deadline = time.monotonic() + checks.wait_timeout(timeout)
        while True:
            found = self.workers(model)
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise ResultTimeout(f"{len(found)} of {count} workers for model {model!r} after {timeout:g} s")
            time.sleep(0.1)  # start-up only; results are waited for by blocking reads

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
            priority=priority, version=version,
        )  # fmt: skip
        signature = self._checked_model(model, version)
        many = list(many_inputs)
        nonces = [enqueue.new_nonce() for _ in many]
        size = self.settings.max_frame_bytes
        frames = [checks.encode_job(inputs, signature, nonce, size) for inputs, nonce in zip(many, nonces, strict=True)]
        chosen = None if job_ids is None else enqueue.check_job_ids(job_ids, len(frames))
        if not frames:
            return []
        connection = self.connection_for(model)
        if self.settings.max_queue_length:
            # Checked before the MULTI: several producers at once can overshoot by their batches.
            try:
                queued = connection.llen(keys.queue_key(model))
            except redis.RedisError as exc:
                wrong = f"the queue of {model!r} ({keys.queue_key(model)}) is no list"
                raise faults.failure(exc, f"could not enqueue for {model!r}", wrong) from exc
            checks.check_room(model, queued, len(frames), self.settings.max_queue_length)
        try:
            if chosen is not None:
                return self._enqueue_chosen(connection, model, frames, options, chosen, nonces, signature, unique)
            ids = self._enqueue(connection, model, frames, options)
        except redis.RedisError as exc:
            error = faults.failure(exc, f"could not enqueue {len(frames)} job(s) for {model!r}")
            if isinstance(error, BrokerUnavailable):
                error = BrokerUnavailable(f"{error}; {enqueue.MAYBE_ENQUEUED}")
            raise error from exc
        digest = None if signature is None else signature.digest
        return [InferenceJob(self, i, model, nonce, digest, version) for i, nonce in zip(ids, nonces, strict=True)]

    def _enqueue_chosen(
        self,
        connection: Any,
        model: str,
        frames: list[bytes],
        options: JobOptions,
        ids: list[str],
        nonces: list[bytes],
        signature: ModelSignature | None,
        unique: bool,
    ) -> list[InferenceJob]:
        """Enqueue each job under the id chosen for it unless a job of that id exists (never
        overwritten): by FCALL, or EVAL where this Redis lacks the function; see ``submit``."""
        calls = enqueue.FunctionCalls(
            len(ids),
            lambda pipe, i, by_eval: enqueue.add_enqueue_unique(pipe, model, frames[i], options, ids[i], by_eval),
        )
        self._call_functions(connection, calls)
        digest = None if signature is None else signature.digest
        make = functools.partial(InferenceJob, self)
        return enqueue.chosen_handles(make, model, ids, nonces, calls.results, unique, digest, options.version)

    def _enqueue(self, connection: redis.Redis, model: str, frames: list[bytes], options: JobOptions) -> list[str]:
        """One MULTI of the jobs; a high-priority insert that found no Redis function is done by EVAL
        instead; any other job Redis refused is removed again (its request and hash) and reported,
        so that nothing is left half-enqueued."""
        try:
            with connection.pipeline(transaction=True) as pipe:
                ids = [add_enqueue(pipe, model, frame, options) for frame in frames]
                results = pipe.execute(raise_on_error=False)
        except redis.ResponseError as exc:
            if not enqueue.is_refused_fcall(exc, options):
                raise
            with connection.pipeline(transaction=True) as pipe:
                ids = [add_enqueue(pipe, model, frame, options, by_eval=True) for frame in frames]
                results = pipe.execute(raise_on_error=False)
        by_eval, broken = enqueue.split_failures(results, ids)
        if by_eval:
            with connection.pipeline(transaction=False) as pipe:
                for job_id in by_eval:
                    enqueue.add_enqueue_high_by_eval(pipe, model, job_id, options)
                again = pipe.execute(raise_on_error=False)
            broken += [(job_id, r) for job_id, r in zip(by_eval, again, strict=True) if isinstance(r, Exception)]
        if broken:
            with connection.pipeline(transaction=True) as pipe:
                for job_id, _ in broken:
                    pipe.delete(keys.request_key(model, job_id), keys.job_key(job_id))
                pipe.execute(raise_on_error=False)
            raise enqueue.enqueue_failure(model, broken, len(ids))
        return ids

    def infer(
        self, model: str, inputs: Mapping[str, Any], timeout: float = 30.0, **options: Unpack[SubmitOptions]
    ) -> dict[str, np.ndarray]:
        """Submit one job (``options``: those of :meth:`submit`) and wait for its outputs.

        On ResultTimeout the job is taken off the queue if no worker has started it, so that no
        worker spends time on an answer nobody waits for.
        """
        checks.wait_timeout(timeout)
        job = self.submit(model, inputs, **options)
        try:
            return job.result(timeout)
        except ResultTimeout:
            job.cancel()
            raise

    # ------------------------------------------------------------------ waiting

    def wait_response(self, job_id: str, model: str, timeout: float, proof: bytes | None = None) -> wire.Response:
        """Wait for the response of ``model``'s job ``job_id`` (its reply stream, read with XREAD,
        which leaves it for other readers until it expires); with ``proof`` (JobHandle.proof),
        check that it answers that request."""
        deadline = time.monotonic() + checks.wait_timeout(timeout)
        late = f"no result for job {job_id} within {timeout:g} s"
        connection = self.connection_for(model)
        return self._wait(connection, [job_id], [model], [proof], deadline, timeout, late)[0]

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
            return self._wait(self.connection, job_ids, models, proofs, deadline, timeout, None)
        responses: dict[int, wire.Response] = {}
        for number, (connection, positions) in enumerate(self._routes.group(models)):
            ids, of = [job_ids[i] for i in positions], [models[i] for i in positions]
            # After the first Redis, look once even if the time is up: these replies may be in.
            found = self._wait(connection, ids, of, [proofs[i] for i in positions], deadline, timeout, None, number > 0)
            responses.update(zip(positions, found, strict=True))
        return [responses[i] for i in range(len(job_ids))]

    def _wait(
        self,
        connection: redis.Redis,
        job_ids: Sequence[str],
        models: Sequence[str],
        proofs: Sequence[bytes | None],
        deadline: float,
        timeout: float,
        late: str | None,
        look_once: bool = False,
    ) -> list[wire.Response]:
        proof_of = dict(zip(job_ids, proofs, strict=True))
        model_of = dict(zip(job_ids, models, strict=True))
        responses: dict[str, wire.Response] = {}
        outage = faults.Outage()
        block = self._block if connection is self.connection else self._block_seconds(connection)
        while True:
            pending = [job_id for job_id in proof_of if job_id not in responses]
            if not pending:
                return [responses[job_id] for job_id in job_ids]
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not look_once:
                raise outage.error(late or f"{len(pending)} of {len(job_ids)} jobs had no result within {timeout:g} s")
            look_once = False
            reading = pending[:_XREAD_STREAMS]
            try:
                # Blocks stay under the socket timeout, which would otherwise cut a long one short.
                block_ms = max(1, int(min(remaining, block) * 1000))
                streams = enqueue.reply_streams((model_of[job_id], job_id) for job_id in reading)
                reply = connection.xread(streams, block=block_ms)  # type: ignore[arg-type]
            except redis.RedisError as exc:
                if faults.is_down(exc):
                    time.sleep(max(0.0, min(outage.failed(exc, "could not read replies"), deadline - time.monotonic())))
                    continue
                raise self._unreadable_reply(connection, [(model_of[j], j) for j in reading], exc) from exc
            outage.recovered()
            for job_id, frame in enqueue.frames_in(reply).items():
                if isinstance(frame, OrtqError):
                    raise frame
                max_bytes = self.settings.max_frame_bytes
                responses[job_id] = enqueue.read_response(frame, job_id, proof_of.get(job_id), max_bytes)

    def _unreadable_reply(
        self, connection: redis.Redis, jobs: Sequence[tuple[str, str]], exc: redis.RedisError
    ) -> OrtqError:
        """XREAD refused: one of the reply keys is not a stream (written by someone else), or the
        Redis user may not read them."""
        refusal = enqueue.read_refusal(exc)
        if refusal is not None:
            return refusal
        try:
            with connection.pipeline(transaction=False) as pipe:
                for model, job_id in jobs:
                    enqueue.add_probe(pipe, model, job_id)
                probes = pipe.execute(raise_on_error=False)
        except redis.RedisError as again:
            return faults.failure(again, "could not read replies")
        for (model, job_id), probe in zip(jobs, probes, strict=True):
            if (wrong := enqueue.wrong_reply(model, job_id, probe)) is not None:
                return wrong
        return faults.failure(exc, "could not read replies")

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

    def cancel(self, job_id: str, model: str) -> bool:
        """Remove a queued job, or stop a started one (see InferenceJob.cancel)."""
        connection = self.connection_for(model)
        try:
            if not connection.lrem(keys.queue_key(model), 0, job_id):
                return self._request_stop(connection, job_id, model)
            with connection.pipeline(transaction=True) as pipe:
                enqueue.add_cancel(pipe, job_id, model)
                pipe.execute(raise_on_error=False)  # a job hash that is no hash: it is off the queue anyway
        except redis.RedisError as exc:
            wrong = f"the queue of {model!r} ({keys.queue_key(model)}) is no list"
            raise faults.failure(exc, f"could not cancel job {job_id}", wrong) from exc
        return True

    def _request_stop(self, connection: Any, job_id: str, model: str) -> bool:
        """Mark a started job for its worker to stop (ortq.worker.stops)."""
        calls = enqueue.FunctionCalls(
            1, lambda pipe, i, by_eval: enqueue.add_request_stop(pipe, job_id, model, by_eval)
        )
        self._call_functions(connection, calls)
        [reply] = calls.results
        if isinstance(reply, Exception):
            raise reply
        return bool(reply)

    def _call_functions(self, connection: Any, calls: enqueue.FunctionCalls) -> None:
        """Send ``calls`` (by FCALL, then by EVAL where this Redis lacks the function)."""
        while calls.todo:
            with connection.pipeline(transaction=False) as pipe:
                calls.queue(pipe)
                calls.take(pipe.execute(raise_on_error=False))

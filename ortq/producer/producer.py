"""``ortq.Producer``: push named numpy tensors to a model's queue and get the outputs back.

A producer needs numpy, msgpack and redis only; it never imports ONNX Runtime.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import redis

from ortq import keys, wire
from ortq.control import live_workers
from ortq.errors import (
    BrokerUnavailable,
    ConfigurationError,
    InferenceFailed,
    JobNotFound,
    OrtqError,
    PayloadTooLarge,
    QueueFull,
    ResultTimeout,
)
from ortq.producer.enqueue import PRIORITIES, JobOptions, add_enqueue
from ortq.rqjob import OrtqJob
from ortq.serializer import MsgpackSerializer
from ortq.settings import REDIS_DOWN, Settings, redacted_url
from ortq.signature import ModelSignature

#: Seconds a fetched model signature is trusted before it is read again.
_SIGNATURE_CACHE_SECONDS = 5.0


def _is_down(exc: Exception) -> bool:
    """Redis unreachable, as opposed to refusing this client (a login, a missing ACL permission)."""
    return not isinstance(exc, redis.AuthenticationError | redis.exceptions.NoPermissionError)


def _unavailable(exc: Exception, message: str) -> BrokerUnavailable:
    """The error to raise for ``exc`` caught as REDIS_DOWN; a refusal is re-raised as it is."""
    if not _is_down(exc):
        raise exc
    return BrokerUnavailable(f"{message}: Redis unavailable ({exc})")


class _Outage:
    """A wait that rides out Redis restarting (replies are kept by Redis, so a result may still
    come) until its deadline, then says whether it was Redis that was missing."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.last: Exception | None = None
        self._delay = 0.05

    def wait(self, exc: Exception) -> None:
        if not _is_down(exc):
            raise exc  # refused, not unreachable: waiting will not help
        self.last = exc
        time.sleep(max(0.0, min(self._delay, self.deadline - time.monotonic())))
        self._delay = min(self._delay * 2, 1.0)

    def error(self, message: str) -> OrtqError:
        if self.last is None:
            return ResultTimeout(message)
        return _unavailable(self.last, message)


class InferenceJob:
    """A submitted job: wait for its outputs with :meth:`result`, look at it with :meth:`status`."""

    def __init__(self, producer: Producer, job_id: str, model: str) -> None:
        self.producer = producer
        self.id = job_id
        self.model = model

    def __repr__(self) -> str:
        return f"InferenceJob(id={self.id!r}, model={self.model!r})"

    def status(self) -> str:
        """RQ's status of the job: queued, started, finished, failed, canceled, ...

        Raises JobNotFound when Redis has no record of it (never enqueued, or expired).
        """
        raw = self.producer.connection.hget(keys.job_key(self.id), "status")
        if raw is None:
            raise JobNotFound(f"no job {self.id} in Redis (never enqueued, or its record expired)")
        return keys.as_text(raw)

    def result(self, timeout: float = 30.0) -> dict[str, np.ndarray]:
        """Block until the job's response arrives (at most ``timeout`` seconds) and return its outputs.

        The arrays are read-only views onto the received frame (no copy); ``.copy()`` one to write to it.
        Raises InferenceFailed if the worker failed the job, ResultTimeout if nothing arrived in time.
        """
        response = self.producer.wait_response(self.id, timeout)
        if response.error is not None:
            raise InferenceFailed(self.id, response.error.type, response.error.message)
        return response.outputs

    def cancel(self) -> bool:
        """Take the job off its queue if no worker has started it; returns whether it was removed."""
        return self.producer.cancel(self.id, self.model)


class Producer:
    """Submits jobs to ortq workers through Redis."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        settings: Settings | None = None,
        connection: redis.Redis | None = None,
        validate: bool = True,
    ) -> None:
        self.settings = settings or Settings.from_env(redis_url=redis_url)
        try:
            # One PING: a refused login or certificate is a ConfigurationError here, at once.
            self.connection = connection or self.settings.connect()
        except REDIS_DOWN as exc:
            raise _unavailable(exc, f"cannot reach Redis at {redacted_url(self.settings.redis_url)}") from exc
        self.validate = validate
        self._signatures: dict[str, tuple[float, ModelSignature | None]] = {}

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ signatures

    def signature(self, model: str) -> ModelSignature | None:
        """The signature the model's workers published, or None if none has (yet)."""
        cached = self._signatures.get(model)
        if cached is not None and time.monotonic() - cached[0] < _SIGNATURE_CACHE_SECONDS:
            return cached[1]
        raw = self.connection.get(keys.signature_key(keys.check_model_name(model)))
        signature = None if raw is None else ModelSignature.loads(raw)
        self._signatures[model] = (time.monotonic(), signature)
        return signature

    def _encode(self, model: str, inputs: Mapping[str, Any]) -> bytes:
        arrays = {name: wire.as_wire_array(name, value) for name, value in inputs.items()}
        if self.validate:
            signature = self.signature(model)
            # With no worker published yet there is nothing to check against; the worker checks again.
            if signature is not None:
                signature.check_inputs(arrays)
        frame = wire.encode_request(arrays)
        if len(frame) > self.settings.max_frame_bytes:
            raise PayloadTooLarge(
                f"the request is {len(frame)} bytes, over max_frame_bytes ({self.settings.max_frame_bytes}): "
                "workers would refuse it"
            )
        return frame

    def _options(
        self, ttl: int | None, job_timeout: int | None, retries: int, retry_backoff: int, priority: str
    ) -> JobOptions:
        if retries < 0 or retry_backoff < 0:
            raise ConfigurationError(f"retries and retry_backoff must be >= 0, got {retries}, {retry_backoff}")
        if priority not in PRIORITIES:
            raise ConfigurationError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
        return JobOptions(
            request_ttl=self.settings.request_ttl,
            result_ttl=self.settings.result_ttl,
            failure_ttl=self.settings.failure_ttl,
            ttl=ttl,
            job_timeout=job_timeout,
            retries=retries,
            retry_backoff=retry_backoff,
            priority=priority,
        )

    # ------------------------------------------------------------------ submitting

    def submit(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        ttl: int | None = None,
        job_timeout: int | None = None,
        retries: int = 0,
        retry_backoff: int = 0,
        priority: str = "normal",
    ) -> InferenceJob:
        """Validate and enqueue one job; returns at once with a handle to wait on.

        ``ttl``: seconds the job may wait for a worker before it is dropped.
        ``job_timeout``: seconds a worker may spend on it.
        ``retries``: times a failed run is tried again (never for bad input, timeouts or expiry),
        ``retry_backoff`` seconds after the first failure, doubling each time (0: at once).
        ``priority``: "high" jobs run before every "normal" one, in the order they were submitted.
        """
        return self.submit_many(
            model,
            [inputs],
            ttl=ttl,
            job_timeout=job_timeout,
            retries=retries,
            retry_backoff=retry_backoff,
            priority=priority,
        )[0]

    def submit_many(
        self,
        model: str,
        many_inputs: Iterable[Mapping[str, Any]],
        *,
        ttl: int | None = None,
        job_timeout: int | None = None,
        retries: int = 0,
        retry_backoff: int = 0,
        priority: str = "normal",
    ) -> list[InferenceJob]:
        """Validate every job first, then enqueue them all in one MULTI/EXEC round trip."""
        keys.check_model_name(model)
        frames = [self._encode(model, inputs) for inputs in many_inputs]
        limit = self.settings.max_queue_length
        if limit:
            # Checked before the MULTI: several producers at once can overshoot by their batches.
            try:
                queued = self.connection.llen(keys.queue_key(model))
            except REDIS_DOWN as exc:
                raise _unavailable(exc, f"could not enqueue for {model!r}") from exc
            if queued + len(frames) > limit:
                raise QueueFull(
                    f"queue {keys.queue_name(model)} holds {queued} jobs; {len(frames)} more would pass "
                    f"max_queue_length ({limit})"
                )
        options = self._options(ttl, job_timeout, retries, retry_backoff, priority)
        try:
            with self.connection.pipeline(transaction=True) as pipe:
                ids = [add_enqueue(pipe, model, frame, options) for frame in frames]
                pipe.execute()
        except REDIS_DOWN as exc:
            error = _unavailable(exc, f"could not enqueue {len(frames)} job(s) for {model!r}")
            raise BrokerUnavailable(
                f"{error}; if the connection dropped during the write they may have been enqueued"
            ) from exc
        return [InferenceJob(self, job_id, model) for job_id in ids]

    def infer(self, model: str, inputs: Mapping[str, Any], timeout: float = 30.0) -> dict[str, np.ndarray]:
        """Submit one job and wait for its outputs.

        On ResultTimeout the job is taken off the queue if no worker has started it, so that no
        worker spends time on an answer nobody waits for.
        """
        job = self.submit(model, inputs)
        try:
            return job.result(timeout)
        except ResultTimeout:
            job.cancel()
            raise

    def workers(self, model: str) -> list[dict[str, Any]]:
        """The published records of the live workers serving ``model``."""
        return [record for record in live_workers(self.connection) if record.get("model") == model]

    def wait_for_workers(self, model: str, count: int = 1, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Wait until ``count`` workers serve ``model`` (they publish after warm-up); returns their records."""
        deadline = time.monotonic() + timeout
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

    # ------------------------------------------------------------------ waiting

    def wait_response(self, job_id: str, timeout: float) -> wire.Response:
        """Block on the job's reply list; the response stays there for other readers until it expires."""
        key = keys.reply_key(job_id)
        outage = _Outage(time.monotonic() + timeout)
        while True:
            remaining = outage.deadline - time.monotonic()
            if remaining <= 0:
                raise outage.error(f"no result for job {job_id} within {timeout:g} s")
            # BLMOVE from a list onto itself returns its one element without removing it.
            # Slices stay under the socket timeout, which would otherwise cut a long block short.
            block = min(remaining, self.settings.block_slice)
            try:
                # Redis >= 6 takes fractional timeouts; redis-py's annotation says int.
                frame = self.connection.blmove(key, key, block, "RIGHT", "LEFT")  # type: ignore[arg-type]
            except REDIS_DOWN as exc:
                outage.wait(exc)
                continue
            if frame is not None:
                return wire.decode_response(cast(bytes, frame), max_bytes=self.settings.max_frame_bytes)

    def wait_responses(self, job_ids: Sequence[str], timeout: float) -> list[wire.Response]:
        """The responses of many jobs, in order: one pipelined read fetches every response that
        is there, then one blocking read waits for the oldest missing one, and so on."""
        responses: list[wire.Response | None] = [None] * len(job_ids)
        pending = list(range(len(job_ids)))
        outage = _Outage(time.monotonic() + timeout)
        while True:
            try:
                with self.connection.pipeline(transaction=False) as pipe:
                    for i in pending:
                        pipe.lindex(keys.reply_key(job_ids[i]), 0)
                    frames = pipe.execute()
            except REDIS_DOWN as exc:
                outage.wait(exc)
                if time.monotonic() >= outage.deadline:
                    message = f"{len(pending)} of {len(job_ids)} jobs had no result within {timeout:g} s"
                    raise outage.error(message) from exc
                continue
            still = []
            for i, frame in zip(pending, frames, strict=True):
                if frame is None:
                    still.append(i)
                else:
                    responses[i] = wire.decode_response(frame, max_bytes=self.settings.max_frame_bytes)
            pending = still
            if not pending:
                return cast(list[wire.Response], responses)
            remaining = outage.deadline - time.monotonic()
            if remaining <= 0:
                raise outage.error(f"{len(pending)} of {len(job_ids)} jobs had no result within {timeout:g} s")
            oldest = keys.reply_key(job_ids[pending[0]])
            try:
                self.connection.blmove(oldest, oldest, min(remaining, self.settings.block_slice), "RIGHT", "LEFT")  # type: ignore[arg-type]
            except REDIS_DOWN as exc:
                outage.wait(exc)

    def results(self, jobs: Sequence[InferenceJob], timeout: float = 30.0) -> list[dict[str, np.ndarray]]:
        """The outputs of many jobs, in order, waited for together (see wait_responses).

        Raises InferenceFailed for the first job (in order) that failed, ResultTimeout if some had
        no result in time.
        """
        responses = self.wait_responses([job.id for job in jobs], timeout)
        for job, response in zip(jobs, responses, strict=True):
            if response.error is not None:
                raise InferenceFailed(job.id, response.error.type, response.error.message)
        return [response.outputs for response in responses]

    def cancel(self, job_id: str, model: str) -> bool:
        """Remove a queued job (see InferenceJob.cancel)."""
        if not self.connection.lrem(keys.queue_key(model), 0, job_id):
            return False
        self.connection.delete(keys.request_key(job_id))
        # The record may already have expired; the job is off the queue either way.
        with contextlib.suppress(Exception):
            OrtqJob.fetch(job_id, connection=self.connection, serializer=MsgpackSerializer).cancel()
        return True

"""What a producer reads before and after it submits, as I/O-free steps (``steps``): a model's
published signature (cached), whether a submit may go to a model, the live workers' records, a
job's status."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from ortq import keys, redisfaults
from ortq.control import MAX_WORKERS
from ortq.errors import ResultTimeout
from ortq.producer import checks, enqueue
from ortq.producer.routes import Routes
from ortq.producer.steps import Command, Pause, Steps
from ortq.signature import ModelSignature


def job_status(job_id: str) -> Steps[str]:
    """RQ's status of a job (its hash's ``status``); JobNotFound when Redis has no record of it."""
    key = keys.job_key(job_id)
    try:
        raw = yield Command("hget", key, "status")
    except redis.RedisError as exc:
        doing = f"could not read the status of job {job_id}"
        raise redisfaults.failure(exc, doing, f"the record of job {job_id} ({key}) is no job hash") from exc
    return enqueue.status_of(raw, job_id)


def signature(cache: checks.SignatureCache, model: str, version: str | None) -> Steps[ModelSignature | None]:
    """The signature the model's workers published (of ``version``; None: the current one), from
    ``cache`` while it is fresh; None if none has (yet)."""
    keys.check_model_name(model)
    key = keys.signature_key(model, None if version is None else keys.check_version_name(version))
    cached = cache.get(key, time.monotonic())
    if cached is not None:
        return cached
    try:
        raw = yield Command("get", key)
    except redis.RedisError as exc:
        doing = f"could not read the signature of {model!r}"
        raise redisfaults.failure(exc, doing, f"the published signature of {model!r} ({key}) is no string") from exc
    found = checks.parse_signature(raw, model)
    cache.put(key, found, time.monotonic())
    return found


@dataclass(frozen=True)
class ModelCheck:
    """How a producer checks the model of a submit: its ``validate`` and ``allow_unknown_models``,
    its signature cache, and its shard map's routes (None: no shard map), whose Redis an
    UnknownModel names."""

    signatures: checks.SignatureCache
    validate: bool
    allow_unknown: bool
    routes: Routes[Any] | None


def checked_model(check: ModelCheck, model: str, version: str | None) -> Steps[ModelSignature | None]:
    """The signature to check a submit's inputs against (None: none to check); UnknownModel when
    the model has none and unknown models are not allowed."""
    keys.check_model_name(model)
    if check.allow_unknown and not check.validate:
        return None
    found = yield from signature(check.signatures, model, version)
    if found is None and not check.allow_unknown:
        shard = None if check.routes is None else check.routes.where(model)
        raise checks.unknown_model(model, (yield from live_records()), shard, version)
    return found if check.validate else None


def live_records() -> Steps[list[dict[str, Any]]]:
    """Every live worker's record on a Redis (hostile input: what cannot be read is skipped)."""
    try:
        raw_names = yield Command("srandmember", keys.WORKERS_SET, MAX_WORKERS)
        names = checks.worker_names(raw_names or [])
        raws = (yield Command("mget", [keys.worker_key(n) for n in names])) if names else []
    except redis.RedisError as exc:
        if redisfaults.is_wrong_type(exc):  # not written by ortq: no worker to be found there
            return []
        raise redisfaults.failure(exc, "could not read the worker records") from exc
    return checks.live_records(raws)


def workers(model: str) -> Steps[list[dict[str, Any]]]:
    """The published records of the live workers serving ``model``."""
    records = yield from live_records()
    return [record for record in records if record.get("model") == model]


def wait_for_workers(model: str, count: int, timeout: float) -> Steps[list[dict[str, Any]]]:
    """Until ``count`` workers serve ``model`` (they publish after warm-up): their records."""
    deadline = time.monotonic() + checks.wait_timeout(timeout)
    while True:
        found = yield from workers(model)
        if len(found) >= count:
            return found
        if time.monotonic() > deadline:
            raise ResultTimeout(f"{len(found)} of {count} workers for model {model!r} after {timeout:g} s")
        yield Pause(0.1)  # start-up only; results are waited for by blocking reads

"""Idempotent enqueue: ``submit(..., job_id=..., unique=True)`` (docs/operations.md, "Idempotent
enqueue"). A job id a producer chooses is never overwritten: a second submit of it is refused
(JobExists), or with ``unique=True`` returns the existing job. Real Redis, real worker processes."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys
from ortq.errors import ConfigurationError, JobExists
from ortq.producer import AsyncProducer, Producer
from ortq.redisfunctions import JOBS_LIBRARY
from ortq.rqcompat import layout
from ortq.settings import Settings
from tests.conftest import WorkerProcesses, answers_of

pytestmark = pytest.mark.timeout(120)

X = np.array([[1, 2, 3, 4]], np.float32)


def test_a_chosen_id_is_enqueued_once_and_never_overwritten(
    tiny_path: Path, model_name: str, redis_url: str, connection: redis.Redis, workers: WorkerProcesses
) -> None:
    expected = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]
    with Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
        # No worker yet (scale to zero): the same id submitted three times is one queued job.
        first = producer.submit(model_name, {"x": X}, job_id=f"{model_name}-order-1", unique=True)
        again = producer.submit(model_name, {"x": X * 100}, job_id=f"{model_name}-order-1", unique=True)
        with pytest.raises(JobExists, match=r"exists .* nothing was overwritten"):
            producer.submit(model_name, {"x": X * 100}, job_id=f"{model_name}-order-1")
        assert connection.lrange(keys.queue_key(model_name), 0, -1) == [first.id.encode()]
        assert again.id == first.id and again.proof is None  # the existing job: its nonce is not ours
        workers.serve(tiny_path, model_name, redis_url)
        np.testing.assert_array_equal(first.result(timeout=30)["y"], expected)  # X, not X * 100
        np.testing.assert_array_equal(again.result(timeout=30)["y"], expected)
        # Answered: the id stays taken while its record and reply live, and is not run again.
        later = producer.submit(model_name, {"x": X}, job_id=first.id, unique=True)
        assert later.status() == "finished"
        assert len(answers_of(connection, model_name, first.id)) == 1
        assert connection.zcard(layout.QueueKeys.of(keys.queue_name(model_name)).finished) == 1

        # Another model's job of that id is never this model's, unique or not.
        other = f"{model_name}-other"
        with pytest.raises(JobExists, match="another model's job"):
            producer.submit(other, {"x": X}, job_id=first.id, unique=True)
        assert not connection.exists(keys.request_key(other, first.id))

        # Ids are RQ's: checked before anything is sent.
        for bad in ("", "a b", "x" * 129, "a:b"):
            with pytest.raises(ConfigurationError, match="job id"):
                producer.submit(model_name, {"x": X}, job_id=bad)
        with pytest.raises(ConfigurationError, match="twice"):
            producer.submit_many(model_name, [{"x": X}, {"x": X}], job_ids=["same", "same"])


def test_many_producers_racing_for_one_id_enqueue_it_once(
    model_name: str, redis_url: str, connection: redis.Redis
) -> None:
    """Eight threads, each with its own connection, submit the same ids at once: each id is
    enqueued exactly once, and every submit gets a handle on that one job."""
    ids = [f"{model_name}-race-{i}" for i in range(50)]
    fresh: list[int] = []
    barrier = threading.Barrier(8)

    def submit_all() -> None:
        with Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
            barrier.wait()
            jobs = producer.submit_many(model_name, [{"x": X}] * len(ids), job_ids=ids, unique=True)
            fresh.append(sum(job.proof is not None for job in jobs))

    threads = [threading.Thread(target=submit_all) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sum(fresh) == len(ids) and len(fresh) == 8
    assert sorted(connection.lrange(keys.queue_key(model_name), 0, -1)) == sorted(i.encode() for i in ids)


def test_without_the_function_the_same_code_runs_by_eval_and_high_priority_keeps_its_place(
    model_name: str, redis_url: str, connection: redis.Redis
) -> None:
    connection.function_delete(JOBS_LIBRARY) if connection.function_list(library=JOBS_LIBRARY) else None
    with Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
        normal = producer.submit(model_name, {"x": X}, job_id=f"{model_name}-n", unique=True)
        high = producer.submit(model_name, {"x": X}, job_id=f"{model_name}-h", unique=True, priority="high")
        assert producer.submit(model_name, {"x": X}, job_id=high.id, unique=True).proof is None
    assert connection.lrange(keys.queue_key(model_name), 0, -1) == [high.id.encode(), normal.id.encode()]
    assert connection.hget(keys.job_key(high.id), "ortq_priority") == b"high"
    assert connection.ttl(keys.job_key(normal.id)) > 0 and connection.ttl(keys.request_key(model_name, normal.id)) > 0


def test_the_async_producer_refuses_and_returns_alike(model_name: str, redis_url: str, connection: redis.Redis) -> None:
    async def main() -> None:
        async with AsyncProducer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
            job = await producer.submit(model_name, {"x": X}, job_id=f"{model_name}-a", unique=True)
            assert job.proof is not None
            same = await producer.submit(model_name, {"x": X}, job_id=job.id, unique=True)
            assert same.id == job.id and same.proof is None
            with pytest.raises(JobExists) as refused:
                await producer.submit_many(model_name, [{"x": X}, {"x": X}], job_ids=[f"{model_name}-b", job.id])
            assert [j.id for j in refused.value.enqueued] == [f"{model_name}-b"]  # type: ignore[attr-defined]

    asyncio.run(main())
    assert connection.llen(keys.queue_key(model_name)) == 2


def test_a_producer_with_the_documented_per_model_rule_may_enqueue_uniquely_and_stop(
    model_name: str, redis_url: str, connection: redis.Redis
) -> None:
    """The functions run with the caller's rights: every command they call is one docs/security.md
    grants a producer of that model, on keys of that model (and RQ's job hashes)."""
    from ortq.redisfunctions import ensure_functions
    from tests.test_tenant_safety import ONE_MODEL_RULES, acl_rules

    assert ensure_functions(connection)  # as every worker does at its start: producers then use FCALL
    user, password = f"unique-{model_name}", "pw-unique"
    connection.acl_setuser(user, enabled=True, reset=True)
    connection.execute_command(
        "ACL", "SETUSER", user, "on", f">{password}", *acl_rules(ONE_MODEL_RULES.format(model=model_name))
    )
    url = redis_url.replace("redis://", f"redis://{user}:{password}@")
    try:
        with Producer(settings=Settings.from_url(url), allow_unknown_models=True) as producer:
            job = producer.submit(model_name, {"x": X}, job_id=f"{model_name}-acl", unique=True)
            assert producer.submit(model_name, {"x": X}, job_id=job.id, unique=True).proof is None
            high = producer.submit(model_name, {"x": X}, job_id=f"{model_name}-acl-h", priority="high")
            connection.hset(keys.job_key(job.id), "status", "started")  # as a worker's start writes it
            connection.lrem(keys.queue_key(model_name), 0, job.id)
            assert job.cancel() is True  # the stop request
            assert connection.hget(keys.job_key(job.id), "ortq_stop") is not None
            assert high.cancel() is True  # still queued: taken off
    finally:
        connection.acl_deluser(user)


def test_a_function_librarys_code_changes_only_with_its_name() -> None:
    """Workers load a library only where Redis lacks one of its name (redisfunctions.ensure_functions), so
    workers of two releases share a Redis without replacing each other's code: changed code under an
    old name would never reach a Redis that has the old one. Change the code: bump the name (and its
    functions' names), then this table."""
    import hashlib

    from ortq import redisfunctions

    sources = {
        redisfunctions.LIBRARY: redisfunctions.library_source(),
        redisfunctions.JOBS_LIBRARY: redisfunctions.jobs_library_source(),
    }
    digests = {name: hashlib.sha256(source.encode()).hexdigest()[:16] for name, source in sources.items()}
    assert digests == {"ortq_v2": "7a57d329d37abeb5", "ortq_jobs_v3": "b541773548f0c826"}


@pytest.mark.parametrize("fields", [[], ["status"], ["f", "v"] * 4000], ids=["none", "odd", "too many"])
def test_a_unique_enqueue_refused_for_its_fields_writes_nothing(
    connection: redis.Redis, model_name: str, fields: list[str]
) -> None:
    """issue 35: the function wrote the request frame, then its HSET failed, leaving the frame."""
    from ortq import redisfunctions

    redisfunctions.ensure_functions(connection)
    job_id = f"unique-{len(fields)}"
    job, queue = keys.job_key(job_id), keys.queue_key(model_name)
    request = keys.request_key(model_name, job_id)
    args = [job_id, b"frame", 60, 60, "normal", keys.queue_name(model_name), request, "rq:queues", *fields]
    with pytest.raises(redis.ResponseError, match="field-value pairs"):
        connection.fcall(redisfunctions.UNIQUE_FUNCTION, 3, job, queue, keys.last_high_key(model_name), *args)
    assert connection.exists(job, request) == 0 and connection.llen(queue) == 0

"""An enqueue whose connection breaks at its EXEC puts its jobs in once (ortq/producer/once.py).

redis-py sends a pipeline again after a connection error (Producer: its default retries;
AsyncProducer: one). For the enqueue MULTI that was wrong when EXEC had run and only its reply was
lost: the jobs went in twice, and a job started before the second write was set back to
``queued`` by it and run a second time. Here a real redis-server sits behind a proxy that breaks
the connection at the next EXEC (tests/tcp_proxy.py), before Redis gets it or after Redis ran it,
and each producer's submit must leave every job queued once, its status untouched by a second
write; a real worker then answers the job once, with what ``session.run`` gives.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys
from ortq.errors import BrokerUnavailable
from ortq.producer import AsyncProducer, Producer
from ortq.redisfunctions import ensure_functions
from ortq.rqcompat import layout
from ortq.settings import Settings
from tests.conftest import WorkerProcesses, answers_of
from tests.tcp_proxy import CommandCuttingProxy

X = np.arange(8, dtype=np.float32).reshape(2, 4)
MODES = ("before", "after")


@pytest.fixture
def proxy(redis_url: str) -> object:
    with CommandCuttingProxy(urlparse(redis_url).port or 6379) as running:
        yield running


def _queued_once(connection: redis.Redis, model: str, ids: list[str]) -> None:
    entries = [keys.as_text(e) for e in connection.lrange(keys.queue_key(model), 0, -1)]  # type: ignore[union-attr]
    assert sorted(entries) == sorted(ids), f"queued other than once each: {entries}"
    for job_id in ids:
        assert connection.hget(layout.job_key(job_id), "status") == b"queued"


@pytest.mark.parametrize("mode", MODES)
def test_a_producers_enqueue_cut_at_exec_goes_in_once(
    proxy: CommandCuttingProxy, connection: redis.Redis, model_name: str, mode: str
) -> None:
    with Producer(settings=Settings.from_url(proxy.url), allow_unknown_models=True) as producer:
        proxy.cut_next(mode)
        jobs = producer.submit_many(model_name, [{"x": X}, {"x": X + 1}])
    assert proxy.cuts == 1
    _queued_once(connection, model_name, [job.id for job in jobs])


@pytest.mark.parametrize("mode", MODES)
def test_an_async_producers_enqueue_cut_at_exec_goes_in_once(
    proxy: CommandCuttingProxy, connection: redis.Redis, model_name: str, mode: str
) -> None:
    async def submit() -> list[str]:
        async with AsyncProducer(settings=Settings.from_url(proxy.url), allow_unknown_models=True) as producer:
            proxy.cut_next(mode)
            return [job.id for job in await producer.submit_many(model_name, [{"x": X}, {"x": X + 1}])]

    ids = asyncio.run(submit())
    assert proxy.cuts == 1
    _queued_once(connection, model_name, ids)


def test_an_enqueue_whose_exec_reply_timed_out_is_enqueued_or_reported_as_maybe(
    proxy: CommandCuttingProxy, connection: redis.Redis, model_name: str
) -> None:
    """A timeout is not a broken connection: Redis may be slow, not gone, and run the EXEC later,
    so it is never sent again. Ran (its reply held back): the submit succeeds, the job queued once.
    Not run (the EXEC held back): BrokerUnavailable, saying the jobs may have been enqueued."""
    settings = Settings.from_url(proxy.url, socket_timeout=2.0)
    with Producer(settings=settings, allow_unknown_models=True) as producer:
        proxy.cut_next("mute")
        [job] = producer.submit_many(model_name, [{"x": X}])
        _queued_once(connection, model_name, [job.id])
        proxy.cut_next("stall")
        with pytest.raises(BrokerUnavailable, match="may have been enqueued"):
            producer.submit_many(model_name, [{"x": X}])
    assert proxy.cuts == 2
    _queued_once(connection, model_name, [job.id])


@pytest.mark.parametrize("mode", [*MODES, "mute"])
def test_an_enqueue_under_chosen_ids_whose_reply_was_lost_takes_its_own_jobs_for_its_own(
    proxy: CommandCuttingProxy, connection: redis.Redis, model_name: str, mode: str
) -> None:
    """``job_ids``: the jobs go in by ortq's Redis function, which never overwrites a job. Sent
    again after a lost reply, it answered "a job of that id exists" for the submit's own jobs
    (JobExists, or a handle that checks no proof). The submit reads them back instead: its own (the
    ``created_at`` it wrote) are enqueued, with their proofs; those not there are sent again."""
    ensure_functions(connection)  # what a worker does: the FCALL finds the function
    ids = [f"{model_name}-a", f"{model_name}-b"]

    async def submit_async() -> list[Any]:
        async with AsyncProducer(settings=settings, allow_unknown_models=True) as producer:
            proxy.cut_next(mode, "FCALL")
            return await producer.submit_many(model_name, [{"x": X}, {"x": X + 1}], job_ids=ids)

    settings = Settings.from_url(proxy.url, socket_timeout=2.0)
    with Producer(settings=settings, allow_unknown_models=True) as producer:
        proxy.cut_next(mode, "FCALL")
        jobs: list[Any] = producer.submit_many(model_name, [{"x": X}, {"x": X + 1}], job_ids=ids)
    assert [job.id for job in jobs] == ids and all(job.proof is not None for job in jobs)
    _queued_once(connection, model_name, ids)
    connection.delete(keys.queue_key(model_name), *(layout.job_key(i) for i in ids))
    jobs = asyncio.run(submit_async())
    assert [job.id for job in jobs] == ids and all(job.proof is not None for job in jobs)
    assert proxy.cuts == 2
    _queued_once(connection, model_name, ids)


@pytest.mark.parametrize("mode", [*MODES, "mute"])
def test_a_cancel_whose_reply_was_lost_cancels_the_job(
    proxy: CommandCuttingProxy, connection: redis.Redis, model_name: str, mode: str
) -> None:
    """A cancel takes a queued job off its queue with LREM. Sent again after a lost reply, an LREM
    that had run answered 0: the cancel said False, and the job, off its queue, was neither
    cancelled nor ever run. Both producers cancel it, whatever the LREM's reply came to."""

    async def cancel_async(job_id: str) -> bool:
        async with AsyncProducer(settings=settings, allow_unknown_models=True) as producer:
            proxy.cut_next(mode, "LREM")
            return await producer.cancel(job_id, model_name)

    settings = Settings.from_url(proxy.url, socket_timeout=2.0)
    with Producer(settings=settings, allow_unknown_models=True) as producer:
        jobs = producer.submit_many(model_name, [{"x": X}, {"x": X}])
        proxy.cut_next(mode, "LREM")
        assert producer.cancel(jobs[0].id, model_name) is True
    assert asyncio.run(cancel_async(jobs[1].id)) is True
    assert proxy.cuts == 2
    assert connection.llen(keys.queue_key(model_name)) == 0
    for job in jobs:
        assert connection.hget(layout.job_key(job.id), "status") == b"canceled"


def test_a_job_whose_enqueue_reply_was_lost_is_run_and_answered_once(
    proxy: CommandCuttingProxy,
    connection: redis.Redis,
    model_name: str,
    redis_url: str,
    tiny_path: Path,
    workers: WorkerProcesses,
) -> None:
    """The whole path: the submit's EXEC ran and its reply was lost; a real worker answers the job,
    once, with the model's outputs."""
    with Producer(settings=Settings.from_url(proxy.url)) as producer:
        workers.start(tiny_path, model_name, redis_url)
        assert producer.wait_for_workers(model_name, timeout=60)
        proxy.cut_next("after")
        job = producer.submit(model_name, {"x": X})
        assert proxy.cuts == 1
        outputs = job.result(timeout=30)
    expected = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]
    np.testing.assert_array_equal(outputs["y"], expected)
    assert len(answers_of(connection, model_name, job.id)) == 1
    assert connection.xlen(keys.reply_key(model_name, producer.reply_name)) == 1  # its producer's one answer
    assert connection.xlen(layout.results_key(job.id)) == 1
    assert connection.llen(keys.queue_key(model_name)) == 0

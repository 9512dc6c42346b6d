"""AsyncProducer -> real Redis -> real ``ortq worker`` processes, from asyncio code (each test runs
its coroutine with ``asyncio.run``; no pytest plugin needed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnxruntime as ort
import pytest
import redis
import redis.asyncio

from ortq import AsyncProducer, keys, redisfunctions, wire
from ortq.demo import HOLDOUT_PATH, MODEL_PATH
from ortq.errors import (
    BrokerUnavailable,
    ConfigurationError,
    CorruptRecord,
    InferenceFailed,
    InvalidInput,
    JobNotFound,
    ResponseMismatch,
    ResultTimeout,
    UnknownModel,
)
from ortq.localredis import LocalRedis
from ortq.settings import Settings
from tests import onnx_models
from tests.conftest import WorkerProcesses, eventually

T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def producer_for(url: str, **options: Any) -> AsyncProducer:
    return AsyncProducer(settings=Settings.from_url(url), **options)


def direct(model_path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def test_outputs_equal_a_direct_session_run(workers: WorkerProcesses, redis_url: str, model_name: str) -> None:
    workers.serve(MODEL_PATH, model_name, redis_url)
    pixels = np.load(HOLDOUT_PATH)["pixels"]

    async def main() -> dict[str, Any]:
        async with producer_for(redis_url) as producer:
            one = await producer.infer(model_name, {"pixels": pixels[:16]})
            jobs = await producer.submit_many(model_name, [{"pixels": row[None]} for row in pixels[16:24]])
            many = await producer.results(jobs)
            again = await jobs[0].result(timeout=5)  # the reply stays for other readers until it expires
            async with producer_for(redis_url) as other:
                elsewhere = await other.job(jobs[1].id, model_name).result(timeout=5)
            return {
                "one": one,
                "many": many,
                "again": again,
                "elsewhere": elsewhere,
                "status": await jobs[0].status(),
                "signature": await producer.signature(model_name),
                "workers": await producer.workers(model_name),
            }

    got = run(main())
    expected = direct(MODEL_PATH, {"pixels": pixels[:16]})
    np.testing.assert_allclose(got["one"]["probabilities"], expected["probabilities"], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got["one"]["label"], expected["label"])
    for row, outputs in zip(pixels[16:24], got["many"], strict=True):
        np.testing.assert_array_equal(outputs["label"], direct(MODEL_PATH, {"pixels": row[None]})["label"])
    np.testing.assert_array_equal(got["again"]["probabilities"], got["many"][0]["probabilities"])
    np.testing.assert_array_equal(got["elsewhere"]["label"], got["many"][1]["label"])
    assert got["status"] == "finished"
    assert [spec.name for spec in got["signature"].inputs] == ["pixels"]
    assert [record["model"] for record in got["workers"]] == [model_name]


def test_hundreds_of_concurrent_infers_share_a_few_connections(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, connection: redis.Redis
) -> None:
    """What a FastAPI app does under load: many requests, each awaiting ``infer``, at once."""
    workers.serve(tiny_path, model_name, redis_url, 2)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((1 + i % 3, 4)).astype(np.float32) for i in range(500)]
    baseline = len(connection.client_list())

    async def main() -> tuple[list[dict[str, np.ndarray]], int]:
        peak = 0

        async def watch() -> None:  # one connection more, counted below
            nonlocal peak
            async with redis.asyncio.Redis.from_url(redis_url) as admin:
                while True:
                    peak = max(peak, len(await admin.client_list()))
                    await asyncio.sleep(0.005)

        producer = producer_for(redis_url, max_connections=8, max_reads=4)
        watcher = asyncio.create_task(watch())
        try:
            outputs = await asyncio.gather(*(producer.infer(model_name, {"x": x}, timeout=60) for x in xs))
        finally:
            watcher.cancel()
            await producer.aclose()
        return outputs, peak

    outputs, peak = run(main())
    for x, got in zip(xs, outputs, strict=True):
        np.testing.assert_array_equal(got["y"], x * 2 + 1)
    # At most 8 for commands, 4 for reading replies, 1 for the watcher: not one per awaiting request.
    assert baseline < peak <= baseline + 8 + 4 + 1, (baseline, peak)
    eventually(lambda: len(connection.client_list()) <= baseline)  # aclose closed them all


@pytest.mark.parametrize("max_reads", [1, 4])
def test_a_fast_reply_is_not_held_up_behind_a_slow_job(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, models_dir: Path, max_reads: int
) -> None:
    """A job awaited while the reader already blocks on a slow one is read at once: by a read of its
    own, or (max_reads=1) by cutting the slow one's read short and reading both."""
    slow = onnx_models.slow_model(models_dir / "slow-async.onnx", 4 * onnx_models.SLOW_MODEL_LOOPS)
    workers.serve(slow, model_name + "-slow", redis_url)
    workers.serve(tiny_path, model_name, redis_url)
    x = np.ones((1, 4), np.float32)

    async def main() -> tuple[str, dict[str, np.ndarray], dict[str, np.ndarray]]:
        async with producer_for(redis_url, max_reads=max_reads) as producer:
            slow_job = await producer.submit(model_name + "-slow", {"x": np.full((1, 256), 0.01, np.float32)})
            slow_wait = asyncio.create_task(slow_job.result(timeout=60))
            while await slow_job.status() != "started":
                await asyncio.sleep(0.01)
            fast = await producer.infer(model_name, {"x": x}, timeout=30)
            status_then = await slow_job.status()
            return status_then, fast, await slow_wait

    status_then, fast, slow_outputs = run(main())
    assert status_then == "started"  # the fast answer came while the slow job still ran
    np.testing.assert_array_equal(fast["y"], x * 2 + 1)
    assert slow_outputs["y"].shape == (1, 256)


def test_timeouts_and_abandoned_waits_take_the_job_off_the_queue(
    redis_url: str, model_name: str, connection: redis.Redis
) -> None:
    x = {"x": np.ones((1, 4), np.float32)}
    queue = keys.queue_key(model_name)

    async def main() -> None:
        async with producer_for(redis_url, allow_unknown_models=True) as producer:
            started = time.monotonic()
            with pytest.raises(ResultTimeout, match=r"no result for job \S+ within 0.5 s"):
                await producer.infer(model_name, x, timeout=0.5)
            assert 0.5 <= time.monotonic() - started < 5
            assert connection.llen(queue) == 0  # nobody waits for it: no worker will spend time on it

            # Abandoned by the caller, as a web framework does when its client goes away.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(producer.infer(model_name, x, timeout=30), 0.3)
            for _ in range(200):
                if connection.llen(queue) == 0:
                    break
                await asyncio.sleep(0.01)
            assert connection.llen(queue) == 0

            jobs = await producer.submit_many(model_name, [x, x, x])
            with pytest.raises(ResultTimeout, match=r"3 of 3 jobs had no result within 0\.3 s"):
                await producer.results(jobs, timeout=0.3)
            with pytest.raises(ResultTimeout):
                await jobs[0].result(timeout=0)
            with pytest.raises(ConfigurationError, match="timeout must be"):
                await jobs[0].result(timeout=-1)
            assert connection.llen(queue) == 3  # waits that ran out leave submitted jobs queued

    run(main())


def test_cancel_and_status(redis_url: str, model_name: str, connection: redis.Redis) -> None:
    async def main() -> None:
        async with producer_for(redis_url, allow_unknown_models=True) as producer:
            job = await producer.submit(model_name, {"x": np.ones((1, 4), np.float32)})
            assert await job.status() == "queued"
            assert await job.cancel()
            assert await job.status() == "canceled"
            assert not connection.exists(keys.request_key(job.model, job.id))
            assert connection.llen(keys.queue_key(model_name)) == 0
            assert not await job.cancel()  # off the queue already
            with pytest.raises(JobNotFound):
                await producer.job("never-enqueued", model_name).status()

    run(main())


def test_unknown_models_and_bad_inputs_are_refused_before_anything_is_enqueued(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, connection: redis.Redis
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    mistyped = model_name + "x"

    async def main() -> None:
        async with producer_for(redis_url) as producer:
            with pytest.raises(UnknownModel, match=f"Did you mean '{model_name}'"):
                await producer.infer(mistyped, {"x": np.ones((1, 4), np.float32)})
            with pytest.raises(InvalidInput, match="size 5 on axis 1"):
                await producer.submit(model_name, {"x": np.ones((1, 5), np.float32)})
            with pytest.raises(ConfigurationError, match="ttl must be positive"):
                await producer.submit(model_name, {"x": np.ones((1, 4), np.float32)}, ttl=0)
        async with producer_for(redis_url, validate=False) as unchecked:
            bad = await unchecked.submit(model_name, {"x": np.ones((1, 5), np.float32)})
            with pytest.raises(InferenceFailed) as caught:
                await bad.result(timeout=30)
            assert caught.value.remote_type == "InvalidInput"

    run(main())
    assert not connection.exists(keys.queue_key(mistyped))
    assert not connection.sismember(keys.RQ_QUEUES_SET, keys.queue_key(mistyped))
    assert connection.llen(keys.queue_key(model_name)) == 0


def test_forged_and_corrupt_replies_are_refused(redis_url: str, model_name: str, connection: redis.Redis) -> None:
    """An answer that does not carry the request's proof is ResponseMismatch; a large answer whose
    key is no stream fails that job alone (CorruptRecord) while the others are still waited for; a
    reply stream that is no stream is CorruptRecord for its waits, never a hang."""

    async def main() -> None:
        async with producer_for(redis_url, allow_unknown_models=True) as producer:
            stream = keys.reply_key(model_name, producer.reply_name)

            def answer(job_id: str, frame: bytes) -> None:  # an entry as a worker writes it
                connection.xadd(stream, {"id": job_id, "frame": frame})

            x = {"x": np.ones((1, 4), np.float32)}
            forged, corrupt, fine, last = await producer.submit_many(model_name, [x, x, x, x])
            answer(
                forged.id,
                wire.encode_response(
                    {"y": np.zeros((1, 4), np.float32)}, proof=wire.proof_of(model_name, b"\x00" * 16)
                ),
            )
            with pytest.raises(ResponseMismatch, match=forged.id):
                await forged.result(timeout=5)
            connection.set(keys.large_reply_key(model_name, corrupt.id), b"not a stream")
            waiting = asyncio.create_task(fine.result(timeout=10))
            answer(corrupt.id, b"")  # its frame said to be in its own key
            with pytest.raises(CorruptRecord, match=f"large answer of job {corrupt.id}"):
                await corrupt.result(timeout=5)
            answer(fine.id, wire.encode_response({"y": np.ones((1, 4), np.float32)}, proof=fine.proof))
            np.testing.assert_array_equal((await waiting)["y"], np.ones((1, 4), np.float32))
            connection.delete(stream)
            connection.set(stream, b"not a stream")
            with pytest.raises(CorruptRecord, match="holds no stream"):
                await last.result(timeout=5)

    run(main())


@pytest.fixture
def own_redis() -> Any:
    with LocalRedis(durable=True) as server:
        yield server


@pytest.mark.timeout(90)
def test_a_redis_outage_is_broker_unavailable_never_a_hang(own_redis: LocalRedis, model_name: str) -> None:
    x = {"x": np.ones((1, 4), np.float32)}

    async def main() -> None:
        producer = producer_for(own_redis.url, allow_unknown_models=True, validate=False)  # reads no signature
        job = await producer.submit(model_name, x)
        own_redis.stop()
        with pytest.raises(BrokerUnavailable, match="could not enqueue"):
            await producer.submit(model_name, x)
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="no result for job"):
            await job.result(timeout=2)
        assert time.monotonic() - started < 10
        with pytest.raises(BrokerUnavailable, match="had no result"):
            await producer.results([job], timeout=1)
        with pytest.raises(BrokerUnavailable, match="could not read the status"):
            await job.status()
        with pytest.raises(BrokerUnavailable, match="could not cancel"):
            await job.cancel()
        with pytest.raises(BrokerUnavailable, match="could not read the signature"):
            await producer_for(own_redis.url).submit(model_name, x)
        with pytest.raises(BrokerUnavailable, match="cannot reach Redis"):
            async with producer_for(own_redis.url):
                pass
        await producer.aclose()

    run(main())


@pytest.mark.timeout(120)
def test_a_wait_rides_out_a_redis_restart(
    own_redis: LocalRedis, workers: WorkerProcesses, model_name: str, tiny_path: Path
) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)

    async def main() -> dict[str, np.ndarray]:
        async with producer_for(own_redis.url, allow_unknown_models=True) as producer:
            job = await producer.submit(model_name, {"x": x})
            waiting = asyncio.create_task(job.result(timeout=90))
            await asyncio.sleep(0.2)
            await asyncio.to_thread(own_redis.restart, 1.0)  # durable: the queued job survives
            await asyncio.to_thread(workers.serve, tiny_path, model_name, own_redis.url)
            return await waiting

    np.testing.assert_array_equal(run(main())["y"], x * 2 + 1)


def test_high_priority_by_fcall_and_by_eval_before_any_worker_loaded_the_function(
    own_redis: LocalRedis, model_name: str
) -> None:
    admin = redis.Redis.from_url(own_redis.url)
    x = {"x": np.ones((1, 4), np.float32)}

    async def main() -> None:
        async with producer_for(own_redis.url, allow_unknown_models=True) as producer:
            normal = await producer.submit(model_name, x)
            by_eval = await producer.submit_many(model_name, [x, x], priority="high")  # no function yet
            assert redisfunctions.ensure_functions(admin)  # what a worker does at start
            by_fcall = await producer.submit(model_name, x, priority="high")
            queued = [keys.as_text(i) for i in admin.lrange(keys.queue_key(model_name), 0, -1)]
            assert queued == [*(job.id for job in by_eval), by_fcall.id, normal.id]

    run(main())
    calls = admin.info("commandstats")
    assert calls["cmdstat_eval"]["calls"] == 2 and calls["cmdstat_fcall"]["calls"] >= 1
    admin.close()

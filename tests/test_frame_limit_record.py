"""The largest request frame a worker reads is in its model's signature record (issue 35, section 3:
a client in another language had to guess it), and a producer refuses a larger frame at once: the
worker would only answer PayloadTooLarge, after a job's records and a round trip."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys
from ortq.errors import PayloadTooLarge
from ortq.producer import AsyncProducer, Producer
from ortq.settings import Settings
from tests.test_worker_inprocess import Serving, make_worker

WORKER_LIMIT = 4096  # bytes: a 1x4 float32 request is ~150, 1,000 rows ~16,000


@pytest.fixture
def serving(tiny_path: Path, model_name: str, redis_url: str) -> Iterator[Serving]:
    settings = Settings.from_url(redis_url, heartbeat_seconds=0.5, max_frame_bytes=WORKER_LIMIT)
    running = Serving(make_worker(tiny_path, model_name, settings))
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        producer.wait_for_workers(model_name, 1, timeout=60)
    yield running
    assert running.stop() == 0


def test_the_signature_record_names_the_workers_limit(
    serving: Serving, connection: redis.Redis, model_name: str
) -> None:
    for key in (
        keys.signature_key(model_name),
        keys.signature_key(model_name, serving.worker.presence.identity.version),
    ):
        record = json.loads(connection.get(key) or b"{}")
        assert record["max_frame_bytes"] == WORKER_LIMIT, key


def test_a_producer_refuses_a_frame_over_the_workers_limit_and_sends_what_fits(
    serving: Serving, connection: redis.Redis, tiny_path: Path, model_name: str, redis_url: str
) -> None:
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    large = np.zeros((1000, 4), np.float32)  # ~16 KB: under the producer's own limit, over the worker's
    small = np.arange(8, dtype=np.float32).reshape(2, 4)
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        with pytest.raises(PayloadTooLarge, match=f"max_frame_bytes \\({WORKER_LIMIT},"):
            producer.submit(model_name, {"x": large})
        assert connection.llen(keys.queue_key(model_name)) == 0  # nothing enqueued
        outputs = producer.infer(model_name, {"x": small}, timeout=30)
    np.testing.assert_array_equal(outputs["y"], session.run(None, {"x": small})[0])


def test_the_async_producer_refuses_it_too(
    serving: Serving, connection: redis.Redis, model_name: str, redis_url: str
) -> None:
    async def submit() -> None:
        async with AsyncProducer(settings=Settings.from_url(redis_url)) as producer:
            with pytest.raises(PayloadTooLarge, match=f"max_frame_bytes \\({WORKER_LIMIT},"):
                await producer.submit(model_name, {"x": np.zeros((1000, 4), np.float32)})

    asyncio.run(submit())  # as tests/test_async_producer.py: no plugin
    assert connection.llen(keys.queue_key(model_name)) == 0

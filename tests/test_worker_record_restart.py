"""A serving worker's RQ record made whole again after it was lost (issue 35: after Redis restarted
empty, a worker showed state ``?`` in ``ortq info`` and ``rq info`` for minutes while it served).

Deleting the worker's hash is what an empty restart does to it. Two ways back: the heartbeat's own
HSET makes the hash again (the worker idle), or a start script's HSET of ``state`` makes a hash
of two fields first (a job arrives before the next beat). Either way the next heartbeat must write
the whole record: RQ's birth fields and the worker's state."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis
import rq

from ortq import info
from ortq.producer import Producer
from ortq.rqcompat import layout
from ortq.settings import Settings
from tests.test_worker_inprocess import Serving, make_worker

BEATS_WITHOUT_REPAIR = 6  # heartbeats seen after the loss, the record still not whole: a failure


@pytest.fixture
def serving(tiny_path: Path, model_name: str, redis_url: str) -> Iterator[Serving]:
    settings = Settings.from_url(redis_url, heartbeat_seconds=0.3)
    running = Serving(make_worker(tiny_path, model_name, settings))
    with Producer(settings=settings) as producer:
        producer.wait_for_workers(model_name, 1, timeout=60)
    yield running
    assert running.stop() == 0


def _whole(fields: dict[bytes, bytes]) -> bool:
    return b"birth" in fields and fields.get(b"state") == b"idle" and b"queues" in fields


def _wait_for(connection: redis.Redis, key: str, whole: Callable[[dict[bytes, bytes]], bool]) -> dict[bytes, bytes]:
    """The worker's hash once ``whole``; fails once the worker has beaten BEATS_WITHOUT_REPAIR times
    since without making it so (each beat writes a new ``last_heartbeat``): no clock decides."""
    beats: set[bytes] = set()
    while True:
        fields = connection.hgetall(key)
        if whole(fields):
            return fields
        if beat := fields.get(b"last_heartbeat"):
            beats.add(beat)
        assert len(beats) < BEATS_WITHOUT_REPAIR, f"{key} after {len(beats)} heartbeats: {fields!r}"
        time.sleep(0.05)  # a poll's pace, not a budget: what ends the wait is the heartbeats seen


def test_an_idle_workers_lost_record_is_written_whole_by_its_next_heartbeat(
    serving: Serving, connection: redis.Redis
) -> None:
    key = layout.worker_key(serving.worker.name)
    assert _whole(connection.hgetall(key))
    connection.delete(key)
    fields = _wait_for(connection, key, _whole)
    assert fields[b"queues"].decode() == serving.worker.presence.queue_name
    # RQ's own reading, and ortq info's, show the state again.
    found = rq.Worker.find_by_key(key, connection=connection)
    assert found is not None and found.get_state() == "idle"
    shown_workers = [w for m in info.collect(connection)["models"] for w in m["workers"]]
    (shown,) = [w for w in shown_workers if w["name"] == serving.worker.name]
    assert shown["rq_state"] == "idle", shown


def test_a_record_a_start_made_again_is_written_whole_by_the_next_heartbeat(
    serving: Serving, connection: redis.Redis, tiny_path: Path, model_name: str, redis_url: str
) -> None:
    key = layout.worker_key(serving.worker.name)
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    connection.delete(key)
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        outputs = producer.infer(model_name, {"x": x}, timeout=30)  # its start writes state to a new hash
    np.testing.assert_array_equal(outputs["y"], session.run(None, {"x": x})[0])
    fields = _wait_for(connection, key, _whole)
    assert fields[b"queues"].decode() == serving.worker.presence.queue_name

"""Priorities: high-priority jobs run before every normal one, first come first served among
themselves, in the model's one RQ queue."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import redis
from rq.job import Job

from ortq import keys
from ortq.errors import ConfigurationError
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.serializer import MsgpackSerializer
from ortq.settings import Settings
from tests.conftest import WorkerProcesses


def test_high_priority_jobs_jump_the_queue_in_fifo_order(
    workers: WorkerProcesses, producer: Producer, connection: redis.Redis, model_name: str, tiny_path: Path
) -> None:
    producer = Producer(settings=producer.settings, allow_unknown_models=True)  # before any worker starts
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    # Enqueued before any worker runs: what the worker does is decided by the queue's order alone.
    normal = producer.submit_many(model_name, [{"x": x + i} for i in range(4)])
    high_a = producer.submit(model_name, {"x": x + 100}, priority="high")
    more_normal = producer.submit(model_name, {"x": x + 4})
    high_b = producer.submit_many(model_name, [{"x": x + 101}, {"x": x + 102}], priority="high")
    expected = [high_a, *high_b, *normal, more_normal]
    queued = [keys.as_text(i) for i in connection.lrange(keys.queue_key(model_name), 0, -1)]
    assert queued == [job.id for job in expected]

    workers.serve(tiny_path, model_name, producer.settings.redis_url)
    results = producer.results(expected, timeout=30)
    for job, result in zip(expected, results, strict=True):
        assert result["y"].shape == (1, 4)
        assert job.status() == "finished"
    # The order they really ran in: RQ's started_at of each job (one worker, no batching).
    started = [Job.fetch(j.id, connection=connection, serializer=MsgpackSerializer).started_at for j in expected]
    assert started == sorted(started)
    assert results[0]["y"].tolist() == (2 * (x + 100) + 1).tolist()


def test_a_high_job_after_the_last_high_one_ran_goes_to_the_head(
    producer: Producer, connection: redis.Redis, model_name: str
) -> None:
    producer = Producer(settings=producer.settings, allow_unknown_models=True)  # before any worker starts
    x = np.ones((1, 4), np.float32)
    first = producer.submit(model_name, {"x": x}, priority="high")
    normal = producer.submit(model_name, {"x": x})
    # As if a worker took the first high job: the next high one must still go before `normal`.
    connection.lrem(keys.queue_key(model_name), 0, first.id)
    second = producer.submit(model_name, {"x": x}, priority="high")
    queued = [keys.as_text(i) for i in connection.lrange(keys.queue_key(model_name), 0, -1)]
    assert queued == [second.id, normal.id]


def test_an_unknown_priority_is_refused(producer: Producer, model_name: str) -> None:
    with pytest.raises(ConfigurationError, match="priority"):
        producer.submit(model_name, {"x": np.ones((1, 4), np.float32)}, priority="urgent")


def test_high_priority_on_a_redis_without_fcall(tiny_path: Path, tmp_path: Path) -> None:
    """Redis before 7.0 has no FCALL: it discards the whole MULTI (EXECABORT), and the producer
    sends it again with EVAL in the FCALL's place (here a Redis 7 with FCALL renamed away)."""
    with LocalRedis(extra_args=("--rename-command", "FCALL", "")) as server:
        group = WorkerProcesses(tmp_path)
        try:
            group.serve(tiny_path, "no-fcall", server.url)
            with Producer(settings=Settings.from_url(server.url)) as producer:
                jobs = [
                    producer.submit("no-fcall", {"x": np.full((1, 4), i, np.float32)}, priority="high")
                    for i in range(3)
                ]
                for i, job in enumerate(jobs):
                    np.testing.assert_array_equal(job.result(timeout=30)["y"], np.full((1, 4), 2 * i + 1, np.float32))
        finally:
            group.stop_all()

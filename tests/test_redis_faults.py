"""Redis going away: workers reconnect and go on, nothing acknowledged is lost, producers get a
clear error instead of hanging. Each test has a durable redis-server of its own (AOF fsynced on
every write, as docs/reliability.md asks of a production Redis) and restarts it."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortq.errors import BrokerUnavailable
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests import onnx_models
from tests.conftest import WorkerProcesses


@pytest.fixture
def durable_redis() -> Iterator[LocalRedis]:
    with LocalRedis(durable=True) as server:
        yield server


def _direct(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def test_workers_ride_out_a_redis_restart_under_load(
    workers: WorkerProcesses, durable_redis: LocalRedis, model_name: str, tiny_path: Path
) -> None:
    url = durable_redis.url
    workers.serve(tiny_path, model_name, url, 2, "--max-batch", "4", "--rows-independent")
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal((2, 4)).astype(np.float32) for _ in range(200)]
    with Producer(settings=Settings.from_url(url)) as producer:
        before = producer.submit_many(model_name, [{"x": x} for x in inputs[:150]])
        durable_redis.restart(down_for=2.0)
        after = producer.submit_many(model_name, [{"x": x} for x in inputs[150:]])
        results = producer.results(before + after, timeout=120)
        for x, result in zip(inputs, results, strict=True):
            np.testing.assert_allclose(result["y"], _direct(tiny_path, x), rtol=1e-6)
        assert [process.poll() for process, _ in workers.processes] == [None, None], workers.logs()
        assert len(producer.workers(model_name)) == 2  # both published their records again
    assert "Redis unavailable" in workers.logs()


def test_a_result_computed_while_redis_is_down_is_delivered(
    workers: WorkerProcesses, durable_redis: LocalRedis, model_name: str, models_dir: Path
) -> None:
    slow = onnx_models.slow_model(models_dir / "slow-faults.onnx", 3 * onnx_models.SLOW_MODEL_LOOPS)
    url = durable_redis.url
    workers.serve(slow, model_name, url)
    x = np.full((1, 256), 0.01, np.float32)
    with Producer(settings=Settings.from_url(url)) as producer:
        job = producer.submit(model_name, {"x": x})
        producer.wait_for_workers(model_name)
        # Down while the run goes on: the worker holds the outputs until Redis is back.
        durable_redis.restart(down_for=3.0)
        outputs = job.result(timeout=60)
        np.testing.assert_allclose(outputs["y"], _direct(slow, x), rtol=1e-5, atol=1e-6)
        assert job.status() == "finished"


@pytest.mark.timeout(60)
def test_producers_get_a_clear_error_when_redis_is_gone(durable_redis: LocalRedis, model_name: str) -> None:
    producer = Producer(settings=Settings.from_url(durable_redis.url), validate=False, allow_unknown_models=True)
    job = producer.submit(model_name, {"x": np.ones((1, 4), np.float32)})
    durable_redis.stop()
    with pytest.raises(BrokerUnavailable, match="could not enqueue"):
        producer.submit(model_name, {"x": np.ones((1, 4), np.float32)})
    with pytest.raises(BrokerUnavailable, match="no result for job"):
        job.result(timeout=2)
    with pytest.raises(BrokerUnavailable, match="had no result"):
        producer.results([job], timeout=2)
    with pytest.raises(BrokerUnavailable, match="unavailable"):
        Producer(settings=Settings.from_url(durable_redis.url))
    info = subprocess.run([sys.executable, "-m", "ortq", "info", "--redis-url", durable_redis.url],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert info.returncode == 1 and "Redis unavailable" in info.stderr and "Traceback" not in info.stderr, info.stderr


def test_a_primary_that_refuses_writes_is_an_outage_the_worker_backs_off_from(
    workers: WorkerProcesses, model_name: str, tiny_path: Path, tmp_path: Path
) -> None:
    """NOREPLICAS (``min-replicas-to-write`` with no replica: what a primary says during a failover,
    docs/ha.md) refuses the worker's BLMOVE: the worker waits and retries with a backoff, as for an
    unreachable Redis, instead of retrying at once in a loop, and serves again once writes are allowed.
    The test reads the backoff from the worker's log (three refusals, each saying how long it waits,
    each logged at least that long after the one before), not from how many fit in a fixed sleep."""
    from datetime import datetime

    import redis

    from tests.conftest import wait_for_process

    refusal = re.compile(
        r"^(\S+ \S+) \S+ ERROR Redis unavailable \(Redis refused the take: NOREPLICAS[^\n]*\); retrying in ([\d.]+) s$",
        re.MULTILINE,
    )
    with LocalRedis() as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        workers.serve(tiny_path, model_name, url)
        admin = redis.Redis(port=server.port)
        admin.config_set("min-replicas-to-write", 1)
        ((process, log_path),) = workers.processes
        wait_for_process(process, log_path, "three NOREPLICAS refusals in the worker's log",
                         lambda: len(refusal.findall(log_path.read_text(errors="replace"))) >= 3)  # fmt: skip
        admin.config_set("min-replicas-to-write", 0)
        found = refusal.findall(workers.logs())
        waits = [float(wait) for _, wait in found]
        assert waits[:3] == [0.5, 1.0, 2.0], found  # doubling, up to 5 s
        assert all(wait <= 5.0 for wait in waits), found
        # Each refusal came no sooner than the wait the one before announced (asctime's milliseconds):
        # a lower bound only, which no load can break; a retry loop without the wait fails it.
        moments = [datetime.strptime(moment, "%Y-%m-%d %H:%M:%S,%f") for moment, _ in found[:3]]
        for step in (0, 1):
            assert (moments[step + 1] - moments[step]).total_seconds() >= waits[step] - 0.01, found
        x = np.ones((1, 4), np.float32)
        with Producer(settings=Settings.from_url(url)) as producer:
            expected = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            np.testing.assert_array_equal(producer.infer(model_name, {"x": x}, timeout=30)["y"], expected)

"""Scale to zero and back, with real processes (docs/autoscaling.md, "Scale to zero"): jobs go in
while no worker runs, a worker started afterwards answers them with the outputs of a direct
``session.run``, and a job a SIGKILLed worker left ``started`` is answered once a new worker starts.
At each step the test reads what KEDA's two triggers would read (the script of tests/test_keda.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys
from ortq.errors import InvalidInput, UnknownModel
from ortq.info import GONE, collect
from ortq.producer import Producer
from ortq.rqcompat import layout
from ortq.settings import Settings
from tests import onnx_models
from tests.conftest import WorkerProcesses, answers_of, eventually
from tests.test_keda import KEDA_SCRIPT


def triggers(connection: redis.Redis, model: str) -> tuple[int, int]:
    """(pending, running) as KEDA's two redis triggers of deploy/k8s/keda-scaledobject.yaml read them."""
    started = layout.QueueKeys.of(keys.queue_name(model)).started
    pending = int(connection.eval(KEDA_SCRIPT, 1, keys.queue_key(model)))  # type: ignore[arg-type]
    running = int(connection.eval(KEDA_SCRIPT, 1, started))  # type: ignore[arg-type]
    return pending, running


def inputs(count: int) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full((1, 4), float(i), np.float32)} for i in range(count)]


def test_jobs_for_a_model_never_served_wait_for_a_worker_started_later(
    workers: WorkerProcesses, tiny_path: Path, redis_url: str, connection: redis.Redis, model_name: str
) -> None:
    with Producer(settings=Settings.from_url(redis_url)) as strict, pytest.raises(UnknownModel):
        strict.submit(model_name, inputs(1)[0])  # the default: a mistyped name enqueues nothing
    assert triggers(connection, model_name) == (0, 0)
    with Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
        jobs = producer.submit_many(model_name, inputs(5))
        assert triggers(connection, model_name) == (5, 0)  # KEDA's pending trigger activates
        burst = workers.start(tiny_path, model_name, redis_url, "--burst")
        assert burst.wait(120) == 0, workers.logs()
        session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
        for job, x in zip(jobs, inputs(5), strict=True):
            np.testing.assert_array_equal(job.result(timeout=30)["y"], session.run(None, x)[0])
    assert triggers(connection, model_name) == (0, 0)  # back to zero


def test_a_model_whose_workers_all_left_still_takes_checked_jobs(
    workers: WorkerProcesses, tiny_path: Path, redis_url: str, connection: redis.Redis, model_name: str
) -> None:
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    workers.serve(tiny_path, model_name, redis_url)
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        x = inputs(1)[0]
        np.testing.assert_array_equal(producer.infer(model_name, x, timeout=30)["y"], session.run(None, x)[0])
        workers.stop_all()  # scaled to zero: the last worker unregistered
        assert producer.workers(model_name) == []
        ttl = connection.ttl(keys.signature_key(model_name))
        assert 0 < ttl <= Settings().request_ttl  # the signature outlives the workers by request_ttl
        with pytest.raises(InvalidInput):  # still checked against the signature, with no worker
            producer.submit(model_name, {"x": np.zeros((1, 5), np.float32)})
        jobs = producer.submit_many(model_name, inputs(3))  # no allow_unknown_models needed
        assert triggers(connection, model_name) == (3, 0)
        burst = workers.start(tiny_path, model_name, redis_url, "--burst")
        assert burst.wait(120) == 0, workers.logs()
        for job, x in zip(jobs, inputs(3), strict=True):
            np.testing.assert_array_equal(job.result(timeout=30)["y"], session.run(None, x)[0])


def kill_mid_job(
    workers: WorkerProcesses, model_path: Path, redis_url: str, connection: redis.Redis, producer: Producer, model: str
) -> tuple[str, dict[str, np.ndarray]]:
    """Serve ``model`` with one worker, submit a job, SIGKILL the worker while it runs it, and wait
    until its heartbeat is stale by ortq's rule (``ortq info`` shows it gone); returns the job id."""
    workers.serve(model_path, model, redis_url)
    x = {"x": np.ones((1, 256), np.float32)}
    job = producer.submit(model, x)
    eventually(lambda: job.status() == "started", timeout=60)
    victim = connection.hget(keys.job_key(job.id), "worker_name")
    assert victim is not None
    record = json.loads(connection.get(keys.worker_key(victim.decode())) or b"{}")
    os.kill(record["pid"], signal.SIGKILL)
    assert triggers(connection, model) == (0, 1)  # no worker: only the running trigger keeps KEDA active

    def gone() -> bool:
        [entry] = [m for m in collect(connection, 1.0)["models"] if m["model"] == model]
        return all(w["state"] == GONE for w in entry["workers"])

    eventually(gone, timeout=60)
    return job.id, x


def test_a_job_a_killed_worker_left_started_is_answered_by_the_next_worker(
    workers: WorkerProcesses, models_dir: Path, redis_url: str, connection: redis.Redis, producer: Producer,
    model_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "1")  # dead after 3 s without a heartbeat
    slow = onnx_models.timed_slow_model(models_dir / "scale-slow.onnx", 3.0)
    job_id, x = kill_mid_job(workers, slow, redis_url, connection, producer, model_name)
    workers.start(slow, model_name, redis_url)  # what the ScaledObject starts: a long-running worker
    outputs = producer.job(job_id, model_name).result(timeout=120)
    session = ort.InferenceSession(str(slow), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(outputs["y"], session.run(None, x)[0], rtol=1e-5)
    assert connection.hget(keys.job_key(job_id), "ortq_recoveries") == b"1"
    assert len(answers_of(connection, model_name, job_id)) == 1  # answered once
    eventually(lambda: triggers(connection, model_name) == (0, 0))


def test_a_burst_worker_takes_back_a_dead_workers_job_before_it_exits(
    workers: WorkerProcesses, models_dir: Path, redis_url: str, connection: redis.Redis, producer: Producer,
    model_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """What a ScaledJob's next pod (``ortq worker --burst``) does with such a job."""
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "1")
    slow = onnx_models.timed_slow_model(models_dir / "scale-slow-burst.onnx", 3.0)
    job_id, x = kill_mid_job(workers, slow, redis_url, connection, producer, model_name)
    started = time.monotonic()
    burst = workers.start(slow, model_name, redis_url, "--burst")
    assert burst.wait(180) == 0, workers.logs()
    status = producer.job(job_id, model_name).status()
    assert status == "finished", (
        f"the burst worker exited after {time.monotonic() - started:.1f} s leaving the job {status}:\n{workers.logs()}"
    )
    session = ort.InferenceSession(str(slow), providers=["CPUExecutionProvider"])
    outputs = producer.job(job_id, model_name).result(timeout=10)
    np.testing.assert_allclose(outputs["y"], session.run(None, x)[0], rtol=1e-5)

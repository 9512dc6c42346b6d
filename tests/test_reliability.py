"""Reliability and security that is in place so far: no unpickling anywhere ortq reads Redis,
and job timeouts that really stop a native ``session.run``."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys
from ortq.errors import InferenceFailed, PayloadTooLarge, QueueFull
from ortq.producer import Producer
from ortq.producer.enqueue import JobOptions, add_enqueue
from ortq.rqcompat import layout
from ortq.rqcompat.layout import QueueKeys
from ortq.serializer import MsgpackSerializer
from ortq.settings import Settings
from ortq.wire import encode_request
from tests import onnx_models
from tests.conftest import REPO, WorkerProcesses, answers_of, eventually

BAN = Path(__file__).parent / "pickle_ban"


@pytest.fixture(scope="module")
def slower_path(models_dir: Path) -> Path:
    """A model whose one single-threaded run takes about 3 s on this machine."""
    return onnx_models.timed_slow_model(models_dir / "slower.onnx", 3.0)


def test_nothing_is_unpickled_in_a_full_run(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    trap = tmp_path / "trap.log"
    # Subprocesses (workers, the CLI) load the ban through sitecustomize; this process patches it in.
    monkeypatch.setenv("PYTHONPATH", f"{BAN}:{REPO}")
    monkeypatch.setenv("ORTQ_PICKLE_TRAP", str(trap))

    def refuse(*args: object, **kwargs: object) -> None:
        trap.write_text("pickle used in the test process\n")
        raise RuntimeError("unpickling is banned in this test")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    workers.serve(tiny_path, model_name, redis_url, 1, "--max-batch", "4", "--rows-independent")
    producer = Producer(settings=Settings.from_url(redis_url), validate=False)
    x = np.ones((2, 4), np.float32)
    good = producer.submit_many(model_name, [{"x": x}] * 5)
    bad = producer.submit(model_name, {"x": np.ones((2, 3), np.float32)})
    # A job hash as an attacker would write it: pickled data naming a callable (in the same MULTI
    # as its enqueue, so that no worker sees the job before its data is replaced).
    pickled = b"\x80\x04\x95" + MsgpackSerializer.dumps(["os.system"])
    with producer.connection.pipeline() as pipe:
        options = JobOptions(60, 60, 60, reply=producer.reply_name)
        forged_id = add_enqueue(pipe, model_name, encode_request({"x": x}), options)
        pipe.hset(keys.job_key(forged_id), "data", pickled)
        pipe.execute()
    for outputs in producer.results(good, timeout=30):
        np.testing.assert_array_equal(outputs["y"], x * 2 + 1)
    with pytest.raises(InferenceFailed, match="InvalidInput"):
        bad.result(timeout=30)
    with pytest.raises(InferenceFailed, match="UnknownJobFunction"):
        producer.job(forged_id, model_name).result(timeout=30)
    info = subprocess.run([sys.executable, "-m", "ortq", "info", "--redis-url", redis_url], check=False,
                          capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert info.returncode == 0, info.stderr
    assert any(line.startswith(model_name + " ") for line in info.stdout.splitlines()), info.stdout
    np.save(tmp_path / "x.npy", x)
    command = [sys.executable, "-m", "ortq", "infer", model_name, "--input", f"x={tmp_path / 'x.npy'}",
               "--redis-url", redis_url]  # fmt: skip
    infer = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert infer.returncode == 0, infer.stderr
    assert all(p.poll() is None for p, _ in workers.processes), workers.logs()
    assert not trap.exists(), trap.read_text()
    # The ban is real: the trap fires where pickle is used.
    probe = subprocess.run([sys.executable, "-c", "import pickle; pickle.loads(pickle.dumps(1))"], check=False,
                           capture_output=True, text=True)  # fmt: skip
    assert probe.returncode != 0 and trap.exists()


def test_job_timeout_stops_a_running_session_run(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, slower_path: Path
) -> None:
    workers.serve(slower_path, model_name, redis_url)
    x = {"x": np.ones((1, 256), np.float32)}
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # as the worker runs it (--threads 1)
    session = ort.InferenceSession(str(slower_path), options, providers=["CPUExecutionProvider"])
    started = time.perf_counter()
    session.run(None, x)
    unstopped = time.perf_counter() - started
    assert unstopped > 1.5  # the model really outlasts the timeout
    started = time.perf_counter()
    job = producer.submit(model_name, x, job_timeout=1)
    response = producer.wait_response(job.id, job.model, 60, job.proof)
    # Stopped near the timeout, not when the run would have ended by itself.
    assert time.perf_counter() - started < unstopped
    assert response.error is not None and response.error.type == "JobTimeout", response
    assert "timeout of 1 s" in response.error.message
    assert job.status() == "failed"
    ok = producer.infer(model_name, x, timeout=60)
    assert ok["y"].shape == (1, 256)


def test_a_job_past_its_ttl_fails_with_a_reason(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    producer = Producer(settings=producer.settings, allow_unknown_models=True)  # before any worker starts
    late = producer.submit(model_name, {"x": np.ones((1, 4), np.float32)}, ttl=1)
    time.sleep(1.5)  # no worker yet: the job outlives its ttl in the queue
    workers.serve(tiny_path, model_name, redis_url)
    with pytest.raises(InferenceFailed) as caught:
        late.result(timeout=30)
    assert caught.value.remote_type == "RequestExpired"
    assert late.status() == "failed"
    fresh = producer.submit(model_name, {"x": np.ones((1, 4), np.float32)}, ttl=30)
    np.testing.assert_array_equal(fresh.result(timeout=30)["y"], np.full((1, 4), 3, np.float32))


def test_backpressure_and_payload_limits(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, monkeypatch: pytest.MonkeyPatch,
    connection: redis.Redis,
) -> None:  # fmt: skip
    bounded = Producer(settings=Settings.from_url(redis_url, max_queue_length=3), allow_unknown_models=True)
    x = {"x": np.ones((1, 4), np.float32)}
    bounded.submit_many(model_name, [x, x])
    with pytest.raises(QueueFull, match="holds 2 jobs; 2 more would pass max_queue_length"):
        bounded.submit_many(model_name, [x, x])
    assert connection.llen(keys.queue_key(model_name)) == 2  # nothing of the refused batch went in
    small = Producer(settings=Settings.from_url(redis_url, max_frame_bytes=200), allow_unknown_models=True)
    with pytest.raises(PayloadTooLarge):
        small.submit(model_name, {"x": np.ones((50, 4), np.float32)})
    # The worker's own limit, checked before decoding: a frame over it fails that job alone.
    monkeypatch.setenv("ORTQ_MAX_FRAME_BYTES", "1000")
    workers.serve(tiny_path, model_name, redis_url)
    # A producer reads that limit in the signature record and refuses the frame itself...
    with pytest.raises(PayloadTooLarge, match="max_frame_bytes \\(1000,"):
        Producer(settings=Settings.from_url(redis_url)).submit(model_name, {"x": np.ones((100, 4), np.float32)})
    # ... and one that does not read it (validate=False: no signature) gets the worker's answer.
    unchecked = Producer(settings=Settings.from_url(redis_url), validate=False)
    big = unchecked.submit(model_name, {"x": np.ones((100, 4), np.float32)})
    with pytest.raises(InferenceFailed) as caught:
        big.result(timeout=30)
    assert caught.value.remote_type == "PayloadTooLarge"
    np.testing.assert_array_equal(bounded.infer(model_name, x, timeout=30)["y"], np.full((1, 4), 3, np.float32))


def test_the_heartbeat_goes_on_during_a_long_run(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, slower_path: Path,
    connection: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "0.5")
    workers.serve(slower_path, model_name, redis_url)
    job = producer.submit(model_name, {"x": np.ones((1, 256), np.float32)})
    wip = f"rq:wip:{keys.queue_name(model_name)}"
    deadline = time.monotonic() + 30
    while not connection.zcard(wip) and time.monotonic() < deadline:
        time.sleep(0.02)
    [(entry, first_score)] = connection.zrange(wip, 0, -1, withscores=True)
    first_beat = connection.hget(keys.job_key(job.id), "last_heartbeat")
    time.sleep(1.6)  # the run takes seconds; the pulse beats every 0.5 s meanwhile
    assert job.status() == "started"
    assert connection.zscore(wip, entry) > first_score  # type: ignore[operator]
    assert connection.hget(keys.job_key(job.id), "last_heartbeat") != first_beat
    assert job.result(timeout=60)["y"].shape == (1, 256)


@pytest.mark.parametrize("executions", ["1", "0"], ids=["rq-executions", "no-rq-executions"])
def test_a_job_whose_worker_is_killed_is_taken_back_and_answered_once(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, slower_path: Path,
    connection: redis.Redis, monkeypatch: pytest.MonkeyPatch, executions: str,
) -> None:  # fmt: skip
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "1")
    # Without RQ's execution hashes, the survivor finds the dead worker by the tag in the job's
    # execution id (Book.abandoned).
    monkeypatch.setenv("ORTQ_RQ_EXECUTIONS", executions)
    workers.serve(slower_path, model_name, redis_url, 2)
    x = {"x": np.ones((1, 256), np.float32)}
    job = producer.submit(model_name, x)
    deadline = time.monotonic() + 30
    while job.status() != "started" and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = connection.hget(keys.job_key(job.id), "worker_name")
    assert victim is not None
    [entry] = connection.zrange(QueueKeys.of(keys.queue_name(model_name)).started, 0, -1)
    # RQ's execution hash comes at the worker's first heartbeat after the start (executions.lua).
    execution_hash = layout.execution_key(*entry.decode().rsplit(":", 1))
    eventually(lambda: connection.exists(execution_hash) == int(executions), timeout=5)
    record = json.loads(connection.get(keys.worker_key(victim.decode())) or b"{}")
    killed_at = time.monotonic()
    os.kill(record["pid"], signal.SIGKILL)
    outputs = job.result(timeout=60)  # the survivor takes it back and runs it again
    assert time.monotonic() - killed_at < 30 + 10  # detected within 30 s (plus one run of the model)
    session = ort.InferenceSession(str(slower_path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(outputs["y"], session.run(None, x)[0], rtol=1e-5)
    assert connection.hget(keys.job_key(job.id), "ortq_recoveries") == b"1"
    assert connection.hget(keys.job_key(job.id), "worker_name") != victim
    assert len(answers_of(connection, job.model, job.id)) == 1  # answered once
    assert job.status() == "finished"


def test_a_busy_worker_takes_back_a_dead_workers_job_during_its_own_run(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, models_dir: Path,
    connection: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # Runs of several seconds each, heartbeats every second: a dead worker is seen after 3 s.
    longest = onnx_models.timed_slow_model(models_dir / "longest.onnx", 8.0)
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "1")
    workers.serve(longest, model_name, redis_url, 2)
    x = {"x": np.ones((1, 256), np.float32)}
    doomed, busy = producer.submit_many(model_name, [x, x])
    deadline = time.monotonic() + 30
    while {doomed.status(), busy.status()} != {"started"} and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = connection.hget(keys.job_key(doomed.id), "worker_name")
    record = json.loads(connection.get(keys.worker_key(keys.as_text(victim or b"?"))) or b"{}")
    os.kill(record["pid"], signal.SIGKILL)

    # The survivor is in the middle of its own long run, yet its heartbeat thread requeues the
    # dead worker's job (it used to wait until the survivor was idle again).
    # Requeued, it may at once be taken again by the survivor's feeder, which reads the next batch
    # while the main thread runs (ortq.worker.overlap): either way the victim no longer holds it.
    def held_by_victim() -> bool:
        return doomed.status() == "started" and connection.hget(keys.job_key(doomed.id), "worker_name") == victim

    deadline = time.monotonic() + 30
    while held_by_victim() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not held_by_victim() and doomed.status() in ("queued", "started")
    assert busy.status() == "started", "the survivor finished its run before taking the job back"
    assert connection.hget(keys.job_key(doomed.id), "ortq_recoveries") == b"1"


def test_a_failing_run_is_retried_with_backoff_then_fails(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, models_dir: Path,
    connection: redis.Redis,
) -> None:  # fmt: skip
    workers.serve(onnx_models.gather_model(models_dir / "gather.onnx"), model_name, redis_url)
    started = time.monotonic()
    job = producer.submit(model_name, {"idx": np.array([7])}, retries=2, retry_backoff=1)
    with pytest.raises(InferenceFailed) as caught:
        job.result(timeout=60)
    # Three runs, one and then two seconds apart: only the last failure is answered.
    assert time.monotonic() - started >= 3
    assert caught.value.remote_type not in ("InvalidInput", "WireFormatError")
    assert connection.hget(keys.job_key(job.id), "retries_left") == b"0"
    assert job.status() == "failed"
    # Bad input is never retried: it would fail the same way.
    unchecked = Producer(settings=Settings.from_url(redis_url), validate=False)
    bad = unchecked.submit(model_name, {"idx": np.array([0.5])}, retries=3)
    with pytest.raises(InferenceFailed, match="InvalidInput"):
        bad.result(timeout=30)
    assert connection.hget(keys.job_key(bad.id), "retries_left") == b"3"
    good = producer.infer(model_name, {"idx": np.array([3, 1])}, timeout=30)
    np.testing.assert_array_equal(good["y"], [40.0, 20.0])  # gather_model's table: 10, 20, 30, 40

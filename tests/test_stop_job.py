"""Stopping a running job (ortq/worker/stops.py): ``job.cancel()`` of a started job, or RQ's
stop-job command, ends its run (RunOptions.terminate) within a heartbeat; the job fails with
JobStopped, RQ's status ``stopped``, and the worker goes on serving. Real Redis, real workers."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis
from rq.command import send_stop_job_command

from ortq import keys, redisfunctions
from ortq.errors import InferenceFailed
from ortq.producer import AsyncProducer, Producer, cancelling
from ortq.rqcompat import layout
from ortq.serializer import MsgpackSerializer
from ortq.settings import Settings
from tests import onnx_models
from tests.conftest import WorkerProcesses, eventually

pytestmark = pytest.mark.timeout(180)

RUN_SECONDS = 12.0  # far longer than a stop takes: a stop that is not honoured fails the test's timeout


@pytest.fixture(scope="module")
def slow_path(models_dir: Path) -> Path:
    return onnx_models.timed_slow_model(models_dir / "slow-stop.onnx", RUN_SECONDS)


def _wait_started(producer: Producer, job_id: str, model: str) -> None:
    eventually(lambda: producer.job(job_id, model).status() == "started", 30)


@pytest.mark.parametrize("how", ["cancel", "rq-stop-job-command"])
def test_a_running_job_is_stopped_and_the_worker_serves_on(
    how: str,
    slow_path: Path,
    tiny_path: Path,
    model_name: str,
    redis_url: str,
    connection: redis.Redis,
    workers: WorkerProcesses,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "0.5")
    workers.serve(slow_path, model_name, redis_url)
    x = np.ones((1, 256), np.float32)
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        job = producer.submit(model_name, {"x": x})
        behind = producer.submit(model_name, {"x": x * 0})
        _wait_started(producer, job.id, model_name)
        began = time.monotonic()
        if how == "cancel":
            assert job.cancel() is True
        else:  # an operator's, with RQ's own function
            send_stop_job_command(connection, job.id, serializer=MsgpackSerializer)
        with pytest.raises(InferenceFailed, match="JobStopped") as stopped:
            job.result(timeout=RUN_SECONDS)
        assert time.monotonic() - began < RUN_SECONDS / 2, "the run was not stopped: it ran to its end"
        assert "while it ran" in str(stopped.value)
        assert job.status() == "stopped"
        queue = layout.QueueKeys.of(keys.queue_name(model_name))
        assert connection.zscore(queue.failed, job.id) is not None  # where RQ keeps stopped jobs
        assert job.cancel() is False  # it ended: nothing to take off or stop
        # The job behind it runs to its end, as a direct session.run computes it.
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        expected = ort.InferenceSession(str(slow_path), options, providers=["CPUExecutionProvider"]).run(
            None, {"x": x * 0}
        )[0]
        np.testing.assert_array_equal(behind.result(timeout=RUN_SECONDS * 4)["y"], expected)
        assert behind.status() == "finished"
    # A stop the user asked for leaves no native noise in the worker's log: ONNX Runtime's raw,
    # coloured "terminate flag" ERROR line (its run logger is set to FATAL).
    assert "terminate" not in workers.logs() and "\x1b[" not in workers.logs(), workers.logs()[-3000:]


@pytest.mark.parametrize("how", ["cancel", "its token by a plain HSET"])
def test_a_stop_is_seen_between_heartbeats(
    how: str,
    slow_path: Path,
    model_name: str,
    redis_url: str,
    connection: redis.Redis,
    workers: WorkerProcesses,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The heartbeat thread reads the stop requests of long-held jobs every STOP_POLL_SECONDS, not
    only at its heartbeats: with heartbeats far apart (a minute: none falls within the run once it
    has begun), a cancelled run still ends long before its 12 s. What stops it is the job's stop
    token in its mark, whoever writes the field (here the producer itself, by a plain HSET): a mark
    of anything else stops nothing (tests/test_stop_binding.py)."""
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "60")
    workers.start(slow_path, model_name, redis_url)  # not serve: it waits for a heartbeat after the warm-up
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        producer.wait_for_workers(model_name)  # the record a worker publishes with its first heartbeat
        job = producer.submit(model_name, {"x": np.ones((1, 256), np.float32)})
        _wait_started(producer, job.id, model_name)
        began = time.monotonic()
        if how == "cancel":
            assert job.cancel() is True
        else:
            assert job.proof is not None
            connection.hset(keys.job_key(job.id), "ortq_stop", redisfunctions.stop_token(job.proof))
        with pytest.raises(InferenceFailed, match="JobStopped"):
            job.result(timeout=RUN_SECONDS)
        assert time.monotonic() - began < RUN_SECONDS / 2, "the stop waited for the run's end"


def test_a_stop_only_marks_a_started_job_of_its_own_model(
    tiny_path: Path, model_name: str, redis_url: str, connection: redis.Redis, workers: WorkerProcesses
) -> None:
    """The stop request writes nothing to a queued job (cancel takes that one off the queue), to one
    that ended, or to another model's job of that id; what it writes is the job's stop token."""
    with Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
        queued = producer.submit(model_name, {"x": np.ones((1, 4), np.float32)})
        assert queued.proof is not None
        stop = cancelling.request_stop
        assert producer._run(model_name, stop(queued.id, model_name, queued.proof)) is False
        assert connection.hget(keys.job_key(queued.id), "ortq_stop") is None
        connection.hset(keys.job_key(queued.id), "status", "started")  # as a worker's start writes it
        assert producer._run(model_name, stop(queued.id, f"{model_name}-other", queued.proof)) is False
        assert connection.hget(keys.job_key(queued.id), "ortq_stop") is None
        assert producer._run(model_name, stop(queued.id, model_name, queued.proof)) is True
        assert connection.hget(keys.job_key(queued.id), "ortq_stop") == redisfunctions.stop_token(queued.proof)
        assert producer._run(model_name, stop("no-such-job", model_name, queued.proof)) is False
        assert not connection.exists(keys.job_key("no-such-job"))


def test_the_async_producer_stops_a_running_job(
    slow_path: Path, model_name: str, redis_url: str, workers: WorkerProcesses, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "0.5")
    workers.serve(slow_path, model_name, redis_url)

    async def main() -> None:
        async with AsyncProducer(settings=Settings.from_url(redis_url)) as producer:
            job = await producer.submit(model_name, {"x": np.ones((1, 256), np.float32)})
            deadline = time.monotonic() + 30
            while await job.status() != "started" and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert await job.cancel() is True
            with pytest.raises(InferenceFailed, match="JobStopped"):
                await job.result(timeout=RUN_SECONDS / 2)
            assert await job.status() == "stopped"

    asyncio.run(main())


def test_stops_end_a_run_only_when_every_job_in_it_is_requested() -> None:
    """ortq.worker.stops on real RunOptions: a run is stopped once all of its jobs are requested
    (before it began or while it runs), never for a part of its jobs; ids not held are dropped."""
    from ortq.worker.stops import COMMANDED, Stops

    proofs = {job: hashlib.sha256(job.encode()).digest() for job in "abc"}
    stops = Stops()
    stops.request({"a": redisfunctions.stop_token(proofs["a"]), "elsewhere": COMMANDED}, held=["a", "b", "c"])
    assert stops.requested("a") and not stops.requested("elsewhere") and stops.any
    assert stops.applies("a", proofs["a"])
    options = ort.RunOptions()
    stops.run_began({"a": proofs["a"], "b": proofs["b"]}, options)
    assert not options.terminate  # b was not requested: the run goes on
    stops.request({"b": COMMANDED}, held=["a", "b", "c"])  # RQ's stop-job command
    assert options.terminate and stops.run_ended()
    requested_before = ort.RunOptions()
    stops.run_began({"b": proofs["b"]}, requested_before)
    assert requested_before.terminate and stops.run_ended()
    stops.request({}, held=["c"])  # a and b left the worker: forgotten
    assert not stops.any and not stops.run_ended()

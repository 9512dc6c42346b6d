"""What ortq's worker writes reads back through RQ's own APIs (registries, ``Job.fetch``,
``latest_result``, executions, ``Worker``), for the RQ series installed (tests/rqcontract compares
the records field by field). Marked ``rqcompat``: run under RQ 2.12 as well.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from rq import Queue, SimpleWorker
from rq.job import JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.results import Result

from ortq import keys
from ortq.producer import Producer
from ortq.rqcompat.layout import RQ_VERSION
from ortq.rqjob import OrtqJob
from ortq.serializer import MsgpackSerializer
from tests import onnx_models
from tests.conftest import WorkerProcesses, eventually
from tests.rqcontract.reference import PromptSimpleWorker

pytestmark = pytest.mark.rqcompat


def echo(value: int) -> dict[str, int]:
    """A plain RQ job for the reference run."""
    return {"value": value}


def nonempty_fields(connection: redis.Redis, key: str) -> set[str]:
    return {k.decode() for k, v in connection.hgetall(key).items() if v not in (b"", None)}


def result_fields(connection: redis.Redis, job_id: str) -> set[str]:
    [(_, entry)] = connection.xrange(f"rq:results:{job_id}")
    return {k.decode() for k in entry}


def test_finished_job_reads_back_through_rq(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path,
    connection: redis.Redis,
) -> None:  # fmt: skip
    workers.serve(tiny_path, model_name, redis_url)
    job = producer.submit(model_name, {"x": np.ones((1, 4), np.float32)})
    job.result(timeout=20)
    queue = keys.queue_name(model_name)
    eventually(lambda: job.id in FinishedJobRegistry(queue, connection=connection).get_job_ids())

    rq_job = OrtqJob.fetch(job.id, connection=connection, serializer=MsgpackSerializer)
    assert rq_job.get_status() == JobStatus.FINISHED
    assert rq_job.started_at is not None and rq_job.ended_at is not None
    assert rq_job.ended_at >= rq_job.started_at
    assert rq_job.worker_name and rq_job.worker_name.startswith(model_name + ".")
    assert rq_job.func_name == keys.JOB_FUNC and rq_job.args == [model_name]

    result = rq_job.latest_result()
    assert result is not None and result.type == Result.Type.SUCCESSFUL
    assert result.return_value["reply_key"] == keys.reply_key(model_name, producer.reply_name)  # its producer's stream
    assert result.return_value["outputs"] == {"y": ["float32", [1, 4]]}
    assert result.execution_id

    assert StartedJobRegistry(queue, connection=connection).get_job_ids() == []
    assert connection.zcard(f"rq:executions:{job.id}") == 0
    assert not connection.keys(f"rq:execution:{job.id}:*")
    assert 0 < connection.ttl(keys.job_key(job.id)) <= producer.settings.result_ttl
    [worker] = [w for w in SimpleWorker.all(connection=connection, serializer=MsgpackSerializer)
                if w.name == rq_job.worker_name]  # fmt: skip
    assert worker.successful_job_count == 1 and worker.get_state() == "idle"
    assert worker.get_current_job_id() is None


def test_a_running_job_is_started_in_rq(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, models_dir: Path,
    connection: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    slow = onnx_models.timed_slow_model(models_dir / "slow-3s.onnx", 3.0)
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "0.5")
    workers.serve(slow, model_name, redis_url)
    job = producer.submit(model_name, {"x": np.ones((1, 256), np.float32)})
    queue = keys.queue_name(model_name)
    eventually(lambda: job.status() == "started")
    assert StartedJobRegistry(queue, connection=connection).get_job_ids() == [job.id]
    # RQ's execution record of a run is written at the worker's first heartbeat after its start.
    fetched = OrtqJob.fetch(job.id, connection=connection, serializer=MsgpackSerializer)
    eventually(lambda: len(fetched.get_executions()) == 1, timeout=5)
    [execution] = fetched.get_executions()
    worker = SimpleWorker.find_by_key(f"rq:worker:{execution.worker_name}", connection=connection,
                                      serializer=MsgpackSerializer)  # fmt: skip
    assert worker is not None and worker.get_state() == "busy"
    assert worker.get_current_job_id() == job.id  # RQ 2: the worker hash; RQ 3: its executions
    job.result(timeout=60)
    eventually(lambda: StartedJobRegistry(queue, connection=connection).get_job_ids() == [])


def test_failed_job_reads_back_through_rq(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, connection: redis.Redis
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    unchecked = Producer(redis_url, validate=False)
    job = unchecked.submit(model_name, {"x": np.ones((1, 5), np.float32)})
    queue = keys.queue_name(model_name)
    eventually(lambda: job.id in FailedJobRegistry(queue, connection=connection).get_job_ids())
    rq_job = OrtqJob.fetch(job.id, connection=connection, serializer=MsgpackSerializer)
    assert rq_job.get_status() == JobStatus.FAILED
    result = rq_job.latest_result()
    assert result is not None and result.type == Result.Type.FAILED
    assert "InvalidInput" in (result.exc_string or "")
    assert StartedJobRegistry(queue, connection=connection).get_job_ids() == []


def test_same_fields_as_rq_own_worker(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path,
    connection: redis.Redis,
) -> None:  # fmt: skip
    # Reference: a job RQ enqueues and RQ's own SimpleWorker runs, with ortq's serializer.
    reference_queue = Queue(f"ref-{model_name}", connection=connection, serializer=MsgpackSerializer)
    reference = reference_queue.enqueue(echo, 3, result_ttl=600, failure_ttl=600)
    PromptSimpleWorker([reference_queue], connection=connection, serializer=MsgpackSerializer).work(burst=True)
    assert reference.get_status(refresh=True) == JobStatus.FINISHED

    workers.serve(tiny_path, model_name, redis_url)
    job = producer.submit(model_name, {"x": np.ones((1, 4), np.float32)})
    job.result(timeout=20)
    eventually(lambda: connection.exists(f"rq:results:{job.id}") == 1)
    time.sleep(0.1)

    # ortq's own fields besides RQ's: the reply stream its producer reads, and its answer's entry there.
    own = {"ortq_reply", "ortq_answer"}
    ours = nonempty_fields(connection, keys.job_key(job.id))
    assert own <= ours, ours
    assert connection.hget(keys.job_key(job.id), "ortq_reply") == producer.reply_name.encode()
    ours -= own
    # RQ's enqueue writes its default 180 s `timeout`; an ortq job has one only when given.
    theirs = nonempty_fields(connection, keys.job_key(reference.id)) - {"timeout"}
    assert ours == theirs, ours ^ theirs
    assert result_fields(connection, job.id) == result_fields(connection, reference.id)
    for registry in ("rq:finished:{}", "rq:wip:{}", "rq:failed:{}"):
        ours_in = connection.zscore(registry.format(keys.queue_name(model_name)), job.id) is not None
        theirs_in = connection.zscore(registry.format(reference_queue.name), reference.id) is not None
        assert ours_in == theirs_in, registry


def test_rq_info_counts_a_batched_workers_jobs(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path,
    connection: redis.Redis,
) -> None:  # fmt: skip
    """RQ's own monitor, ``rq info``, on jobs a batched worker answered (one start and one finish
    script a batch): the queue empty, the finished and failed counts (RQ 3 prints them), the
    worker idle on its queue."""
    workers.serve(tiny_path, model_name, redis_url, 1, "--max-batch", "8", "--rows-independent")
    jobs = producer.submit_many(model_name, [{"x": np.full((1, 4), i, np.float32)} for i in range(5)])
    failing = Producer(redis_url, validate=False).submit(model_name, {"x": np.ones((1, 5), np.float32)})
    for job in jobs:
        job.result(timeout=20)
    queue = keys.queue_name(model_name)
    eventually(lambda: failing.id in FailedJobRegistry(queue, connection=connection).get_job_ids())

    def rq_info(*options: str) -> str:
        command = [sys.executable, "-m", "rq.cli", "info", "--raw", "--url", redis_url, *options]
        command += ["--serializer", "ortq.serializer.MsgpackSerializer"]
        return subprocess.run(command, check=True, capture_output=True, text=True, timeout=60).stdout

    [line] = [line for line in rq_info("--only-queues").splitlines() if line.startswith(f"queue {queue} ")]
    assert line.split()[2].rstrip(",") == "0", line  # nothing left queued
    if RQ_VERSION >= (3, 0):  # RQ 2.12 prints the queue's length alone
        assert "0 executing, 5 finished, 1 failed" in line, line
    [worker] = [w for w in rq_info("--only-workers").splitlines() if w.startswith(f"worker {model_name}.")]
    assert " idle " in worker and queue in worker, worker
    if RQ_VERSION >= (3, 0):
        assert worker.endswith("jobs: 5 finished, 1 failed"), worker

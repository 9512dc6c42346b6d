"""Workers without RQ's execution records (``Settings.rq_executions`` off, ``ORTQ_RQ_EXECUTIONS=0``):
what the scripts and heartbeats then write, how the recovery of orphans still tells a live worker's
jobs from a dead one's (the worker's tag at the head of each execution id), and RQ's own tools on
such records. Marked rqcompat: run against both RQ series."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import redis
from rq import Queue, Worker
from rq.job import Job
from rq.registry import StartedJobRegistry

from ortq import keys, wire
from ortq.dashboard.app import create_app
from ortq.info import collect, format_info
from ortq.producer import Producer
from ortq.rqcompat import layout
from ortq.rqcompat.abandoned import TAG_DIGITS, execution_tag
from ortq.rqcompat.book import Book, Finished, StartedJob
from ortq.rqcompat.layout import utcformat, utcnow
from ortq.rqcompat.records import WorkerRecords
from ortq.settings import Settings
from tests import onnx_models
from tests.conftest import eventually
from tests.test_worker_inprocess import Serving, answers, make_worker, push, start

pytestmark = pytest.mark.rqcompat


def lean_worker(connection: redis.Redis, model_name: str) -> tuple[Book, WorkerRecords]:
    """A registered worker's scripts and records, with rq_executions off."""
    name = f"lean-{uuid.uuid4().hex[:8]}"
    records = WorkerRecords(name, keys.queue_name(model_name), executions=False)
    records.register_birth(connection)
    return Book(connection, name, keys.queue_name(model_name), executions=False), records


def execution_records(connection: redis.Redis, job: StartedJob, worker: str) -> list[int]:
    """Which of RQ's execution records of ``job`` exist: its hash, the job's executions, and its
    entry in RQ 3's index of the worker's executions."""
    composite = f"{job.job_id}:{job.execution_id}"
    return [
        connection.exists(layout.execution_key(job.job_id, job.execution_id)),
        connection.exists(f"{layout.PREFIX}:executions:{job.job_id}"),
        int(bool(connection.sismember(layout.worker_executions_key(worker), composite))),
    ]


@pytest.mark.parametrize("executions", [True, False])
def test_execution_records_are_written_only_when_asked_and_the_job_is_answered_either_way(
    connection: redis.Redis, model_name: str, executions: bool
) -> None:
    name = f"w-{uuid.uuid4().hex[:8]}"
    records = WorkerRecords(name, keys.queue_name(model_name), executions=executions)
    records.register_birth(connection)
    book = Book(connection, name, keys.queue_name(model_name), executions=executions)
    job_id = str(uuid.uuid4())
    push(connection, model_name, job_id)
    [job], _ = start(connection, book)
    assert job.execution_id.startswith(execution_tag(name)) and len(job.execution_id) == 32
    # None at the start: a worker writes them at its next heartbeat, for the jobs it still holds.
    assert execution_records(connection, job, name) == [0, 0, 0]
    assert connection.zscore(book.queue.started, f"{job_id}:{job.execution_id}") is not None

    written = [1, 1, 1 if layout.RQ3 else 0] if executions else [0, 0, 0]
    connection.zadd(book.queue.started, {f"{job_id}:{job.execution_id}": 1})
    for _ in range(2):  # the first heartbeat writes them, the next refreshes what there is
        with connection.pipeline(transaction=False) as pipe:
            positions = records.queue_heartbeat(pipe, [job])
            results = pipe.execute(raise_on_error=False)
        records.after_heartbeat(connection, results, positions, [job])
        assert book.record_executions([job]) == int(executions)
        assert connection.zscore(book.queue.started, f"{job_id}:{job.execution_id}") > 1  # type: ignore[operator]
        assert connection.exists(keys.job_key(job_id))  # not taken for a hash the heartbeat recreated
        assert execution_records(connection, job, name) == written

    response = wire.encode_response({"y": np.zeros((2, 4), np.float32)})
    assert book.finish([Finished(job, response, 60, None)]) == 1
    assert answers(connection, model_name, [job_id]) == {job_id: [response]}
    assert connection.hget(keys.job_key(job_id), "status") == b"finished"
    assert execution_records(connection, job, name) == [0, 0, 0]
    assert connection.zcard(book.queue.started) == 0
    # A heartbeat that still counted the job, its records written after the finish: none again.
    assert book.record_executions([job]) == 0
    assert execution_records(connection, job, name) == [0, 0, 0]


def test_a_heartbeat_deletes_a_job_hash_it_recreated_without_execution_records(
    connection: redis.Redis, model_name: str
) -> None:
    book, records = lean_worker(connection, model_name)
    job_id = str(uuid.uuid4())
    push(connection, model_name, job_id)
    [job], _ = start(connection, book)
    connection.delete(keys.job_key(job_id))  # expired or deleted while the job ran
    with connection.pipeline(transaction=False) as pipe:
        positions = records.queue_heartbeat(pipe, [job])
        results = pipe.execute(raise_on_error=False)
    records.after_heartbeat(connection, results, positions, [job])
    assert not connection.exists(keys.job_key(job_id))


def beat_at(connection: redis.Redis, records: WorkerRecords, seconds_ago: float) -> None:
    connection.hset(records.key, "last_heartbeat", utcformat(utcnow() - timedelta(seconds=seconds_ago)))


def test_the_recovery_finds_a_jobs_worker_by_the_tag_in_its_execution_id(
    connection: redis.Redis, model_name: str
) -> None:
    owner_book, owner = lean_worker(connection, model_name)
    other_book, _ = lean_worker(connection, model_name)
    job_id = str(uuid.uuid4())
    push(connection, model_name, job_id)
    [job], _ = start(connection, owner_book)
    taken = (job_id, job.execution_id, owner.name)

    # Its worker beats: no one else takes the job, whatever its records say.
    beat_at(connection, owner, 1)
    assert other_book.abandoned(dead_after=30, own=True) == []
    # Its own worker takes it back only when it no longer holds it (a start whose reply was lost).
    assert owner_book.abandoned(dead_after=30, own=True, held=frozenset({job.execution_id})) == []
    assert owner_book.abandoned(dead_after=30, own=True) == [taken]
    # Its worker's heartbeat stopped: the others take it back, naming it.
    beat_at(connection, owner, 60)
    assert other_book.abandoned(dead_after=30, own=False) == [taken]
    # Its worker's hash is gone too (expired): still that worker's job, dead.
    connection.delete(owner.key)
    assert other_book.abandoned(dead_after=30, own=False) == [taken]


def test_a_job_without_the_tag_of_a_registered_worker_is_owned_by_its_execution_hash_else_by_no_one(
    connection: redis.Redis, model_name: str
) -> None:
    """Jobs started by an ortq from before tags (random execution ids), during a rolling upgrade."""
    book, alive = lean_worker(connection, model_name)
    beat_at(connection, alive, 1)
    queue = book.queue
    hashed, bare = (str(uuid.uuid4()), uuid.uuid4().hex), (str(uuid.uuid4()), uuid.uuid4().hex)
    for job_id, execution in (hashed, bare):
        connection.zadd(queue.started, {f"{job_id}:{execution}": 1e10})
    connection.hset(layout.execution_key(*hashed), "worker_name", alive.name)
    assert execution_tag(alive.name) != hashed[1][:TAG_DIGITS]
    observer = Book(connection, "observer", queue.name, executions=False)
    assert observer.abandoned(dead_after=30, own=False) == [(*bare, "?")]


def test_rqs_own_tools_read_a_lean_workers_records(connection: redis.Redis, model_name: str) -> None:
    book, records = lean_worker(connection, model_name)
    job_id = str(uuid.uuid4())
    push(connection, model_name, job_id)
    start(connection, book)
    queue_name = keys.queue_name(model_name)
    registry = StartedJobRegistry(queue_name, connection=connection)
    assert registry.get_job_ids() == [job_id]
    fetched = Job.fetch(job_id, connection=connection)
    assert fetched.get_status() == "started"
    assert fetched.worker_name == records.name
    [worker] = [w for w in Worker.all(queue=Queue(queue_name, connection=connection)) if w.name == records.name]
    # RQ 3 finds a worker's current job in its index of executions (not written); RQ 2 in the worker hash.
    assert worker.get_current_job_id() == (None if layout.RQ3 else job_id)
    registry.cleanup(timestamp=1e12)  # RQ's cleanup of an expired entry needs no execution record
    assert fetched.get_status() == "failed"


def test_the_dashboards_show_a_lean_workers_started_job(
    connection: redis.Redis, redis_url: str, model_name: str
) -> None:
    """ortq's page and rq-dashboard's job and worker views read a worker whose jobs have no
    execution records: the job shows as started, the worker with no current job (RQ 3)."""
    book, records = lean_worker(connection, model_name)
    job_id = str(uuid.uuid4())
    push(connection, model_name, job_id)
    start(connection, book)
    client = create_app(Settings.from_url(redis_url)).test_client()
    job = client.get(f"/rq/0/data/job/{job_id}.json")
    assert job.status_code == 200 and job.json["status"] == "started"
    workers = client.get("/rq/0/data/workers.json")
    assert workers.status_code == 200
    [row] = [w for w in workers.json["workers"] if w["name"] == records.name]
    # RQ 3 finds a current job in the worker's index of executions (not written); RQ 2 in its hash.
    assert row["current_job"] == "idle" if layout.RQ3 else row["current_job"]["job_id"] == job_id
    assert client.get("/").status_code == 200


def test_ortq_info_shows_the_job_a_worker_without_execution_records_runs(
    redis_url: str, model_name: str, models_dir: Path
) -> None:
    slow = onnx_models.timed_slow_model(models_dir / "slow-2s.onnx", 2.0)
    lean = Settings.from_url(redis_url, rq_executions=False, heartbeat_seconds=0.3)
    running = Serving(make_worker(slow, model_name, lean))
    try:
        with Producer(settings=lean) as producer:
            producer.wait_for_workers(model_name, 1, timeout=30)
            job = producer.submit(model_name, {"x": np.ones((1, 256), np.float32)})

            def shown() -> object:
                [model] = [m for m in collect(producer.connection)["models"] if m["model"] == model_name]
                [worker] = model["workers"]
                return worker["current_job"]

            eventually(lambda: shown() == job.id)  # while it runs, from ortq's own record
            job.result(timeout=30)
            eventually(lambda: shown() is None)  # idle again
    finally:
        running.stop()


@pytest.mark.parametrize("forged", [{"job": 1}, "../../x", 10**30, "a" * 129, ["id"], None])
def test_a_forged_held_job_in_a_worker_record_shows_as_no_current_job(
    connection: redis.Redis, redis_url: str, model_name: str, forged: object
) -> None:
    """ortq's worker record is read as hostile input: only a job id is shown, and only while RQ's
    state says the worker is busy."""
    _, records = lean_worker(connection, model_name)
    connection.hset(records.key, "state", "busy")
    # A record of the model's worker that has none of the other fields, or some of the wrong type.
    record = {"name": "someone-else", "model": model_name, "held_job": forged, "pid": "x", "adapter": "y"}
    connection.set(keys.worker_key(records.name), json.dumps(record))
    connection.sadd(keys.WORKERS_SET, records.name)

    def shown() -> object:
        [model] = [m for m in collect(connection)["models"] if m["model"] == model_name]
        [worker] = model["workers"]
        assert worker["name"] == records.name  # the name it is registered under
        return worker["current_job"]

    try:
        assert shown() is None
        table = format_info(collect(connection))  # `ortq info`'s tables: unknowns shown as such
        [row] = [line.split() for line in table.splitlines() if line.startswith(records.name + " ")]
        assert row[:5] == [records.name, model_name, "?", "busy", "?"]  # a record with no version: "?"
        page = create_app(Settings.from_url(redis_url)).test_client().get("/")  # ortq's page, likewise
        assert page.status_code == 200 and '<td data-field="host">? / ?</td>' in page.text
        record["held_job"] = "a" * 128  # a job id: shown while busy, not once idle
        connection.set(keys.worker_key(records.name), json.dumps(record))
        assert shown() == "a" * 128
        connection.hset(records.key, "state", "idle")
        assert shown() is None
    finally:
        connection.delete(keys.worker_key(records.name))
        connection.srem(keys.WORKERS_SET, records.name)

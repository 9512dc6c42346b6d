"""RQ 3's new job states and records on an ortq model's queue (issue 35, §5): what ``ortq info``,
the exporter and the dashboard read there without error.

RQ 3 itself writes the scene, through its own API on the model's queue (ortq's msgpack serializer,
ortq's job function): a job held back by a concurrency limit (``rate_limited``: in RQ's
``rq:rl:<key>:rate_limited`` set, in no queue list or registry of the queue), dependents
``deferred`` and, as a crash between RQ's two steps leaves them, ``ready_to_enqueue`` (in RQ 3's
``rq:ready:<queue>`` registry), a ``scheduled`` job, a ``canceled`` one, and a job started by a
plain RQ 3 worker with RQ 3's per-execution records (``rq:execution:<job>:<execution>``, the
worker's ``rq:worker:<name>:executions`` set, ``<job>:<execution>`` in the started registry).
The states no RQ call leaves on a queue without running a job (``created``, ``finished``,
``failed``, ``stopped``) are written as RQ writes them, in their registries. Then one hash of
every status of the installed RQ (rq.job.JobStatus) is pushed onto the queue list too, as a
stale or forged entry would be.

The model is a real one: an ortq worker served it (in this process) and left its signature.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue, Worker
from rq.job import Job, JobStatus

from ortq import keys
from ortq.dashboard.app import create_app
from ortq.exporter import FAILED, QUEUE_LENGTH, REDIS_UP, RUNNING, QueueCollector
from ortq.info import shard_clients
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.redisurls import redacted_url
from ortq.rqcompat import layout
from ortq.serializer import MsgpackSerializer
from ortq.settings import Settings
from tests.cli_support import invoke
from tests.dashboard_support import forge_job
from tests.test_worker_inprocess import Serving, make_worker

pytestmark = pytest.mark.skipif(not layout.RQ3, reason="RQ 2.x has neither these states nor execution records")

MODEL = "rq3-states"
#: RQ 3's states that RQ 2 had not: the test is about these.
NEW_IN_RQ3 = {"rate_limited", "ready_to_enqueue"}


@dataclass
class Scene:
    url: str
    connection: redis.Redis
    queue: Queue
    #: job id -> the status RQ wrote for it (the hash's ``status``).
    statuses: dict[str, str]
    #: the plain RQ 3 worker holding a started job, with its execution.
    rq_worker: str
    execution: str

    def count(self, key: str) -> int:
        kind = self.connection.type(key)
        if kind == b"list":
            return int(self.connection.llen(key))
        return int(self.connection.zcard(key)) if kind == b"zset" else 0


def _status(job: Job) -> str:
    return str(job.get_status(refresh=True).value)


@pytest.fixture(scope="module")
def scene(tiny_path: Path) -> Iterator[Scene]:
    from rq.rate_limit import RateLimit
    from rq.registry import ReadyJobRegistry

    with LocalRedis() as server:
        url = server.url
        connection = redis.Redis.from_url(url)
        # A real model: an ortq worker served it and left its signature (which outlives it).
        settings = Settings.from_url(url, heartbeat_seconds=0.5)
        served = Serving(make_worker(tiny_path, MODEL, settings))
        with Producer(settings=settings) as producer:
            producer.wait_for_workers(MODEL, 1, timeout=60)
        assert served.stop() == 0
        assert connection.exists(keys.signature_key(MODEL))

        queue = Queue(keys.queue_name(MODEL), connection=connection, serializer=MsgpackSerializer)
        limit = RateLimit(f"{MODEL}-limit", 1)
        running = queue.enqueue(keys.JOB_FUNC, MODEL, rate_limit=limit)  # takes the limit's one slot
        held = queue.enqueue(keys.JOB_FUNC, MODEL, rate_limit=limit)  # rate_limited
        deferred = queue.enqueue(keys.JOB_FUNC, MODEL, depends_on=held)
        ready = queue.enqueue(keys.JOB_FUNC, MODEL, depends_on=deferred)
        with connection.pipeline() as pipe:  # RQ's first step of enqueueing met dependents, without its second
            ReadyJobRegistry(name=queue.name, connection=connection, serializer=MsgpackSerializer).register_jobs(
                [ready], pipe
            )
            pipe.execute()
        scheduled = queue.enqueue_in(timedelta(hours=1), keys.JOB_FUNC, MODEL)
        canceled = queue.enqueue(keys.JOB_FUNC, MODEL)
        canceled.cancel()
        waiting = queue.enqueue(keys.JOB_FUNC, MODEL)
        # A plain RQ 3 worker takes the first job as RQ's worker does, with RQ 3's execution records.
        worker = Worker(
            [queue], connection=connection, serializer=MsgpackSerializer, name=f"rq3-{uuid.uuid4().hex[:8]}"
        )
        worker.register_birth()  # type: ignore[no-untyped-call]
        assert connection.lpop(queue.key) == running.id.encode()  # its place in the queue list, taken
        execution = worker.prepare_execution(running)
        worker.prepare_job_execution(running)
        made = {job.id: _status(job) for job in (running, held, deferred, ready, scheduled, canceled, waiting)}
        assert sorted(made.values()) == sorted(
            ["started", "rate_limited", "deferred", "ready_to_enqueue", "scheduled", "canceled", "queued"]
        ), made
        assert connection.zscore(layout.QueueKeys.of(queue.name).started, f"{running.id}:{execution.id}") is not None
        assert connection.sismember(layout.worker_executions_key(worker.name), f"{running.id}:{execution.id}")
        assert connection.exists(layout.execution_key(running.id, execution.id))
        # The states left without running a job: as RQ writes them, in their registries.
        for status, registry in (("created", "queued"), ("finished", "finished"), ("failed", "failed"),
                                 ("stopped", "failed")):  # fmt: skip
            made[forge_job(connection, queue.name, registry, status=status)] = status
        # One hash of every status the installed RQ knows, pushed onto the queue list.
        for status in JobStatus:
            made[forge_job(connection, queue.name, "queued", status=status.value)] = status.value
        assert {s.value for s in JobStatus} <= set(made.values()) and set(made.values()) >= NEW_IN_RQ3
        yield Scene(url, connection, queue, made, worker.name, execution.id)
        connection.close()


def _body(response: Any) -> Any:
    """A test client response's JSON (None would mean it was no JSON)."""
    body = response.get_json()
    assert body is not None, response.text[:2000]
    return body


def _queue_counts(scene: Scene) -> dict[str, int]:
    names = layout.QueueKeys.of(scene.queue.name)
    return {
        "queued": scene.count(names.queue),
        "started": scene.count(names.started),
        "failed": scene.count(names.failed),
        "finished": scene.count(names.finished),
    }


def test_ortq_info_reads_rq3s_states(scene: Scene) -> None:
    done = invoke("info", "--json", "--redis-url", scene.url)
    assert done.exit_code == 0 and done.no_traceback(), done.stderr
    [model] = [m for m in json.loads(done.stdout)["models"] if m["model"] == MODEL]
    counts = _queue_counts(scene)
    assert {name: model[name] for name in counts} == counts, model
    assert counts["queued"] == 1 + 1 + len(JobStatus)  # the queued job, the "created" one and one of each status
    table = invoke("info", "--redis-url", scene.url)
    assert table.exit_code == 0 and table.no_traceback() and MODEL in table.stdout, table.stderr


def test_one_exporter_scrape_reads_rq3s_states(scene: Scene) -> None:
    shards, clients = shard_clients(Settings.from_url(scene.url), "-")
    registry = CollectorRegistry()
    registry.register(QueueCollector(clients, shards, Settings.heartbeat_seconds))
    try:
        body = generate_latest(registry).decode()  # what one GET /metrics answers
    finally:
        for client in clients.values():
            client.close()
    samples = {
        (sample.name, sample.labels.get("model")): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }
    assert samples[(REDIS_UP, None)] == 1.0, body
    counts = _queue_counts(scene)
    assert samples[(QUEUE_LENGTH, MODEL)] == counts["queued"]
    assert samples[(RUNNING, MODEL)] == counts["started"]
    assert samples[(FAILED, MODEL)] == counts["failed"]
    assert redacted_url(scene.url) in body


def test_the_dashboard_reads_rq3s_states(scene: Scene) -> None:
    client = create_app(Settings.from_url(scene.url)).test_client()
    overview = client.get("/")
    assert overview.status_code == 200 and MODEL in overview.text, overview.text[:2000]
    info = client.get("/api/info")
    assert info.status_code == 200, info.text[:2000]
    [model] = [m for m in _body(info)["models"] if m["model"] == MODEL]
    assert model["queued"] == _queue_counts(scene)["queued"]
    queues = client.get("/rq/0/data/queues.json")
    assert queues.status_code == 200 and scene.queue.name in [q["name"] for q in _body(queues)["queues"]]
    names = layout.QueueKeys.of(scene.queue.name)
    for registry, key in (("queued", names.queue), ("started", names.started), ("failed", names.failed),
                          ("finished", names.finished), ("deferred", f"rq:deferred:{scene.queue.name}"),
                          ("scheduled", f"rq:scheduled:{scene.queue.name}"),
                          ("canceled", f"rq:canceled:{scene.queue.name}")):  # fmt: skip
        listed = client.get(f"/rq/0/data/jobs/{scene.queue.name}/{registry}/100/asc/1.json")
        assert listed.status_code == 200, f"{registry}: {listed.status_code} {listed.text[:2000]}"
        assert len(_body(listed)["jobs"]) == scene.count(key), (registry, _body(listed))
    for job_id, status in scene.statuses.items():
        job = client.get(f"/rq/0/data/job/{job_id}.json")
        assert job.status_code == 200, f"{status} job {job_id}: {job.status_code} {job.text[:2000]}"
        assert _body(job)["status"] == status, _body(job)
        page = client.get(f"/rq/0/view/job/{job_id}")
        assert page.status_code == 200, f"{status} job {job_id}'s page: {page.status_code} {page.text[:2000]}"
    workers = client.get("/rq/0/data/workers.json")
    assert workers.status_code == 200, workers.text[:2000]
    assert scene.rq_worker in [w["name"] for w in _body(workers)["workers"]], _body(workers)
    assert client.get("/rq/0/view/workers").status_code == 200

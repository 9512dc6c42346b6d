"""ortq's writes, field by field against RQ's own worker's (tests/rqcontract/reference.py), for
the RQ series installed: the same scenarios (success, failure, retry at once, retry later, a
worker's own records) through ortq's producer and ortq.rqcompat's scripts and records, in-process,
and one end-to-end run of a real ``ortq worker``.

Every difference that remains is listed below with the reason it is intended.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import numpy as np
import pytest
import redis

from ortq import keys, wire
from ortq.producer import Producer
from ortq.rqcompat import layout
from ortq.rqcompat.book import Book, Finished, Retry, StartedJob
from ortq.rqcompat.records import WorkerRecords
from ortq.serializer import MsgpackSerializer
from ortq.settings import Settings
from tests.conftest import WorkerProcesses, eventually
from tests.rqcontract import reference
from tests.rqcontract.snapshot import Snapshot, assert_same, snapshot

pytestmark = pytest.mark.rqcompat

X = {"x": np.ones((1, 4), np.float32)}
SIGNATURE = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
             "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}]}  # fmt: skip

# ------------------------------------------------------------------ intended differences
_JOB = "rq:job:<job*>"
#: What ortq's producer writes differently from RQ's Queue.enqueue, at every stage.
ENQUEUE = {
    f"{_JOB} field data": "ortq's job function and model (plain msgpack, not zlib), not the reference job's",
    f"{_JOB} field description": "ortq's job description",
    f"{_JOB} field *_callback_name": "RQ's full job-hash writes add empty callback fields; ortq never writes them",
    f"{_JOB} field group_id": "RQ's full job-hash writes add an empty group_id; ortq's jobs have no group",
    f"{_JOB} field ortq_reply": "the reply stream ortq's producer reads the answer from (protocol 4); RQ has none",
}
#: What an answered job's hash holds that RQ's does not: where its answer is.
ANSWERED = {f"{_JOB} field ortq_answer": "the id of the job's entry in its reply stream (protocol 4); RQ has no reply"}
#: Fields RQ's enqueue writes empty and ortq writes when they happen.
NOT_YET = {
    f"{_JOB} field {name}": f"RQ writes {name} empty at enqueue; ortq writes it when it happens"
    for name in ("ended_at", "last_heartbeat", "started_at", "worker_name")
}
#: A waiting job's hash lives its wait + failure_ttl (ortq) rather than its ttl (RQ): a worker that
#: finds it past its ttl still has its record to fail it with RequestExpired.
WAITING_TTL = {
    f"{_JOB} ttl": "ortq keeps a waiting job's hash ttl + failure_ttl, so that it can be failed with a reason"
}
#: ortq's heartbeat thread beats every few seconds, busy or idle, with RQ's idle worker TTL.
BEATING = {
    key: "ortq's heartbeat thread beats every few seconds with RQ's worker_ttl + 60"
    for key in ("rq:worker:<worker> ttl", *(["rq:worker:<worker>:executions ttl"] if layout.RQ3 else []))
}
#: RQ records a failure's traceback; ortq the error's type and message (its workers' failures are
#: the job's own: bad input, expiry, a model error).
EXC = {"rq:results:<job> entry 0 field exc_string": "ortq records 'Type: message', not a traceback"}
RETRY_ZERO = {f"{_JOB} field retry_intervals": "RQ writes [0] for retries without a wait; ortq writes none"}
ALLOWED = {
    "queued": {**ENQUEUE, **NOT_YET, **WAITING_TTL},
    "started": {**ENQUEUE, f"{_JOB} field ended_at": NOT_YET[f"{_JOB} field ended_at"]},
    "heartbeat": {**ENQUEUE, f"{_JOB} field ended_at": NOT_YET[f"{_JOB} field ended_at"], **BEATING},
    "ended": ENQUEUE,
}


class OrtqSide:
    """One scenario on ortq's side: a model queue, a producer with the reference's lifetimes, and
    a worker's scripts and records, all in-process on the contract database."""

    def __init__(self, connection: redis.Redis, url: str, scenario: str) -> None:
        token = uuid4().hex[:12]
        self.connection = connection
        self.model = f"rqc-{scenario}-{token}"
        self.queue = keys.queue_name(self.model)
        self.worker = f"rqcw-{token}"
        connection.set(
            keys.signature_key(self.model), json.dumps({"model": self.model, "protocol": keys.PROTOCOL, **SIGNATURE})
        )
        settings = Settings(redis_url=url, result_ttl=reference.RESULT_TTL, failure_ttl=reference.FAILURE_TTL)
        self.producer = Producer(settings=settings)
        self.records = WorkerRecords(self.worker, self.queue)
        self.book = Book(connection, self.worker, self.queue)
        self.jobs: list[str] = []

    def placeholders(self) -> dict[str, str]:
        names = {self.queue: "<queue>", self.worker: "<worker>"}
        if len(self.jobs) == 1:
            return {**names, self.jobs[0]: "<job>"}
        return {**names, **{job: f"<job{n}>" for n, job in enumerate(self.jobs, 1)}}

    def snap(self) -> Snapshot:
        return snapshot(self.connection, self.placeholders(), reference.DURATIONS).without("ortq:*")

    def submit(self, retries: int = 0, backoff: int = 0) -> None:
        job = self.producer.submit(
            self.model, X, ttl=reference.JOB_TTL, job_timeout=reference.JOB_TIMEOUT, retries=retries,
            retry_backoff=backoff,
        )  # fmt: skip
        self.jobs.append(job.id)

    def start(self) -> StartedJob:
        queue = self.book.queue
        raw = self.connection.lmove(queue.queue, queue.intermediate)
        assert isinstance(raw, bytes)
        reply, moment, _ = self.book.start(raw, 0)
        [started], skipped = self.book.parse_start(reply, moment)
        assert not skipped
        # RQ's execution records come at the worker's first heartbeat after a start, not with it
        # (ortq/rqcompat/lua/executions.lua; docs/design.md): the contract is the records then.
        assert self.book.record_executions([started]) == 1
        return started

    def beat(self, running: list[StartedJob]) -> None:
        with self.connection.pipeline(transaction=False) as pipe:
            positions = self.records.queue_heartbeat(pipe, running)
            results = pipe.execute()
        self.records.after_heartbeat(self.connection, results, positions, running)
        self.book.record_executions(running)

    def finish(self, started: StartedJob) -> None:
        summary = {"value": 3, "outputs": {"y": ["float32", [1, 4]]}}
        frame = wire.encode_response({"y": np.ones((1, 4), np.float32)})
        answered = self.book.finish([Finished(started, frame, reference.RESULT_TTL, MsgpackSerializer.dumps(summary))])
        assert answered == 1

    def fail(self, started: StartedJob, retry: Retry | None = None, state: str = "idle") -> None:
        error = wire.encode_error("ContractJobError", "failed")
        assert self.book.fail(started, error, reference.FAILURE_TTL, "ContractJobError: failed", retry, state)


@pytest.fixture
def theirs(contract_connection: redis.Redis) -> Iterator[dict[str, dict[str, Snapshot]]]:
    yield reference.run_all(contract_connection)


def check(
    ours: dict[str, Snapshot], theirs: dict[str, Snapshot], everywhere: dict[str, str] | None = None,
    ended: dict[str, str] | None = None,
) -> None:  # fmt: skip
    """Each stage against RQ's, with the stage's allowances, ``everywhere``'s, and ``ended``'s at the end."""
    for stage, snap in ours.items():
        allowed = {**ALLOWED[stage], **(everywhere or {}), **((ended or {}) if stage == "ended" else {})}
        assert_same(snap, theirs[stage], allowed)


def test_success(contract_connection: redis.Redis, contract_url: str) -> None:
    theirs = reference.success(contract_connection)
    side = OrtqSide(contract_connection, contract_url, "success")
    side.submit()
    ours = {"queued": side.snap()}
    side.records.register_birth(contract_connection)
    started = side.start()
    ours["started"] = side.snap()
    side.beat([started])
    ours["heartbeat"] = side.snap()
    side.finish(started)
    ours["ended"] = side.snap()
    check(ours, theirs, ended=ANSWERED)


def test_failure(contract_connection: redis.Redis, contract_url: str) -> None:
    theirs = reference.failure(contract_connection)
    side = OrtqSide(contract_connection, contract_url, "failure")
    side.submit()
    ours = {"queued": side.snap()}
    side.records.register_birth(contract_connection)
    started = side.start()
    ours["started"] = side.snap()
    side.fail(started)
    ours["ended"] = side.snap()
    check(ours, theirs, ended={**EXC, **ANSWERED})


@pytest.mark.parametrize("later", [False, True], ids=["retry_now", "retry_later"])
def test_retry(contract_connection: redis.Redis, contract_url: str, later: bool) -> None:
    theirs = (reference.retry_later if later else reference.retry_now)(contract_connection)
    side = OrtqSide(contract_connection, contract_url, "retry")
    backoff = reference.RETRY_INTERVALS[0] if later else 0
    side.submit(retries=2, backoff=backoff)
    ours = {"queued": side.snap()}
    side.records.register_birth(contract_connection)
    started = side.start()
    ours["started"] = side.snap()
    waiting = backoff + reference.JOB_TTL + reference.FAILURE_TTL  # the worker's rule (ortq.worker.loop)
    side.fail(started, Retry(1, time.time() + backoff if later else None, waiting))
    ours["ended"] = side.snap()
    check(ours, theirs, RETRY_ZERO if not later else {}, ended=WAITING_TTL)


def test_worker_records(contract_connection: redis.Redis, contract_url: str) -> None:
    theirs = reference.worker(contract_connection)
    side = OrtqSide(contract_connection, contract_url, "worker")
    side.submit()
    side.submit()
    side.records.register_birth(contract_connection)
    ours = {"birth": side.snap()}
    first = side.start()
    ours["busy"] = side.snap()
    side.finish(first)
    second = side.start()
    side.fail(second)
    ours["idle"] = side.snap()
    side.records.register_death(contract_connection)
    ours["death"] = side.snap()
    for stage, snap in ours.items():
        only_worker = snap.select(lambda key: "<worker>" in key or key == "rq:workers")
        theirs_worker = theirs[stage].select(lambda key: "<worker>" in key or key == "rq:workers")
        assert_same(only_worker, theirs_worker)


def test_a_real_worker_ends_a_job_as_rq_does(
    contract_connection: redis.Redis, contract_url: str, workers: WorkerProcesses, tiny_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The same ``ended`` records from the real ``ortq worker`` process as from the scripts."""
    theirs = reference.success(contract_connection)
    side = OrtqSide(contract_connection, contract_url, "real")
    monkeypatch.setenv("ORTQ_RESULT_TTL", str(reference.RESULT_TTL))
    workers.serve(tiny_path, side.model, contract_url, 1, "--worker-name", side.worker)
    side.submit()
    job = side.producer.job(side.jobs[0], side.model)
    job.result(timeout=30)
    finished = layout.QueueKeys.of(side.queue).finished
    eventually(lambda: contract_connection.zscore(finished, side.jobs[0]) is not None)
    ended = side.snap().select(lambda key: "<job>" in key)
    allowed = {
        **ENQUEUE,
        **ANSWERED,
        "rq:results:<job> entry 0 field return_value": "ortq's reply summary, not the reference's",
    }
    assert_same(ended, theirs["ended"].select(lambda key: "<job>" in key), allowed)

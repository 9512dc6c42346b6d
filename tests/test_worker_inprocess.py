"""The worker's loop and scripts in-process: a real ``Worker`` (real session, real Redis) served
from a thread of the test, and ortq.rqcompat's scripts called one by one, as dramatiq and arq test
their workers. Quicker than a worker process, and each stage can be looked at on its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis
import rq
from rq.command import send_shutdown_command

from ortq import keys, knownheaders, wire
from ortq.errors import (
    EXIT_CONFIGURATION,
    EXIT_CRASHED,
    EXIT_DEVICE_LOST,
    ConfigurationError,
    InferenceFailed,
    InvalidInput,
)
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.rqcompat import contract, layout
from ortq.rqcompat.acl import refused_command
from ortq.rqcompat.book import JOB_FIELDS, Book, Finished, Skipped, StartedJob, script_source
from ortq.rqcompat.layout import utcnow
from ortq.rqjob import JobRecord
from ortq.settings import Settings
from ortq.signature import ModelSignature, TensorSpec
from ortq.worker import jobs
from ortq.worker.batch import batch_key, group
from ortq.worker.intake import Taken
from ortq.worker.loop import Worker
from ortq.worker.serve import WorkerConfig, build_worker
from tests import onnx_models
from tests.conftest import eventually
from tests.test_fuzz import job_fields

pytestmark = pytest.mark.rqcompat

X = {"x": np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.float32)}

#: The reply stream name the jobs these tests write by hand name (a producer's own, were there one):
#: its answers are kept 60 s.
REPLY = keys.new_reply_name(60)


def answered_fields(model: str) -> dict[bytes, bytes]:
    """The hash a producer writes for a job of ``model`` answered in the stream named REPLY."""
    return {**job_fields(model), b"ortq_reply": REPLY.encode()}


def answers(client: redis.Redis, model: str, job_ids: list[str]) -> dict[str, list[bytes]]:
    """Each job's answers: the frames of the entries with its id in the reply stream its hash names
    (``ortq_reply``), a large one's (its entry's frame empty) read from its own key, which must hold
    that one frame; an answered job's hash must name its entry (``ortq_answer``), one not answered none."""
    with client.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hmget(keys.job_key(job_id), "ortq_reply", "ortq_answer")
        named = pipe.execute()
    entries: dict[tuple[bytes, bytes], list[tuple[bytes, bytes]]] = {}
    for name in {name for name, _ in named if name is not None}:
        for entry_id, fields in client.xrange(keys.reply_key(model, name.decode())):
            entries.setdefault((name, fields[keys.REPLY_ID_FIELD]), []).append(
                (entry_id, fields[keys.REPLY_FRAME_FIELD])
            )
    found: dict[str, list[bytes]] = {}
    for job_id, (name, answer) in zip(job_ids, named, strict=True):
        mine = entries.get((name, job_id.encode()), []) if name is not None else []
        assert (answer in {entry_id for entry_id, _ in mine}) if mine else answer is None, (job_id, answer, mine)
        frames = []
        for _, frame in mine:
            if frame != b"":
                frames.append(frame)
                continue
            [(_, large)] = client.xrange(keys.large_reply_key(model, job_id))
            assert set(large) == {keys.REPLY_FRAME_FIELD}, large
            frames.append(large[keys.REPLY_FRAME_FIELD])
        found[job_id] = frames
    return found


class Serving:
    """A worker served from a thread; ``status`` is its exit status once it returned."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.status: int | None = None
        # Named as ortq's own threads are: tests/fault_injection.py tells the worker's calls by it.
        self.thread = threading.Thread(target=self._serve, name="ortq-main", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.status = self.worker.serve(handle_signals=False)

    def stop(self, timeout: float = 15) -> int | None:
        self.worker.request_stop()
        self.thread.join(timeout)
        return self.status


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return Settings.from_url(redis_url, heartbeat_seconds=0.5)


def make_worker(model_path: Path, name: str, settings: Settings, **options: object) -> Worker:
    return build_worker(WorkerConfig(model_path, name, threads=1, **options), settings)  # type: ignore[arg-type]


def serving_of(model_path: Path, model_name: str, settings: Settings) -> Iterator[Serving]:
    """A fixture's body: an in-process worker of ``model_path``, serving once its record is up, stopped after."""
    running = Serving(make_worker(model_path, model_name, settings))
    with Producer(settings=settings) as producer:
        producer.wait_for_workers(model_name, 1, timeout=30)
    yield running
    running.stop()


@pytest.fixture
def serving(tiny_path: Path, model_name: str, settings: Settings) -> Iterator[Serving]:
    yield from serving_of(tiny_path, model_name, settings)


def test_it_serves_jobs_and_a_stop_request_ends_it_with_status_0(
    serving: Serving, producer: Producer, model_name: str, tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "ortq.worker")
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    outputs = producer.infer(model_name, X, timeout=10)
    np.testing.assert_array_equal(outputs["y"], session.run(None, X)[0])
    assert serving.stop() == 0
    assert producer.workers(model_name) == []
    # It says which Redis it served (never with a password) and that it stopped, and why.
    name = serving.worker.name
    assert f"worker {name} stopped (exit status 0)" in caplog.text


def test_the_worker_logs_its_redis_without_the_password(
    tiny_path: Path, model_name: str, redis_server: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "ortq.worker")
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", "logged", "on", ">s3cret-pass", "~*", "&*", "+@all")
    url = f"redis://logged:s3cret-pass@127.0.0.1:{redis_server.port}/0"
    settings = Settings.from_url(url, heartbeat_seconds=0.5)
    running = Serving(make_worker(tiny_path, model_name, settings))
    try:
        eventually(lambda: "serving model" in caplog.text)
    finally:
        assert running.stop() == 0
        admin.execute_command("ACL", "DELUSER", "logged")
    assert f"from Redis at redis://logged@127.0.0.1:{redis_server.port}/0" in caplog.text
    assert "s3cret-pass" not in caplog.text


def test_rqs_shutdown_command_is_a_warm_stop(serving: Serving, producer: Producer, model_name: str) -> None:
    send_shutdown_command(producer.connection, serving.worker.name)
    serving.thread.join(15)
    assert serving.status == 0


def test_an_unexpected_error_ends_it_with_status_1(
    tiny_path: Path, model_name: str, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(tiny_path, model_name, settings)

    def broken(block: bool) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(worker.feeder.intake, "take", broken)
    assert worker.serve(handle_signals=False) == EXIT_CRASHED


def test_burst_ends_with_status_0_once_the_queue_is_empty(
    producer: Producer, tiny_path: Path, model_name: str, settings: Settings
) -> None:
    producer.allow_unknown_models = True
    jobs = producer.submit_many(model_name, [X, X, X])
    worker = make_worker(tiny_path, model_name, settings, burst=True)
    assert worker.serve(handle_signals=False) == 0
    assert all(job.status() == "finished" for job in jobs)


def test_a_lost_device_requeues_the_batch_and_ends_it_with_status_75(
    producer: Producer, models_dir: Path, model_name: str, settings: Settings
) -> None:
    gather = onnx_models.gather_model(models_dir / "gather.onnx")
    producer.allow_unknown_models = True
    job = producer.submit(model_name, {"idx": np.array([9])})  # out of range: the run itself fails
    worker = make_worker(gather, model_name, settings, device_lost_pattern="out of bounds|invalid")
    assert worker.serve(handle_signals=False) == EXIT_DEVICE_LOST
    assert job.status() == "queued"
    assert producer.connection.lrange(keys.queue_key(model_name), 0, -1) == [job.id.encode()]


def test_a_failed_job_is_answered_and_the_worker_goes_on(serving: Serving, producer: Producer, model_name: str) -> None:
    with pytest.raises(InferenceFailed, match="InvalidInput"):
        Producer(settings=producer.settings, validate=False).infer(model_name, {"x": np.ones((1, 5), np.float32)})
    producer.infer(model_name, X, timeout=10)
    assert serving.status is None  # still serving


@pytest.mark.parametrize(
    ("shape", "dtype", "error_type", "says"),
    [
        pytest.param(
            (1,) * (wire.MAX_DIMS + 1), np.float32, "InvalidInput", "dimensions",
            marks=pytest.mark.skipif(np.lib.NumpyVersion(np.__version__) < "2.0.0", reason="numpy 1.x: 32 dims"),
        ),
        ((2,), np.complex64, "UnsupportedDtype", "complex64"),
    ],
)  # fmt: skip
def test_an_answer_that_cannot_be_encoded_fails_its_job_alone(
    settings: Settings, shape: tuple[int, ...], dtype: type, error_type: str, says: str
) -> None:
    """The replier encodes each job's answer on its own (jobs.Computed.answer): one whose outputs
    no frame can carry (more dimensions than a frame has room for, a dtype it has no name for)
    becomes that job's failure, and the others of its run are answered."""
    fields = answered_fields("m")
    started = [StartedJob(f"job-{i}", uuid.uuid4().hex, fields, None, 60, utcnow(), 0) for i in range(2)]
    key = batch_key(X)
    members = [jobs.Pending(JobRecord.parse(s.job_id, fields), s, X, {}, 2, b"p" * 32, key, "m") for s in started]
    good = {"y": np.arange(8, dtype=np.float32).reshape(2, 4)}
    deep = {"y": np.zeros(shape, dtype)}
    answered, failed = (
        jobs.Computed(m, out, 0.001, 2, 60, jobs.layout_of(out)).encode(settings)
        for m, out in zip(members, (good, deep), strict=True)
    )
    assert isinstance(answered, Finished)
    np.testing.assert_array_equal(wire.decode_response(answered.frame).outputs["y"], good["y"])
    assert isinstance(failed, jobs.Failure) and failed.error_type == error_type and failed.retry is None
    assert says in wire.decode_response(failed.error).error.message  # type: ignore[union-attr]


def test_a_batch_checks_remembered_headers_once_and_as_the_full_checks_would(settings: Settings) -> None:
    """jobs.check_batch decodes a request whose header it has seen through the remembered header,
    and checks that header against the model once a batch: what it decides, and the inputs of each
    run, are what the full checks of each frame on its own give. A bad header's jobs fail alike,
    and jobs of a header that cannot be remembered still share a run with alike ones."""
    signature = ModelSignature(inputs=(TensorSpec("x", "float32", (None, 4)),), outputs=())
    good, wide = {"x": X["x"]}, {"x": np.ones((1, 5), np.float32)}
    frames = [
        wire.encode_request(good, {"nonce": os.urandom(16)}),  # first seen: the full checks, then remembered
        wire.encode_request({"x": X["x"] * 2}, {"nonce": os.urandom(16)}),
        wire.encode_request(wide, {"nonce": os.urandom(16)}),  # does not fit the model
        wire.encode_request(wide, {"nonce": os.urandom(16)}),  # through the remembered header
        wire.encode_request(good, {"nonce": os.urandom(16), "tag": 1}),  # options besides the nonce: never remembered
        bytearray(wire.encode_request({"x": X["x"] * 3}, {"nonce": os.urandom(16)})),
    ]
    fields = answered_fields("m")
    taken = [
        Taken(StartedJob(f"job-{i}", uuid.uuid4().hex, fields, None, 60, utcnow(), len(f)), f)
        for i, f in enumerate(frames)
    ]
    knownheaders.KNOWN.clear()
    pending, failures = jobs.check_batch(taken, "m", signature, settings, True, 0.0)
    assert [p.started.job_id for p in pending] == ["job-0", "job-1", "job-4", "job-5"]
    assert [p.known is not None for p in pending] == [True, True, False, True]
    expected = InvalidInput.__name__, "input 'x' has size 5 on axis 1, the model expects 4 (x: float32[?, 4])"
    assert [failed.started.job_id for failed in failures] == ["job-2", "job-3"]
    for failed in failures:
        assert (failed.error_type, wire.decode_response(failed.error).error.message) == expected  # type: ignore[union-attr]
    # The full checks, each frame on its own with nothing remembered, say the same.
    for item in taken[2:4]:
        knownheaders.KNOWN.clear()
        with pytest.raises(InvalidInput) as refused:
            signature.check_inputs(wire.decode_request(item.frame).inputs)  # type: ignore[arg-type]
        assert str(refused.value) == expected[1]
    (members,) = group(pending, lambda p: p.key, 8, lambda p: p.rows)
    assert members == pending and [p.rows for p in pending] == [2, 2, 2, 2]
    joined = jobs.group_inputs(members)["x"]
    np.testing.assert_array_equal(joined, np.concatenate([X["x"], X["x"] * 2, X["x"], X["x"] * 3]))
    known_only = [p for p in pending if p.known is not None]
    np.testing.assert_array_equal(jobs.group_inputs(known_only)["x"], np.concatenate([X["x"], X["x"] * 2, X["x"] * 3]))
    nonces = {t.started.job_id: wire.decode_request(t.frame).nonce for t in taken}  # type: ignore[arg-type]
    assert [p.proof for p in pending] == [wire.proof_of("m", nonces[p.started.job_id]) for p in pending]


# ------------------------------------------------------------------ the scripts, one by one


@pytest.fixture
def book(connection: redis.Redis, model_name: str) -> Book:
    return Book(connection, f"w-{uuid.uuid4().hex[:8]}", keys.queue_name(model_name))


def push(connection: redis.Redis, model: str, job_id: str) -> None:
    connection.hset(keys.job_key(job_id), mapping=answered_fields(model))  # type: ignore[arg-type]
    connection.set(keys.request_key(model, job_id), wire.encode_request(X))
    connection.rpush(keys.queue_key(model), job_id)


def push_many(connection: redis.Redis, model: str, count: int) -> list[str]:
    ids = [str(uuid.uuid4()) for _ in range(count)]
    for job_id in ids:
        push(connection, model, job_id)
    return ids


def start(connection: redis.Redis, book: Book, more: int = 0) -> tuple[list[StartedJob], list[Skipped]]:
    raw = connection.lmove(book.queue.queue, book.queue.intermediate)
    assert isinstance(raw, bytes)
    started, skipped, _ = start_script(connection, book, raw, more)
    return started, skipped


def start_script(
    connection: redis.Redis, book: Book, first: bytes, more: int, inline: int = 0
) -> tuple[list[StartedJob], list[Skipped], int]:
    """start.lua for ``first`` (b"": none, it pops) and ``more``: what it started, skipped, and left queued."""
    reply, moment, _ = book.start(first, more, inline)
    started, skipped = book.parse_start(reply, moment)
    return started, skipped, Book.backlog(reply)


def test_start_takes_a_batch_in_order_and_reports_frame_sizes(
    connection: redis.Redis, book: Book, model_name: str
) -> None:
    ids = push_many(connection, model_name, 3)
    started, skipped = start(connection, book, more=5)
    assert [s.job_id for s in started] == ids and skipped == []
    assert all(s.frame_size == len(wire.encode_request(X)) for s in started)
    assert connection.llen(book.queue.intermediate) == 0
    assert connection.zcard(book.queue.started) == 3


def test_start_sends_a_jobs_field_values_once_per_run_of_alike_jobs(
    connection: redis.Redis, book: Book, model_name: str
) -> None:
    """start.lua sends only enqueued_at for a job whose other fields equal the job's before it (a
    producer's jobs); what parse_start makes of either form is the job hash's own fields."""
    ids = push_many(connection, model_name, 4)
    connection.hset(keys.job_key(ids[1]), "enqueued_at", "2026-01-02T03:04:05.000006Z")
    for job_id in ids[2:]:
        connection.hset(keys.job_key(job_id), "timeout", "30")
    connection.hdel(keys.job_key(ids[3]), "enqueued_at")  # sent as nil
    stored = {job_id: connection.hmget(keys.job_key(job_id), list(JOB_FIELDS)) for job_id in ids}
    reply, moment, _ = book.start(b"", 8, 0)
    sent, at = [], len(contract.START_HEAD) + 2 * reply[1]  # the flat reply's value counts
    while at < len(reply):
        sent.append(reply[at + len(contract.START_JOB) - 1])
        at += len(contract.START_JOB) + sent[-1]
    assert sent == [len(JOB_FIELDS), 1, len(JOB_FIELDS), 1]  # the third's timeout differs
    started, _ = book.parse_start(reply, moment)
    for job in started:  # as read, before start.lua marked them started
        assert job.fields == {name.encode(): v for name, v in zip(JOB_FIELDS, stored[job.job_id], strict=True) if v}


def test_a_second_entry_of_a_started_job_is_skipped(connection: redis.Redis, book: Book, model_name: str) -> None:
    job_id = str(uuid.uuid4())
    push(connection, model_name, job_id)
    connection.rpush(keys.queue_key(model_name), job_id)
    start(connection, book)
    second, skipped = start(connection, book)
    assert second == [] and [(s.entry, s.reason) for s in skipped] == [(job_id.encode(), "status:started")]
    assert connection.zcard(book.queue.started) == 1


def test_finish_is_fenced_against_a_job_taken_back(connection: redis.Redis, book: Book, model_name: str) -> None:
    job_id = str(uuid.uuid4())
    push(connection, model_name, job_id)
    [started], _ = start(connection, book)
    outcome = book.recover(job_id, started.execution_id, book.worker_name, 2, 60, b"err", "WorkerLost: test")
    assert outcome == "requeued"
    frame = wire.encode_response({"y": np.zeros((2, 4), np.float32)})
    assert book.finish([Finished(started, frame, 60, b"\x80")]) == 0
    assert answers(connection, model_name, [job_id]) == {job_id: []}
    assert not connection.exists(keys.reply_key(model_name, REPLY))
    assert connection.hget(keys.job_key(job_id), "status") == b"queued"


def test_a_failure_sent_again_is_this_workers_answer_and_one_taken_back_is_not(
    connection: redis.Redis, book: Book, model_name: str
) -> None:
    """fail.lua's second send (the first ran, its reply lost: the worker sends it again) writes
    nothing again and still says the failure is this worker's; a job another worker took back is not."""
    mine, taken = str(uuid.uuid4()), str(uuid.uuid4())
    push(connection, model_name, mine)
    push(connection, model_name, taken)
    [first], _ = start(connection, book)
    [second], _ = start(connection, book)
    error = wire.encode_error("RuntimeError", "it broke")
    assert book.fail(first, error, 60, "it broke", None) is True
    assert book.fail(first, error, 60, "it broke", None) is True  # the second send
    assert answers(connection, model_name, [mine]) == {mine: [error]}
    assert connection.xlen(layout.results_key(mine)) == 1
    other = Book(connection, "another-worker", book.queue.name)
    assert book.recover(taken, second.execution_id, book.worker_name, 2, 60, b"err", "WorkerLost: test") == "requeued"
    [again], _ = start(connection, other)
    assert other.fail(again, error, 60, "it broke", None) is True
    assert book.fail(second, error, 60, "it broke", None) is False  # failed by the other worker, not this one
    assert answers(connection, model_name, [taken]) == {taken: [error]}


def test_large_answers_reach_their_reply_through_a_stage_key_fenced_like_small_ones(
    connection: redis.Redis, book: Book, model_name: str
) -> None:
    # A large answer never enters Lua (Redis 7 hashes every byte of a script's strings): it is
    # written beside the finish script and renamed to its reply there, if the job is still this
    # execution's; a job taken back meanwhile gets no reply, and its stage is deleted.
    from ortq.rqcompat.book import STAGED_ANSWER_BYTES

    ids = [str(uuid.uuid4()) for _ in range(4)]
    for job_id in ids:
        push(connection, model_name, job_id)
    started, _ = start(connection, book, more=3)
    taken_back, answered_large, answered_small, forged = started
    assert book.recover(taken_back.job_id, taken_back.execution_id, book.worker_name, 2, 60, b"e", "test")
    large = wire.encode_response({"y": np.ones((STAGED_ANSWER_BYTES // 16, 4), np.float32)})
    small = wire.encode_response({"y": np.zeros((2, 4), np.float32)})
    assert len(large) >= STAGED_ANSWER_BYTES > len(small)
    # An entry already in the fourth's stage (a finish sent twice after NOSCRIPT, or anyone with
    # the worker's rights) does not become a second entry of its reply.
    connection.xadd(keys.answer_stage_key(forged.job_id, forged.execution_id), {"frame": b"forged"})
    connection.config_resetstat()
    answered = book.finish(
        [Finished(job, frame, 60, b"\x80") for job, frame in zip(started, [large, large, small, large], strict=True)]
    )
    assert answered == 3
    done = [answered_large, answered_small, forged]
    assert answers(connection, model_name, [job.job_id for job in started]) == {
        taken_back.job_id: [],
        answered_large.job_id: [large],
        answered_small.job_id: [small],
        forged.job_id: [large],
    }
    # In the reply stream: the small frame itself, and an empty one for each large frame, whose
    # own stream holds it (renamed from its stage, whole), expiring as the reply stream's entries.
    stream = keys.reply_key(model_name, REPLY)
    in_stream = [(entry[b"id"].decode(), entry[b"frame"]) for _, entry in connection.xrange(stream)]
    assert in_stream == [(answered_large.job_id, b""), (answered_small.job_id, small), (forged.job_id, b"")]
    assert 0 < connection.ttl(stream) <= 60
    for job in done:
        large_key = keys.large_reply_key(model_name, job.job_id)
        assert (0 < connection.ttl(large_key) <= 60) if job is not answered_small else not connection.exists(large_key)
    assert not connection.exists(keys.large_reply_key(model_name, taken_back.job_id))
    assert not connection.keys(keys.answer_stage_key("*", "*"))  # renamed, or deleted when not answered
    assert connection.hget(keys.job_key(taken_back.job_id), "status") == b"queued"
    stats = connection.info("commandstats")
    assert stats["cmdstat_rename"]["calls"] == 2 and stats["cmdstat_xadd"]["calls"] >= 3


def test_a_stage_deleted_before_the_finish_script_leaves_its_job_to_be_taken_back(
    connection: redis.Redis, book: Book, model_name: str
) -> None:
    from ortq.rqcompat.book import STAGED_ANSWER_BYTES

    job_id = str(uuid.uuid4())
    push(connection, model_name, job_id)
    [started], _ = start(connection, book)
    large = wire.encode_response({"y": np.ones((STAGED_ANSWER_BYTES // 16, 4), np.float32)})
    stage = keys.answer_stage_key(job_id, started.execution_id)

    def deleted_stage(pipe: redis.client.Pipeline) -> None:  # the stage written, then removed
        pipe.xadd(stage, {"frame": large})
        pipe.delete(stage)

    named = {"queue": book.queue.name, "worker": book.worker_name, "state": "", "count": 1,
             "ended_iso": "2026-01-01T00:00:00.000000Z", "ended_at": "0", "moment_count": 1}  # fmt: skip
    moments = ["0.1", repr(started.started_at.timestamp())]
    staged = [job_id, started.execution_id, 60, 1, "", b"", REPLY, 60]  # the frame '': staged
    assert len(staged) == len(contract.FINISH_JOB)
    args = contract.arguments("finish", named, [*moments, *staged])
    reply, _ = book._pipelined("finish", args, before=deleted_stage)
    assert reply == 0  # not answered, not finished: still started, for its worker to take back
    assert answers(connection, model_name, [job_id]) == {job_id: []}
    assert not connection.exists(keys.reply_key(model_name, REPLY))
    assert not connection.exists(keys.large_reply_key(model_name, job_id))
    assert connection.zcard(book.queue.started) == 1 and connection.exists(keys.request_key(model_name, job_id))
    assert connection.hget(keys.job_key(job_id), "status") == b"started"


def test_a_batch_larger_than_a_script_call_can_unpack_starts_and_finishes_whole(
    connection: redis.Redis, book: Book, model_name: str
) -> None:
    # Lua's unpack takes ~8,000 values: a registry write of 4,500 (score, member) pairs in one call
    # fails, so the scripts write in chunks. Every job must be started, answered and recorded.
    ids = [uuid.uuid4().hex for _ in range(4500)]
    frame = wire.encode_request(X)
    with connection.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hset(keys.job_key(job_id), mapping=answered_fields(model_name))  # type: ignore[arg-type]
            pipe.set(keys.request_key(model_name, job_id), frame)
        pipe.rpush(keys.queue_key(model_name), *ids)
        pipe.execute()
    started, skipped = start(connection, book, more=len(ids) - 1)
    assert [s.job_id for s in started] == ids and skipped == []
    assert connection.zcard(book.queue.started) == len(ids)
    response = wire.encode_response({"y": np.zeros((2, 4), np.float32)})
    assert book.finish([Finished(job, response, 60, b"\x80") for job in started]) == len(ids)
    assert connection.zcard(book.queue.started) == 0
    assert connection.zcard(book.queue.finished) == len(ids)
    assert answers(connection, model_name, ids) == {job_id: [response] for job_id in ids}
    with connection.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.exists(keys.request_key(model_name, job_id))
        assert not any(pipe.execute())


def test_without_rq_results_a_job_is_answered_and_finished_with_no_result_record(
    connection: redis.Redis, book: Book, model_name: str
) -> None:
    recorded, unrecorded = str(uuid.uuid4()), str(uuid.uuid4())
    for job_id in (recorded, unrecorded):
        push(connection, model_name, job_id)
    first, second = start(connection, book, more=1)[0]
    response = wire.encode_response({"y": np.zeros((2, 4), np.float32)})
    assert book.finish([Finished(first, response, 60, b"\x80"), Finished(second, response, 60, None)]) == 2
    assert answers(connection, model_name, [recorded, unrecorded]) == {recorded: [response], unrecorded: [response]}
    for job_id in (recorded, unrecorded):
        assert connection.hget(keys.job_key(job_id), "status") == b"finished"
        assert connection.zscore(book.queue.finished, job_id) is not None
    assert connection.exists(layout.results_key(recorded))
    assert not connection.exists(layout.results_key(unrecorded))


@pytest.mark.parametrize("name", ["rq_results", "rq_executions"])
def test_rq_records_are_read_from_the_environment_as_booleans(name: str) -> None:
    variable = "ORTQ_" + name.upper()
    assert getattr(Settings.from_env({}), name) is True
    assert getattr(Settings.from_env({variable: "0"}), name) is False
    assert getattr(Settings.from_env({variable: "off"}), name) is False
    assert getattr(Settings.from_env({variable: "True"}), name) is True
    with pytest.raises(ConfigurationError, match=f"{variable}='maybe'"):
        Settings.from_env({variable: "maybe"})


@pytest.mark.parametrize("off", [("rq_results",), ("rq_results", "rq_executions")])
def test_a_worker_without_rq_records_answers_with_outputs_equal_to_a_direct_run(
    tiny_path: Path, model_name: str, settings: Settings, connection: redis.Redis, off: tuple[str, ...]
) -> None:
    lean = replace(settings, **dict.fromkeys(off, False))
    running = Serving(make_worker(tiny_path, model_name, lean, max_batch=8, rows_independent=True))
    try:
        with Producer(settings=lean) as producer:
            producer.wait_for_workers(model_name, 1, timeout=30)
            inputs = [{"x": np.random.default_rng(i).random((2, 4), np.float32)} for i in range(20)]
            handles = producer.submit_many(model_name, inputs)
            outputs = producer.results(handles, timeout=30)
    finally:
        running.stop()
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    for given, got in zip(inputs, outputs, strict=True):
        [expected] = session.run(None, given)
        np.testing.assert_allclose(got["y"], expected, rtol=1e-6)
    assert not any(connection.exists(layout.results_key(h.id)) for h in handles)
    shown = running.worker.presence.record()  # what `ortq info` shows
    assert shown["rq_results"] is False and shown["rq_executions"] is ("rq_executions" not in off)
    assert all(connection.hget(keys.job_key(h.id), "status") == b"finished" for h in handles)


def test_the_refused_command_is_read_from_each_wording() -> None:
    """Redis 7.2+'s NOPERM names the command; on 7.0 common.lua's unless_acl tags a redis.pcall's
    refusal, and a redis.call's names the script and line, where the call is (the test above
    runs the 7.0 wordings for real)."""
    assert refused_command("NOPERM User w has no permissions to run the 'zmscore' command") == "ZMSCORE"
    assert refused_command("ERR The user ... can't run this command or subcommand (STRLEN)") == "STRLEN"
    start = script_source("start")
    sha = hashlib.sha1(start.encode()).hexdigest()
    line = next(n for n, text in enumerate(start.splitlines(), 1) if "redis.call('PERSIST', job)" in text)
    refusal = "ERR The user executing the script can't run this command or subcommand script: {}, on @user_script:{}."
    assert refused_command(refusal.format(sha, line)) == "PERSIST"
    assert refused_command(refusal.format("0" * 40, line)) is None  # not one of ortq's scripts
    assert refused_command("ERR something else") is None


@pytest.mark.parametrize("command", ["zmscore", "strlen", "rename"])
def test_a_worker_whose_acl_lacks_a_script_command_exits_2_saying_so(
    tiny_path: Path,
    model_name: str,
    settings: Settings,
    connection: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    command: str,
) -> None:
    # The documented worker rule without ZMSCORE (finish.lua's fencing) or STRLEN (start.lua's look
    # at a request frame, under redis.pcall): before, the refusal inside the script read as "no job
    # owned" or "no frame", and every job came back later as WorkerLost or failed as InvalidJob.
    # Without RENAME (a rule from before large answers were staged): a large answer's finish
    # changes nothing, so the job can still be run again by a worker with the right rule.
    from tests.test_transport_security import WORKER_RULES

    inputs = {"x": np.ones((5000, 4), np.float32)} if command == "rename" else X  # an 80 KB answer: staged

    user, password = f"w-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    rules = WORKER_RULES.replace(f"+{command} ", "")
    assert rules != WORKER_RULES
    connection.execute_command("ACL", "SETUSER", user, "on", f">{password}", *rules.split())
    try:
        url = settings.redis_url.replace("redis://", f"redis://{user}:{password}@", 1)
        worker = make_worker(tiny_path, model_name, replace(settings, redis_url=url))
        running = Serving(worker)
        with Producer(settings=settings) as producer:
            producer.wait_for_workers(model_name, 1, timeout=30)
            job = producer.submit(model_name, inputs)
            running.thread.join(30)
        assert running.status == EXIT_CONFIGURATION
        assert "give it the worker rule of docs/security.md" in caplog.text
        # Named whether Redis names it (7.2+), the script tags it (a redis.pcall on 7.0) or only
        # the script's line says it (a redis.call on 7.0: RENAME).
        assert f"its ACL lacks the command {command.upper()};" in caplog.text, caplog.text
        if command == "rename":
            assert connection.exists(keys.request_key(model_name, job.id))
            assert answers(connection, model_name, [job.id]) == {job.id: []}
            assert not connection.exists(keys.large_reply_key(model_name, job.id))
            assert connection.hget(keys.job_key(job.id), "status") == b"started"  # to be taken back
    finally:
        connection.execute_command("ACL", "DELUSER", user)


def test_the_rescue_is_bounded_per_call(connection: redis.Redis, book: Book) -> None:
    connection.rpush(book.queue.intermediate, *[f"forged-{i}" for i in range(2500)])
    rescued, removed, full = book.rescue(grace=60, limit=1000)
    assert (rescued, removed, full) == ([], 1000, True)
    assert connection.llen(book.queue.intermediate) == 1500


def test_a_queued_job_left_in_the_intermediate_list_is_rescued_after_its_grace(
    connection: redis.Redis, book: Book, model_name: str
) -> None:
    job_id = str(uuid.uuid4())
    push(connection, model_name, job_id)
    connection.lmove(book.queue.queue, book.queue.intermediate)  # a BLMOVE whose reply was lost
    assert book.rescue(grace=0.2) == ([], 0, False)  # first seen: kept
    time.sleep(0.3)
    assert book.rescue(grace=0.2) == ([job_id], 0, False)
    assert connection.lrange(book.queue.queue, 0, -1) == [job_id.encode()]


def test_due_retries_go_back_once(connection: redis.Redis, book: Book, model_name: str) -> None:
    job_id = str(uuid.uuid4())
    push(connection, model_name, job_id)
    connection.lpop(book.queue.queue)
    connection.hset(keys.job_key(job_id), "status", "scheduled")
    connection.zadd(book.queue.scheduled, {job_id: time.time() - 1, "forged": time.time() - 1})
    assert book.due_retries() == 1
    assert book.due_retries() == 0
    assert connection.lrange(book.queue.queue, 0, -1) == [job_id.encode()]
    assert connection.zcard(book.queue.scheduled) == 0
    eventually(lambda: connection.hget(keys.job_key(job_id), "status") == b"queued")
    # The keys above are the book's own; RQ's scheduler and tools read RQ's: the same ones, as RQ computes them.
    rq_queue = rq.Queue(book.queue.name, connection=connection)
    assert rq_queue.scheduled_job_registry.key == book.queue.scheduled
    assert rq_queue.scheduled_job_registry.get_job_ids() == []
    assert rq_queue.get_job_ids() == [job_id]


# ------------------------------------------------------------------ taking a backlog


def test_start_without_a_first_id_pops_and_starts_the_batch_itself(
    connection: redis.Redis, book: Book, model_name: str
) -> None:
    ids = push_many(connection, model_name, 5)
    connection.rpush(book.queue.intermediate, "someone-elses")  # not this call's: left alone
    started, skipped, left = start_script(connection, book, b"", 3, inline=65536)
    assert [s.job_id for s in started] == ids[:3] and skipped == [] and left == 2
    assert all(s.frame == wire.encode_request(X) for s in started)  # every frame inline, none read beside
    assert len({s.execution_id for s in started}) == 3
    assert connection.lrange(book.queue.intermediate, 0, -1) == [b"someone-elses"]
    assert connection.zcard(book.queue.started) == 3
    assert all(connection.hget(keys.job_key(i), "status") == b"started" for i in ids[:3])
    started, _, left = start_script(connection, book, b"", 3, inline=65536)
    assert [s.job_id for s in started] == ids[3:] and left == 0


def test_a_take_after_a_start_that_left_a_backlog_needs_no_blmove(
    connection: redis.Redis, book: Book, model_name: str, settings: Settings
) -> None:
    from ortq.worker.intake import Intake

    ids = push_many(connection, model_name, 20)
    intake = Intake(connection, book, settings, max_batch=8, max_wait=0.0)
    connection.config_resetstat()
    batches = [intake.take(block=False) for _ in range(4)]
    moves = connection.info("commandstats").get("cmdstat_lmove", {}).get("calls", 0)
    # The first take moves one job and pops 7 more; the next two pop theirs in the start script
    # alone; the fourth finds the queue empty (its start left nothing) and asks LMOVE again.
    assert [len(b or []) for b in batches[:3]] == [8, 8, 4] and batches[3] is None
    assert moves == 2
    taken = [t for batch in batches[:3] for t in batch or []]
    assert [t.started.job_id for t in taken] == ids
    assert all(t.frame == wire.encode_request(X) for t in taken)
    assert connection.zcard(book.queue.started) == 20 and connection.llen(book.queue.intermediate) == 0


def test_a_take_is_one_round_trip_and_reloads_the_scripts_redis_lost(
    connection: redis.Redis, book: Book, model_name: str, settings: Settings
) -> None:
    from ortq.worker.intake import Intake

    ids = push_many(connection, model_name, 24)
    intake = Intake(connection, book, settings, max_batch=8, max_wait=0.0)
    connection.script_flush()  # as a Redis restart does
    connection.config_resetstat()
    first = intake.take(block=False)
    connection.script_flush()
    batches = [first, intake.take(block=False), intake.take(block=False)]
    stats = connection.info("commandstats")
    # redis-py's pipeline would ask SCRIPT EXISTS before each execute: a round trip per take.
    assert "cmdstat_script|exists" not in stats
    assert stats["cmdstat_script|load"]["calls"] == 2  # after each flush, by the take that met it
    taken = [t for batch in batches for t in batch or []]
    assert [t.started.job_id for t in taken] == ids
    assert all(t.frame == wire.encode_request(X) for t in taken)
    assert connection.zcard(book.queue.started) == 24


def test_a_drained_backlog_is_answered_with_outputs_equal_to_a_direct_run(
    tiny_path: Path, model_name: str, settings: Settings, connection: redis.Redis
) -> None:
    with Producer(settings=settings, allow_unknown_models=True) as producer:
        inputs = [{"x": np.random.default_rng(i).random((1 + i % 3, 4), np.float32)} for i in range(60)]
        handles = producer.submit_many(model_name, inputs)  # queued before any worker: a backlog
        worker = make_worker(tiny_path, model_name, settings, max_batch=8, rows_independent=True, burst=True)
        assert worker.serve(handle_signals=False) == 0
        outputs = producer.results(handles, timeout=30)
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    for given, got in zip(inputs, outputs, strict=True):
        [expected] = session.run(None, given)
        np.testing.assert_allclose(got["y"], expected, rtol=1e-6)
    assert connection.zcard(Book(connection, "any", keys.queue_name(model_name)).queue.finished) == 60


def test_a_replier_behind_the_runs_holds_the_worker_back_instead_of_piling_up_jobs(
    tiny_path: Path, model_name: str, settings: Settings, connection: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ortq.worker.overlap import REPLIES_WAITING, SLOTS_WITH_BACKLOG

    finish = Book.finish

    def slow_finish(self: Book, *args: object, **kwargs: object) -> int:
        time.sleep(0.02)  # as a Redis busy with other workers' scripts answers late
        return finish(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Book, "finish", slow_finish)
    started = Book(connection, "any", keys.queue_name(model_name)).queue.started
    most, done = 0, threading.Event()

    def watch() -> None:
        nonlocal most
        while not done.is_set():
            most = max(most, connection.zcard(started))
            time.sleep(0.002)

    with Producer(settings=settings, allow_unknown_models=True) as producer:
        inputs = [{"x": np.random.default_rng(i).random((1, 4), np.float32)} for i in range(240)]
        handles = producer.submit_many(model_name, inputs)
        watcher = threading.Thread(target=watch)
        watcher.start()
        worker = make_worker(tiny_path, model_name, settings, max_batch=4, rows_independent=True, burst=True)
        try:
            assert worker.serve(handle_signals=False) == 0
        finally:
            done.set()
            watcher.join()
        outputs = producer.results(handles, timeout=30)
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    for given, got in zip(inputs, outputs, strict=True):
        np.testing.assert_allclose(got["y"], session.run(None, given)[0], rtol=1e-6)
    # Batches of 4 jobs: those in the feeder's slots, those waiting for the replier, the one it
    # answers and the one the main thread waits to hand over. The runs take ~0.1 ms and the answers
    # 20 ms: without the bound nearly every job would be started at once.
    assert 0 < most <= 4 * (SLOTS_WITH_BACKLOG + REPLIES_WAITING + 2)


def test_slots_allow_a_third_batch_only_up_to_the_limit_asked() -> None:
    from ortq.worker.overlap import Slots

    slots = Slots()
    assert slots.acquire(2, timeout=0.01) and slots.acquire(2, timeout=0.01)
    assert not slots.acquire(2, timeout=0.01)  # no backlog: the batch running and one waiting
    assert slots.acquire(3, timeout=0.01)  # a backlog: one more being taken
    assert not slots.acquire(3, timeout=0.01)
    slots.release()
    assert not slots.acquire(2, timeout=0.01) and slots.acquire(3, timeout=0.01)


def test_jobs_a_lost_backlog_start_took_are_taken_back_by_the_same_worker(
    tiny_path: Path, model_name: str, settings: Settings, connection: redis.Redis
) -> None:
    # A take under a backlog is one start script, no BLMOVE first: if its reply is lost, the jobs
    # are started in this worker's name and held by nobody. The worker takes them back itself.
    name = f"w-{uuid.uuid4().hex[:8]}"
    with Producer(settings=settings, allow_unknown_models=True) as producer:
        inputs = [{"x": np.random.default_rng(i).random((1, 4), np.float32)} for i in range(4)]
        handles = producer.submit_many(model_name, inputs)
        started, _, _ = start_script(connection, Book(connection, name, keys.queue_name(model_name)), b"", 8)
        assert len(started) == 4 and connection.llen(keys.queue_key(model_name)) == 0  # the reply "lost"
        running = Serving(make_worker(tiny_path, model_name, settings, worker_name=name))
        try:
            outputs = producer.results(handles, timeout=30)
        finally:
            running.stop()
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    for given, got in zip(inputs, outputs, strict=True):
        np.testing.assert_allclose(got["y"], session.run(None, given)[0], rtol=1e-6)
    assert all(connection.hget(keys.job_key(h.id), "ortq_recoveries") == b"1" for h in handles)


def test_frames_past_large_frame_go_through_both_producers_and_back(
    serving: Serving, producer: Producer, model_name: str, tiny_path: Path, settings: Settings
) -> None:
    # Requests and responses of 5,000 x 4 floats (80 KB) are sent as memoryviews (frame_argument)
    # where redis-py sends those as they are: the producers' SET and the worker's finish call then
    # pack them in chunks, not copied.
    from ortq import AsyncProducer
    from ortq import settings as ortq_settings
    from ortq.settings import LARGE_FRAME, frame_argument

    inputs = [{"x": np.random.default_rng(i).random((5000, 4), np.float32)} for i in range(3)]
    large = memoryview if ortq_settings._MEMORYVIEWS_WHOLE else bytes
    assert all(type(frame_argument(wire.encode_request(i))) is large for i in inputs)
    assert isinstance(frame_argument(b"small"), bytes) and len(wire.encode_request(X)) < LARGE_FRAME
    got = [producer.infer(model_name, inputs[0], timeout=30)]
    got += producer.results(producer.submit_many(model_name, inputs[1:]), timeout=30)

    async def from_asyncio() -> dict[str, np.ndarray]:
        async with AsyncProducer(settings=settings) as aio:
            return await aio.infer(model_name, inputs[2], timeout=30)

    got.append(asyncio.run(from_asyncio()))
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    for given, outputs in zip([*inputs, inputs[2]], got, strict=True):
        assert outputs["y"].nbytes >= LARGE_FRAME
        np.testing.assert_allclose(outputs["y"], session.run(None, given)[0], rtol=1e-6)


def test_memoryviews_are_used_only_where_redis_py_sends_them_as_they_are() -> None:
    # redis-py 8.2's hiredis packer hands a command with a memoryview to its Python packer, which
    # sends it as it is; 8.1's copied each memoryview into bytes first (one copy more, not fewer).
    # What the installed redis-py does is observed here, not worked out the way ortq works it out.
    from ortq.settings import LARGE_FRAME, frame_argument

    frame = bytes(LARGE_FRAME)

    def sent_as_it_is(argument: bytes | memoryview) -> bool:
        chunks = redis.Connection().pack_command("SET", "k", argument)
        return any(isinstance(chunk, memoryview) and chunk.obj is frame for chunk in chunks)

    whole = sent_as_it_is(memoryview(frame))
    assert isinstance(frame_argument(frame), memoryview) is whole
    assert sent_as_it_is(frame_argument(frame)) is whole
    assert type(frame_argument(frame[: LARGE_FRAME - 1])) is bytes  # small frames: hiredis packs them faster

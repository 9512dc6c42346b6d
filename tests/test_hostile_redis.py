"""Redis is hostile input: every key ortq reads may hold any type, any size, any content, written by
anyone the ACL lets write it. Each case here attacks a real ``ortq worker`` (the tiny model,
batching on) through raw Redis commands, then checks that:

* the worker is still running and serves a good job bit-exact (against a direct ``session.run``)
  within BOUND seconds;
* the hostile job, where it names a job a producer could wait on, was answered once, with a typed
  error (or its outputs, where it was in fact a good job);
* no Redis script ran longer than SLOW_MS (Redis's SLOWLOG, read after each case): nothing an
  attacker writes makes a script slower than linear in what it touches.
"""

from __future__ import annotations

import json
import secrets
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys, wire
from ortq.errors import CorruptRecord, ResponseMismatch
from ortq.info import MOST_SIGNATURE_BYTES, collect, format_info
from ortq.producer import Producer
from ortq.rqcompat import layout, records
from ortq.rqcompat.book import Book
from ortq.settings import Settings
from ortq.worker.upkeep import Upkeep
from tests.conftest import WorkerProcesses, eventually, wait_for_process
from tests.test_fuzz import answer, answers, job_fields

#: Seconds within which a good job is served again after an attack.
BOUND = 20.0
#: The longest any ortq script may run, attack or not (Redis's SLOWLOG threshold, ms).
SLOW_MS = 100
#: max_frame_bytes of the attacked worker (the RSS case pushes frames far larger).
FRAME_LIMIT = 1 << 20
X = np.arange(8, dtype=np.float32).reshape(2, 4)


@dataclass
class Served:
    model: str
    url: str
    r: redis.Redis
    producer: Producer
    workers: WorkerProcesses
    session: ort.InferenceSession

    @property
    def process(self) -> object:
        return self.workers.processes[0][0]

    def alive(self) -> None:
        process = self.workers.processes[0][0]
        assert process.poll() is None, f"the worker exited with {process.returncode}:\n{self.workers.logs()[-6000:]}"

    def serves_a_good_job(self) -> None:
        """A good job comes back bit-exact within BOUND seconds (submits retried while the attack
        still breaks them: a queue key of the wrong type is replaced within a beat or two)."""
        self.alive()
        x = np.random.default_rng().standard_normal((3, 4)).astype(np.float32)
        deadline = time.monotonic() + BOUND
        while True:
            try:
                outputs = self.producer.infer(self.model, {"x": x}, timeout=max(0.1, deadline - time.monotonic()))
                break
            except CorruptRecord:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        np.testing.assert_array_equal(outputs["y"], self.session.run(None, {"x": x})[0])
        self.alive()

    def push(self, job_id: str | bytes, fields: dict[bytes, bytes] | None = None, frame: bytes | None = None) -> None:
        """A job written with raw commands, as anyone with write access could."""
        raw = job_id.encode() if isinstance(job_id, str) else job_id
        with self.r.pipeline(transaction=True) as pipe:
            if frame is not None:
                pipe.set(keys.request_key(self.model, "").encode() + raw, frame, ex=600)
            if fields is not None:
                pipe.hset(b"rq:job:" + raw, mapping=fields)  # type: ignore[arg-type]
            pipe.rpush(keys.queue_key(self.model), raw)
            pipe.execute()

    def reply(self, job_id: str) -> wire.Response:
        """The one response frame of ``job_id``, found as a producer finds it: the entry its hash's
        ``ortq_answer`` names in the reply stream its ``ortq_reply`` names, the only entry with its
        id there (fails after BOUND seconds without one, or if it was answered more than once)."""
        eventually(lambda: answer(self.r, self.model, job_id) is not None, BOUND)
        frame = answer(self.r, self.model, job_id)
        assert frame is not None
        return wire.decode_response(frame)

    def wait_logged(self, text: str, what: str) -> None:
        """Until the worker's log has ``text`` (fails if the worker exits first, or after a hang)."""
        process, log_path = self.workers.processes[0]
        wait_for_process(process, log_path, what, lambda: text in log_path.read_text(errors="replace"))

    def skipped(self, job_id: str) -> None:
        """Until the worker says it took a queue entry of ``job_id`` and did not start it (its
        "queue entry ... skipped" line): an entry pushed again has then been dealt with."""
        self.wait_logged(f"queue entry {job_id.encode()!r} of {keys.queue_name(self.model)} skipped",
                         f"the worker's line saying it skipped a second entry of job {job_id}")  # fmt: skip

    def failed_with(self, job_id: str, error_type: str) -> None:
        response = self.reply(job_id)
        assert response.error is not None and response.error.type == error_type, response.error


@pytest.fixture(scope="module")
def served(redis_server: object, tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    url = redis_server.url  # type: ignore[attr-defined]
    model = f"hostile-{uuid.uuid4().hex[:8]}"
    group = WorkerProcesses(tmp_path_factory.mktemp("hostile"))
    env = {"ORTQ_HEARTBEAT_SECONDS": "0.5", "ORTQ_MAX_FRAME_BYTES": str(FRAME_LIMIT)}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        group.serve(tiny_path, model, url, 1, "--max-batch", "4", "--rows-independent", "--max-wait-ms", "5")
    r = redis.Redis.from_url(url)
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    producer = Producer(settings=Settings.from_url(url, max_frame_bytes=FRAME_LIMIT))
    try:
        yield Served(model, url, r, producer, group, session)
    finally:
        group.stop_all()
        producer.close()


@pytest.fixture(autouse=True)
def no_slow_script(served: Served) -> Iterator[None]:
    """After each case: no ortq script ran longer than SLOW_MS (attack setup commands are not
    scripts, so only the worker's and producer's EVALSHA/EVAL/FCALL are looked at)."""
    served.r.config_set("slowlog-log-slower-than", SLOW_MS * 1000)
    served.r.slowlog_reset()
    yield
    slow = [
        entry
        for entry in served.r.slowlog_get(128)
        if entry["command"].split()[0].upper() in (b"EVALSHA", b"EVAL", b"FCALL")
    ]
    assert not slow, f"scripts ran longer than {SLOW_MS} ms: {[(e['command'][:80], e['duration']) for e in slow]}"
    served.serves_a_good_job()


def new_id() -> str:
    return str(uuid.uuid4())


# ------------------------------------------------------------------ keys of the wrong type


WRONG_TYPES: dict[str, Callable[[redis.Redis, str], object]] = {
    "string": lambda r, k: r.set(k, "forged"),
    "list": lambda r, k: r.rpush(k, "forged"),
    "hash": lambda r, k: r.hset(k, "forged", "1"),
    "set": lambda r, k: r.sadd(k, "forged"),
    "zset": lambda r, k: r.zadd(k, {"forged": 1}),
    "stream": lambda r, k: r.xadd(k, {"forged": "1"}),
}


@pytest.mark.parametrize("kind", [k for k in WRONG_TYPES if k != "hash"])
def test_a_job_key_that_is_no_hash_is_skipped_and_left_to_expire(served: Served, kind: str) -> None:
    """No hash names a reply stream (``ortq_reply``): such a job is answered nowhere (no producer
    can wait on it), its request deleted and its key left to expire, and the worker serves on."""
    job_id = new_id()
    WRONG_TYPES[kind](served.r, keys.job_key(job_id))
    served.push(job_id, frame=wire.encode_request({"x": X}))
    served.wait_logged(
        f"queue entry {job_id.encode()!r} of {keys.queue_name(served.model)} skipped: its job record "
        f"({layout.job_key('<id>')}) is a {kind}, not a hash",
        f"the worker's line saying it skipped job {job_id}, whose record is a {kind}",
    )
    eventually(lambda: not served.r.exists(keys.request_key(served.model, job_id)), BOUND)
    assert served.r.ttl(keys.job_key(job_id)) > 0  # left to expire
    assert served.r.type(keys.job_key(job_id)).decode() == kind  # not rewritten
    assert not served.r.exists(keys.large_reply_key(served.model, job_id))


@pytest.mark.parametrize("kind", [k for k in WRONG_TYPES if k != "string"])
def test_a_request_key_that_is_no_string_fails_the_job(served: Served, kind: str) -> None:
    job_id = new_id()
    WRONG_TYPES[kind](served.r, keys.request_key(served.model, job_id))
    served.push(job_id, job_fields(served.model))
    served.failed_with(job_id, "InvalidJob")
    eventually(lambda: served.r.hget(keys.job_key(job_id), "status") == b"failed")


@pytest.mark.parametrize(
    "key",
    ["queue", "intermediate", "started", "finished", "failed", "scheduled"],
)
@pytest.mark.parametrize("kind", ["string", "hash"])
def test_queue_and_registry_keys_of_the_wrong_type_are_replaced(served: Served, key: str, kind: str) -> None:
    target = getattr(layout.QueueKeys.of(keys.queue_name(served.model)), key)
    served.r.delete(target)
    WRONG_TYPES[kind](served.r, target)
    # no_slow_script then serves a good job, through all the registries


#: Rows of an input whose response frame is large (over book.STAGED_ANSWER_BYTES): answered in the
#: job's own key (keys.large_reply_key), its reply stream's entry holding an empty frame.
LARGE_ROWS = 5000


@pytest.mark.parametrize(
    ("key", "rows"),
    [
        (lambda model, i, name: layout.results_key(i), 2),
        # the producer's reply stream: a key of another type there is no answer, and is replaced
        (lambda model, i, name: keys.reply_key(model, name), 2),
        (lambda model, i, name: keys.reply_key(model, name), LARGE_ROWS),
        # a large answer's own key: renamed over
        (lambda model, i, name: keys.large_reply_key(model, i), LARGE_ROWS),
        (lambda model, i, name: f"{layout.PREFIX}:executions:{i}", 2),
    ],
    ids=["results", "reply-stream", "reply-stream-large", "large-reply", "executions"],
)
def test_a_jobs_own_records_of_the_wrong_type_do_not_stop_its_answer(
    served: Served, key: Callable[[str, str, str], str], rows: int
) -> None:
    job_id, name = new_id(), keys.new_reply_name(600)
    x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    served.r.set(key(served.model, job_id, name), "forged")
    served.push(job_id, job_fields(served.model, name), wire.encode_request({"x": x}))
    response = served.reply(job_id)
    np.testing.assert_array_equal(response.outputs["y"], served.session.run(None, {"x": x})[0])
    assert served.r.type(keys.reply_key(served.model, name)) == b"stream"
    assert served.r.xlen(keys.reply_key(served.model, name)) == 1  # the forged key replaced, not added to
    if rows == LARGE_ROWS:  # its frame in its own key, the entry in its reply stream empty
        [(_, entry)] = served.r.xrange(keys.reply_key(served.model, name))
        assert entry == {b"id": job_id.encode(), b"frame": b""}
        assert served.r.xlen(keys.large_reply_key(served.model, job_id)) == 1
    eventually(lambda: served.r.hget(keys.job_key(job_id), "status") == b"finished")
    eventually(lambda: served.r.type(layout.results_key(job_id)) == b"stream")


@contextmanager
def held_in_the_queue(served: Served) -> Iterator[None]:
    """The worker takes no job meanwhile (RQ's suspension): a job submitted inside waits in its
    queue. Entered once the worker has said it is suspended (its RQ state)."""
    name = served.producer.workers(served.model)[0]["name"]
    served.r.set(layout.suspended_key(), 1)
    try:
        eventually(lambda: served.r.hget(layout.worker_key(name), "state") == b"suspended", BOUND)
        yield
    finally:
        served.r.delete(layout.suspended_key())


def _forge(served: Served, stream: str, job_id: str, what: str) -> None:
    """Write ``what`` into the producer's reply stream ``stream`` for job ``job_id``, as anyone
    who may write it could (under the documented ACL rules: workers alone)."""
    words = "CALL-555-0100-TO-RESTORE-YOUR-ACCOUNT"
    other_proof = wire.proof_of(served.model, secrets.token_bytes(16))
    frames = {
        "outputs-without-proof": wire.encode_response({"y": np.zeros((2, 4), np.float32)}),
        "outputs-of-another-request": wire.encode_response({"y": np.zeros((2, 4), np.float32)}, proof=other_proof),
        "error-in-the-attackers-words": wire.encode_error("InvalidInput", words),
        "garbage": b"ORTQ not a frame",
        "large-answer-of-the-wrong-type": b"",  # an empty frame: the answer is in the job's own key
    }
    if what == "stream-of-the-wrong-type":
        served.r.delete(stream)
        served.r.set(stream, "forged", ex=600)
        return
    if what == "large-answer-of-the-wrong-type":
        served.r.set(keys.large_reply_key(served.model, job_id), "forged", ex=600)
    served.r.xadd(stream, {keys.REPLY_ID_FIELD: job_id.encode(), keys.REPLY_FRAME_FIELD: frames[what]})


@pytest.mark.parametrize(
    ("what", "refused", "words"),
    [
        ("outputs-without-proof", ResponseMismatch, "carries no proof"),
        ("outputs-of-another-request", ResponseMismatch, "the proof of another request"),
        ("error-in-the-attackers-words", ResponseMismatch, "carries no proof"),
        ("garbage", CorruptRecord, "no valid response frame"),
        ("large-answer-of-the-wrong-type", CorruptRecord, "large answer of job"),
        ("stream-of-the-wrong-type", CorruptRecord, "holds no stream"),
    ],
)
def test_forged_answers_in_a_producers_reply_stream_are_refused(
    served: Served, what: str, refused: type[Exception], words: str
) -> None:
    """A producer's reply stream (keys.reply_key of its reply name) written by someone else before
    its job's answer: an entry with the job's id whose frame does not answer the job's request is
    refused (ResponseMismatch, or CorruptRecord for no frame at all), never taken for outputs or
    for an error of the worker's; a stream, or a large answer's key, of another type is
    CorruptRecord at once (no wait to the timeout). The job's real answer then replaces the key."""
    stream = keys.reply_key(served.model, served.producer.reply_name)
    with held_in_the_queue(served):
        job = served.producer.submit(served.model, {"x": X})
        _forge(served, stream, job.id, what)
        started = time.monotonic()
        with pytest.raises(refused, match=words):
            job.result(timeout=BOUND)
        assert time.monotonic() - started < BOUND / 2
    # its worker answers it after all, in its stream (of the right type again): the entry its hash names
    eventually(lambda: served.r.hget(keys.job_key(job.id), "status") == b"finished", BOUND)
    assert served.r.type(stream) == b"stream"
    entry = served.r.hget(keys.job_key(job.id), "ortq_answer")
    [(_, fields)] = served.r.xrange(stream, entry, entry)
    assert fields[keys.REPLY_ID_FIELD] == job.id.encode()
    assert wire.decode_response(fields[keys.REPLY_FRAME_FIELD]).proof == job.proof


def test_a_last_high_key_of_the_wrong_type_does_not_stop_high_priority(served: Served) -> None:
    served.r.delete(keys.last_high_key(served.model))
    served.r.rpush(keys.last_high_key(served.model), "forged")
    job = served.producer.submit(served.model, {"x": X}, priority="high")
    np.testing.assert_array_equal(job.result(timeout=BOUND)["y"], served.session.run(None, {"x": X})[0])


@pytest.mark.parametrize(
    "key",
    [
        lambda s: keys.WORKERS_SET,
        lambda s: layout.workers_key(),
        lambda s: layout.QueueKeys.of(keys.queue_name(s.model)).workers,
        lambda s: layout.worker_key(s.producer.workers(s.model)[0]["name"]),
        lambda s: keys.signature_key(s.model),
        lambda s: keys.SIGNATURES_SET,
        lambda s: keys.worker_key(s.producer.workers(s.model)[0]["name"]),
    ],
    ids=["ortq-workers", "rq-workers", "rq-queue-workers", "rq-worker", "signature", "signatures", "ortq-worker"],
)
def test_worker_records_of_the_wrong_type_are_rewritten(served: Served, key: Callable[[Served], str]) -> None:
    name = key(served)
    with served.r.pipeline() as pipe:  # one MULTI: a heartbeat between the two would write the set again
        pipe.delete(name)
        pipe.rpush(name, "forged")
        pipe.execute()
    eventually(lambda: served.r.type(name) != b"list", BOUND)
    eventually(lambda: len(served.producer.workers(served.model)) == 1, BOUND)


def test_the_models_are_found_without_the_signatures_set_or_with_junk_in_it(served: Served) -> None:
    """ortq info and the exporter read the workers' set of signature records; without it (workers
    from before it) they SCAN for them; members that name no record, or no model, are left out."""

    def found() -> dict[str, Any]:
        return {m["model"]: m["signature"] for m in collect(served.r)["models"]}

    assert found()[served.model] is not None
    junk = {"gone-model", "bad name!", "x" * 300}
    served.r.sadd(keys.SIGNATURES_SET, *junk)
    shown = found()  # (other tests' models may share this Redis)
    assert served.model in shown and not junk & set(shown)  # no record, no queue, no worker: not a model
    served.r.delete(keys.SIGNATURES_SET)
    assert found()[served.model] is not None  # by SCAN
    eventually(lambda: served.r.exists(keys.SIGNATURES_SET) == 1, BOUND)  # the next heartbeat writes it again


def test_junk_queue_names_do_not_become_models_and_are_said_to_be_skipped(served: Served) -> None:
    """Producers may SADD any name to RQ's queue set: 10,000 names made 10,000 models (and 40,006
    series a scrape). Only queues that a worker or signature names, or that have jobs waiting, are
    models, a bounded number of the others is looked at, and ortq info says how many were not."""
    unserved = f"unserved-{uuid.uuid4().hex[:8]}"  # enqueued for before any worker served it
    served.r.rpush(keys.queue_key(unserved), "some-job")
    junk = [keys.queue_key(f"junk-{uuid.uuid4().hex[:6]}-{i}") for i in range(10_000)]
    try:
        served.r.sadd(keys.RQ_QUEUES_SET, keys.queue_key(unserved))
        info = collect(served.r)
        shown = {m["model"] for m in info["models"]}
        assert served.model in shown and unserved in shown and info["skipped_queues"] == 0
        served.r.sadd(keys.RQ_QUEUES_SET, *junk)
        info = collect(served.r)
        shown = {m["model"] for m in info["models"]}
        assert served.model in shown and not any(name.startswith("junk-") for name in shown)
        assert info["skipped_queues"] >= 10_000 - 200, info["skipped_queues"]
        assert f"note: {info['skipped_queues']} member(s) of RQ's queue set" in format_info(info)
    finally:
        served.r.srem(keys.RQ_QUEUES_SET, *junk, keys.queue_key(unserved))
        served.r.delete(keys.queue_key(unserved))


def test_readers_hold_a_bounded_part_of_huge_signature_records(served: Served) -> None:
    """Signature records of 1 MiB each (anyone with write access may write them): ortq info, the
    exporter and the dashboard (collect) read each one only up to MOST_SIGNATURE_BYTES, a round of
    them at a time, and show it as unreadable; one MGET of them all held every byte at once."""
    names = [f"huge-{uuid.uuid4().hex[:8]}-{i}" for i in range(40)]
    with served.r.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.set(keys.signature_key(name), b"{" + b" " * (1 << 20) + b"}", ex=300)
        pipe.sadd(keys.SIGNATURES_SET, *names)
        pipe.execute()
    try:
        tracemalloc.start()
        shown = {m["model"]: m["signature"] for m in collect(served.r)["models"]}
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        served.r.srem(keys.SIGNATURES_SET, *names)
        served.r.delete(*(keys.signature_key(name) for name in names))
    assert all(name in shown and shown[name] is None for name in names)  # shown, as unreadable
    assert shown[served.model] is not None
    # 40 MiB of records, at most MOST_SIGNATURE_BYTES (+1) of each read: 2.5 MiB, and what parsing adds.
    assert peak < 40 * MOST_SIGNATURE_BYTES + (1 << 20), peak


def test_pruning_a_queues_workers_removes_the_dead_and_skips_what_no_worker_wrote(
    connection: redis.Redis, model_name: str
) -> None:
    """records.prune_workers, which the upkeep runs (RQ's clean_worker_registry): a registered worker
    whose hash is gone leaves both registration sets; a live one stays; a member longer than any
    worker key is neither fetched for a lookup nor fails the pass; another type there is no set."""
    queue = layout.QueueKeys.of(keys.queue_name(model_name))
    live, dead, huge = layout.worker_key(f"{model_name}-live"), layout.worker_key(f"{model_name}-dead"), "w" * 5000
    connection.hset(live, "state", "idle")
    connection.sadd(queue.workers, live, dead, huge)
    connection.sadd(layout.workers_key(), live, dead)
    assert records.prune_workers(connection, queue.name) == 1
    assert connection.smembers(queue.workers) == {live.encode(), huge.encode()}
    assert not connection.sismember(layout.workers_key(), dead) and connection.sismember(layout.workers_key(), live)
    connection.delete(queue.workers)
    connection.rpush(queue.workers, "forged")
    assert records.prune_workers(connection, queue.name) == 0
    connection.delete(queue.workers, live)
    connection.srem(layout.workers_key(), live)


# ------------------------------------------------------------------ entries and records


def test_a_job_pushed_twice_is_answered_once(served: Served) -> None:
    job_id = new_id()
    served.push(job_id, job_fields(served.model), wire.encode_request({"x": X}))
    served.r.rpush(keys.queue_key(served.model), job_id)
    response = served.reply(job_id)
    assert response.ok
    served.skipped(job_id)  # the second entry taken and not run: it must not answer again
    eventually(lambda: served.r.xlen(layout.results_key(job_id)) >= 1, 60)  # RQ's result, just after the reply
    assert len(answers(served.r, served.model, job_id)) == 1
    assert served.r.xlen(layout.results_key(job_id)) == 1


def test_a_finished_job_pushed_again_is_not_run_again(served: Served) -> None:
    job = served.producer.submit(served.model, {"x": X})
    first = job.result(timeout=BOUND)
    eventually(lambda: served.r.xlen(layout.results_key(job.id)) == 1)
    served.r.rpush(keys.queue_key(served.model), job.id)
    served.skipped(job.id)  # the entry pushed again taken and not run
    assert served.r.xlen(layout.results_key(job.id)) == 1 and len(answers(served.r, served.model, job.id)) == 1
    np.testing.assert_array_equal(job.result(timeout=1)["y"], first["y"])
    assert job.status() == "finished"


@pytest.mark.parametrize(
    "entry",
    ["job.1", "a" * 200, "with space", b"\xff\xfe", "x" * 600],
    ids=["dot", "long", "space", "binary", "very-long"],
)
def test_entries_that_are_no_job_id_are_dropped_and_nothing_is_written_for_them(
    served: Served, entry: str | bytes
) -> None:
    """No producer can enqueue such an id, so no answer is written for one (100,000 of them used
    to cost 436 MiB of replies for a day), not even in the reply stream its hash names, and no
    record is touched."""
    raw = entry if isinstance(entry, bytes) else entry.encode()
    large = keys.large_reply_key(served.model, "").encode() + raw
    fields = job_fields(served.model)
    served.r.delete(b"rq:job:" + raw, large)  # other tests of this Redis use such ids too
    served.r.hset(b"rq:job:" + raw, mapping=fields)  # type: ignore[arg-type]
    served.push(entry)
    eventually(lambda: served.r.llen(keys.queue_key(served.model)) == 0, BOUND)
    served.serves_a_good_job()  # taken after the entry: the entry has been dealt with
    assert not served.r.exists(large, keys.reply_key(served.model, fields[b"ortq_reply"].decode()))
    assert served.r.ttl(b"rq:job:" + raw) == -1 and served.r.hgetall(b"rq:job:" + raw) == fields


@pytest.mark.parametrize(
    "fields",
    [
        {b"timeout": b"1e300", b"ttl": b"nan", b"result_ttl": b"-5", b"failure_ttl": b"inf"},
        {b"retries_left": b"1000000000", b"retry_intervals": b"[1e400, -3, true]", b"ortq_recoveries": b"x"},
        {b"enqueued_at": b"not a time", b"created_at": b"\xff\xfe"},
        {b"description": b"d" * (1 << 20)},  # large, but not read
    ],
    ids=["numbers", "retries", "timestamps", "large-unread-field"],
)
def test_forged_fields_do_not_stop_a_good_job(served: Served, fields: dict[bytes, bytes]) -> None:
    job_id = new_id()
    served.push(job_id, {**job_fields(served.model), **fields}, wire.encode_request({"x": X}))
    response = served.reply(job_id)
    np.testing.assert_array_equal(response.outputs["y"], served.session.run(None, {"x": X})[0])


@pytest.mark.parametrize(
    "name",
    [None, b"", b"a.0", b"a.05", b"x" * 65 + b".5", b"a.123456789", b"\xc3\xbc.5", b"\xff.5"],
    ids=["none", "empty", "keep-0", "leading-zero", "long-token", "long-keep", "utf8", "not-utf8"],
)
def test_a_job_naming_no_reply_stream_fails_alone_and_is_answered_nowhere(served: Served, name: bytes | None) -> None:
    """``ortq_reply`` missing (a producer of another protocol) or no reply name (rewritten by anyone
    who may write job hashes): the job fails InvalidJob before it runs, answered nowhere (no stream
    is made for the name), and the good job taken in the same batch is served as if it were alone."""
    hostile, good = new_id(), new_id()
    fields = job_fields(served.model)
    if name is None:
        del fields[b"ortq_reply"]
    else:
        fields[b"ortq_reply"] = name
    frame = wire.encode_request({"x": X})
    with served.r.pipeline(transaction=True) as pipe:  # one MULTI: the worker takes both in one batch
        for job_id, record in ((hostile, fields), (good, job_fields(served.model))):
            pipe.set(keys.request_key(served.model, job_id), frame, ex=600)
            pipe.hset(keys.job_key(job_id), mapping=record)  # type: ignore[arg-type]
            pipe.rpush(keys.queue_key(served.model), job_id)
        pipe.execute()
    response = served.reply(good)
    assert response.error is None, response.error
    np.testing.assert_array_equal(response.outputs["y"], served.session.run(None, {"x": X})[0])
    failed = layout.QueueKeys.of(keys.queue_name(served.model)).failed
    eventually(lambda: served.r.hget(keys.job_key(hostile), "status") == b"failed", BOUND)
    assert served.r.zscore(failed, hostile) is not None and served.r.hget(keys.job_key(hostile), "ortq_answer") is None
    assert not served.r.exists(keys.request_key(served.model, hostile), keys.large_reply_key(served.model, hostile))
    if name:
        assert not served.r.exists(keys.reply_key(served.model, "").encode() + name)
    served.wait_logged(f"job {hostile} failed: InvalidJob", f"the worker's line saying job {hostile} failed")


def test_an_oversized_field_that_is_read_fails_the_job(served: Served) -> None:
    job_id = new_id()
    served.push(job_id, {**job_fields(served.model), b"data": b"\x00" * (1 << 20)}, wire.encode_request({"x": X}))
    served.failed_with(job_id, "InvalidJob")


def test_a_hash_with_a_hundred_thousand_fields(served: Served) -> None:
    job_id = new_id()
    served.r.hset(keys.job_key(job_id), mapping={f"f{i}": i for i in range(100_000)})
    served.push(job_id, job_fields(served.model), wire.encode_request({"x": X}))
    assert served.reply(job_id).ok


def test_sixty_thousand_forged_intermediate_entries_block_nothing(served: Served) -> None:
    intermediate = layout.QueueKeys.of(keys.queue_name(served.model)).intermediate
    for start in range(0, 60_000, 10_000):
        served.r.rpush(intermediate, *[f"forged-{i}" for i in range(start, start + 10_000)])
    served.serves_a_good_job()
    # Worked through in bounded steps (1,000 entries a call), never in one long script.
    eventually(lambda: served.r.llen(intermediate) == 0, 60)


def test_commands_on_the_workers_channel_do_not_stop_it(served: Served) -> None:
    name = served.producer.workers(served.model)[0]["name"]
    channel = layout.pubsub_channel(name)
    unreadable, other = "ignoring an unreadable command on", "ignoring command 'kill-horse'"
    before = served.workers.logs().count(unreadable)
    for payload in (b"not json", b"[1, 2]", b"{" * 100_000, json.dumps({"command": "kill-horse"}).encode()):
        assert served.r.publish(channel, payload) == 1, "the worker is not subscribed to its channel"
    # The worker read all four (in order: the last one's line comes after the others').
    served.wait_logged(other, "the worker's line for the 'kill-horse' command")
    assert served.workers.logs().count(unreadable) == before + 3, served.workers.logs()[-4000:]
    served.serves_a_good_job()


def test_frames_far_over_the_limit_are_refused_without_being_read(served: Served) -> None:
    """Six 64 MiB request frames against a 1 MiB limit: each fails PayloadTooLarge, and the
    worker's peak memory grows by far less than one of them (GETRANGE reads at most limit + 1)."""
    pid = served.producer.workers(served.model)[0]["pid"]
    before = _peak_rss(pid)
    big = b"ORTQ" + b"\x00" * (64 << 20)
    ids = [new_id() for _ in range(6)]
    with served.r.pipeline(transaction=True) as pipe:
        for job_id in ids:
            pipe.set(keys.request_key(served.model, job_id), big, ex=600)
            pipe.hset(keys.job_key(job_id), mapping=job_fields(served.model))  # type: ignore[arg-type]
            pipe.rpush(keys.queue_key(served.model), job_id)
        pipe.execute()
    for job_id in ids:
        served.failed_with(job_id, "PayloadTooLarge")
    grown = _peak_rss(pid) - before
    assert grown < 32 << 20, f"peak RSS grew by {grown >> 20} MiB for frames it must not read"


def _peak_rss(pid: int) -> int:
    """VmHWM: the process's peak resident memory so far, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


# ------------------------------------------------------------------ bounded upkeep

#: The longest one maintenance or recovery call may take in Redis (issue 25: "each call bounded"):
#: ~2 ms alone, and up to ~12 ms seen on the CI VM under xdist, where the slow log's wall time
#: counts a descheduled redis-server too; the one call for everything it replaced took ~100 ms.
UPKEEP_MS = 20


def _slow_commands(served: Served) -> list[tuple[bytes, int]]:
    """The scripts and commands the slow log holds (its threshold set by the caller)."""
    return [(e["command"][:60], e["duration"]) for e in served.r.slowlog_get(256) if b"ZADD" not in e["command"][:5]]


def test_two_hundred_thousand_expired_canceled_entries_are_removed_in_short_calls(served: Served) -> None:
    """A producer may ZADD to its model's canceled registry (cancel needs it). The registry cleanup
    removed every expired entry in one call: 2 million blocked Redis for 0.8-1 s, every minute.
    Now each call removes at most book.MAINTAIN_LIMIT a registry, in a few milliseconds, and the
    upkeep calls again (a few calls a second) until none is left.

    The slow log times a call in wall time, so a redis-server that the OS deschedules mid-script (on
    a machine busy with other tests: pytest-xdist) logs a short call as slow. The scenario is tried
    up to five times and passes on a try without a slow call; a call that is slow for its own work
    (one call for every entry: ~100 ms here) is slow on every try."""
    canceled = layout.QueueKeys.of(keys.queue_name(served.model)).canceled
    tries: list[list[tuple[bytes, int]]] = []
    try:
        while len(tries) < 5:
            for start in range(0, 200_000, 20_000):
                served.r.zadd(canceled, {f"junk-{i}": 1 for i in range(start, start + 20_000)})
            served.r.config_set("slowlog-log-slower-than", UPKEEP_MS * 1000)
            served.r.slowlog_reset()
            book = Book(served.r, "hostile-upkeep", keys.queue_name(served.model))
            upkeep = Upkeep(book, Settings.from_url(served.url))
            runs = 0
            while served.r.zcard(canceled) and runs < 100:
                upkeep.maintain()  # as the worker's heartbeat thread does, once its registries are due
                runs += 1
            assert served.r.zcard(canceled) == 0 and runs <= 10, runs  # 10 calls a run, 2,000 entries each
            tries.append(_slow_commands(served))
            if not tries[-1]:
                break
        assert tries[-1] == [], tries
    finally:
        served.r.config_set("slowlog-log-slower-than", SLOW_MS * 1000)
        served.r.slowlog_reset()  # judged above at UPKEEP_MS, not again by no_slow_script at SLOW_MS


def test_a_thousand_malformed_started_entries_do_not_stop_the_recovery_of_a_dead_workers_job(
    served: Served,
) -> None:
    """The recovery looked at the first thousand entries of the started registry only: a thousand
    that are no job's execution there (anyone with write access) hid every dead worker's job behind
    them for good. Now it walks the whole registry, removing such entries as it meets them."""
    started = layout.QueueKeys.of(keys.queue_name(served.model)).started
    served.r.zadd(started, {f"forged entry {i}": 1 for i in range(1000)})  # ranked first
    served.r.zadd(started, {b"\xff\xfe:" + bytes([i]) * 40: 2 for i in range(1, 50)})
    job_id, execution, nonce = new_id(), uuid.uuid4().hex, b"n" * 16
    fields = {**job_fields(served.model), b"status": b"started"}
    served.push(job_id, fields, wire.encode_request({"x": X}, {"nonce": nonce}))
    served.r.lrem(keys.queue_key(served.model), 0, job_id)  # started by a worker that died: not queued
    served.r.hset(f"rq:execution:{job_id}:{execution}", mapping={"id": execution, "worker_name": "ghost"})
    served.r.zadd(started, {f"{job_id}:{execution}": time.time() + 600})
    response = served.reply(job_id)
    assert response.proof == wire.proof_of(served.model, nonce)
    np.testing.assert_array_equal(response.outputs["y"], served.session.run(None, {"x": X})[0])
    eventually(lambda: served.r.zcard(started) == 0, BOUND)  # the forged entries removed too


def test_ten_thousand_queue_entries_that_are_no_job_id_leave_no_reply_streams(served: Served) -> None:
    """Each used to get a ~4.4 KB reply stream kept for a day (100,000: 436 MiB). Ids with a dot
    are what a reply name looks like (``<token>.<keep>``): none becomes a stream either."""
    replies = keys.reply_key(served.model, "*")
    before = set(served.r.scan_iter(match=replies, count=1000))
    for start in range(0, 10_000, 2_000):
        entries = [f"not.an.id-{i}" if i % 2 else f"{uuid.uuid4().hex}.{i + 1}" for i in range(start, start + 2_000)]
        served.r.rpush(keys.queue_key(served.model), *entries)
    eventually(lambda: served.r.llen(keys.queue_key(served.model)) == 0, 60)
    served.serves_a_good_job()  # its answer: in its producer's reply stream, which may be new
    made = set(served.r.scan_iter(match=replies, count=1000)) - before
    assert made <= {keys.reply_key(served.model, served.producer.reply_name).encode()}, sorted(made)[:5]

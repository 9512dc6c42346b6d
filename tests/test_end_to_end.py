"""Producer -> real Redis -> real ``ortq worker`` processes -> producer, compared with direct ONNX Runtime."""

from __future__ import annotations

import base64
import time
import zlib
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys
from ortq.demo import HOLDOUT_PATH, MODEL_PATH
from ortq.errors import CorruptRecord, InferenceFailed, InvalidInput, ResponseMismatch, ResultTimeout
from ortq.producer import Producer
from ortq.producer.enqueue import JobOptions, add_enqueue
from ortq.rqcompat import layout
from ortq.serializer import MsgpackSerializer
from ortq.settings import Settings
from ortq.wire import encode_request, encode_response, proof_of
from tests.conftest import WorkerProcesses, eventually

#: The end-to-end subset that scripts/test.sh also runs under RQ 2.12.
pytestmark = pytest.mark.rqcompat


def direct(model_path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def test_digits_outputs_equal_direct_session_run(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str
) -> None:
    workers.serve(MODEL_PATH, model_name, redis_url)
    holdout = np.load(HOLDOUT_PATH)
    batch = holdout["pixels"][:16]
    outputs = producer.infer(model_name, {"pixels": batch}, timeout=30)
    expected = direct(MODEL_PATH, {"pixels": batch})
    assert set(outputs) == {"probabilities", "label"}
    np.testing.assert_allclose(outputs["probabilities"], expected["probabilities"], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(outputs["label"], expected["label"])
    assert outputs["label"].dtype == np.int64
    # The model is real: most held-out digits are recognised.
    assert np.mean(outputs["label"] == holdout["labels"][:16]) >= 0.8


def test_every_dtype_travels_through_a_worker(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, multi_dtype_path: Path
) -> None:
    workers.serve(multi_dtype_path, model_name, redis_url)
    rng = np.random.default_rng(1)
    inputs = {
        "f16": rng.standard_normal(5).astype(np.float16),
        "i64": rng.integers(-(2**62), 2**62, size=(5, 2), dtype=np.int64),
        "u8": np.array([0, 128, 255], dtype=np.uint8),
        "flag": np.array([True, False, True, True, False]),
        "f64": np.array(np.pi),
    }
    outputs = producer.infer(model_name, inputs, timeout=30)
    expected = direct(multi_dtype_path, inputs)
    assert set(outputs) == set(expected)
    for name, value in expected.items():
        assert outputs[name].dtype == value.dtype
        np.testing.assert_array_equal(outputs[name], value)


def test_two_workers_share_one_queue(
    producer: Producer,
    workers: WorkerProcesses,
    redis_url: str,
    model_name: str,
    conv_path: Path,
    connection: redis.Redis,
) -> None:
    workers.serve(conv_path, model_name, redis_url, count=2)
    rng = np.random.default_rng(2)
    images = [rng.standard_normal((1, 3, 224, 224)).astype(np.float32) for _ in range(30)]
    jobs = producer.submit_many(model_name, [{"image": image} for image in images])
    results = [job.result(timeout=60) for job in jobs]
    for image, result in zip(images, results, strict=True):
        np.testing.assert_allclose(
            result["logits"], direct(conv_path, {"image": image})["logits"], rtol=1e-4, atol=1e-5
        )
    served_by = {connection.hget(keys.job_key(job.id), "worker_name") for job in jobs}
    assert len(served_by) == 2, served_by
    assert all(job.status() == "finished" for job in jobs)
    finished_registry = f"rq:finished:{keys.queue_name(model_name)}"
    eventually(lambda: connection.zcard(finished_registry) == len(jobs))


def test_infer_times_out_cleanly_without_a_worker(redis_url: str, model_name: str, connection: redis.Redis) -> None:
    producer = Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True)
    started = time.monotonic()
    with pytest.raises(ResultTimeout):
        producer.infer(model_name, {"x": np.zeros((1, 4), np.float32)}, timeout=1.0)
    assert 1.0 <= time.monotonic() - started < 3.0
    # Nobody waits for it any more, so it is not left for a worker to pick up later.
    assert connection.llen(keys.queue_key(model_name)) == 0


def test_producer_validates_against_the_published_signature(
    producer: Producer,
    workers: WorkerProcesses,
    redis_url: str,
    model_name: str,
    tiny_path: Path,
    connection: redis.Redis,
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    bad_inputs = [
        ({"wrong": np.zeros((1, 4), np.float32)}, "missing ['x']"),
        ({"x": np.zeros((1, 4), np.float64)}, "dtype float64"),
        ({"x": np.zeros((4,), np.float32)}, "rank 1"),
        ({"x": np.zeros((1, 5), np.float32)}, "size 5 on axis 1"),
        ({"x": np.array([["a"] * 4])}, "x"),
    ]
    for inputs, message in bad_inputs:
        with pytest.raises(InvalidInput, match=message.replace("[", r"\[").replace("]", r"\]")):
            producer.submit(model_name, inputs)
    assert connection.llen(keys.queue_key(model_name)) == 0


def _enqueue_raw(connection: redis.Redis, model: str, frame: bytes, **forged: bytes) -> str:
    """Enqueue ``frame`` unchecked, answered in a reply stream of its own (read through its hash's
    ``ortq_answer``, as a handle made later reads it); ``forged`` job hash fields replace ortq's in
    the same MULTI, so that no worker sees the job before them."""
    options = JobOptions(request_ttl=60, result_ttl=60, failure_ttl=60, reply=keys.new_reply_name(60))
    with connection.pipeline() as pipe:
        job_id = add_enqueue(pipe, model, frame, options)
        if forged:
            pipe.hset(keys.job_key(job_id), mapping=forged)
        pipe.execute()
    return job_id


def test_worker_survives_bad_jobs_and_then_serves(
    workers: WorkerProcesses,
    redis_url: str,
    model_name: str,
    tiny_path: Path,
    connection: redis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    canary = tmp_path / "canary"
    monkeypatch.setenv("ORTQ_CANARY_FILE", str(canary))  # the worker inherits it
    workers.serve(tiny_path, model_name, redis_url)
    unchecked = Producer(settings=Settings.from_url(redis_url), validate=False)
    good = np.arange(8, dtype=np.float32).reshape(2, 4)
    mistyped = encode_request({"x": good}).replace(b"float32", b"floaty!", 1)  # as long: offsets hold

    failing = {
        "wrong name": (unchecked.submit(model_name, {"nope": good}), "InvalidInput", "missing ['x']"),
        "wrong dtype": (unchecked.submit(model_name, {"x": good.astype(np.int32)}), "InvalidInput", "dtype int32"),
        "wrong shape": (unchecked.submit(model_name, {"x": good.reshape(8)}), "InvalidInput", "rank 1"),
        "garbage": (unchecked.job(_enqueue_raw(connection, model_name, b"\x00garbage" * 9), model_name),
                    "WireFormatError", "does not decode as an ortq request: not an ortq frame (bad magic)"),
        # A header value the decoder's own message would quote: the answer says what, not the value.
        "bad dtype": (unchecked.job(_enqueue_raw(connection, model_name, mistyped), model_name),
                      "WireFormatError", "request: a tensor's dtype is not one the format has"),
    }  # fmt: skip
    # A job hash naming another callable, written straight into Redis as an attacker would.
    data = MsgpackSerializer.dumps(["tests.canary.tripwire", None, [], {}])
    forged = unchecked.job(_enqueue_raw(connection, model_name, encode_request({"x": good}), data=data), model_name)
    failing["other function"] = (forged, "UnknownJobFunction", "a function other than ortq.rqjob.infer")
    ok_job = unchecked.submit(model_name, {"x": good})

    for what, (job, error_type, message) in failing.items():
        with pytest.raises(InferenceFailed) as caught:
            job.result(timeout=20)
        assert caught.value.remote_type == error_type, what
        assert message in caught.value.remote_message, (what, caught.value.remote_message)
        assert "floaty" not in caught.value.remote_message, what  # nothing of the frame quoted
        assert job.status() == "failed", what
        failed_registry = f"rq:failed:{keys.queue_name(model_name)}"
        eventually(lambda job=job, key=failed_registry: connection.zscore(key, job.id) is not None)
    np.testing.assert_array_equal(ok_job.result(timeout=20)["y"], good * 2 + 1)
    # The reply says no more than the worker's own words (it carries no proof, the request being
    # unreadable: anyone may have written it); why is in RQ's record of the failure, for operators.
    garbage = failing["garbage"][0]
    [(_, fields)] = connection.xrevrange(layout.results_key(garbage.id), count=1)
    assert "magic" in zlib.decompress(base64.b64decode(fields[b"exc_string"])).decode()
    assert not canary.exists(), "the forged job's module was imported or called"
    assert all(p.poll() is None for p, _ in workers.processes), workers.logs()
    # Request side keys do not outlive their jobs (this test's: the Redis is shared).
    ids = [job.id for job, _, _ in failing.values()] + [ok_job.id]
    eventually(lambda: not connection.exists(*[keys.request_key(model_name, i) for i in ids]))


def test_results_can_be_read_again_and_by_another_producer(
    producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    x = np.ones((3, 4), np.float32)
    job = producer.submit(model_name, {"x": x})
    first = job.result(timeout=20)["y"]
    with Producer(settings=Settings.from_url(redis_url)) as other:
        again = other.job(job.id, model_name).result(timeout=1)["y"]
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first, x * 3)
    assert not first.flags.writeable  # a view onto the received frame, as documented


def test_results_of_many_jobs_are_waited_for_together(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    producer = Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True)  # no worker yet
    xs = [np.full((1, 4), i, np.float32) for i in range(40)]
    jobs = producer.submit_many(model_name, [{"x": x} for x in xs])
    with pytest.raises(ResultTimeout, match="40 of 40 jobs had no result"):
        producer.results(jobs, timeout=0.5)  # no worker yet
    workers.serve(tiny_path, model_name, redis_url)
    for x, outputs in zip(xs, producer.results(jobs, timeout=30), strict=True):
        np.testing.assert_array_equal(outputs["y"], x * 2 + 1)
    unchecked = Producer(settings=Settings.from_url(redis_url), validate=False)
    mixed = unchecked.submit_many(model_name, [{"x": xs[0]}, {"x": np.zeros((1, 3), np.float32)}])
    with pytest.raises(InferenceFailed) as caught:
        unchecked.results(mixed, timeout=30)
    assert caught.value.job_id == mixed[1].id


def test_forged_and_corrupt_replies_are_refused(redis_url: str, model_name: str, connection: redis.Redis) -> None:
    """An entry in the producer's reply stream answering a job without its request's proof is
    ResponseMismatch naming the job, whether its frame is in the entry or (a large answer's) in the
    job's own key; a large answer's key that is no stream is CorruptRecord naming the job; a reply
    stream that is no stream is CorruptRecord naming it, at once (no wait to the timeout), and once
    it is a stream again (a worker's next answer replaces it) its answers are read. None ever
    returns outputs."""
    producer = Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True)
    stream = keys.reply_key(model_name, producer.reply_name)
    x = {"x": np.ones((1, 4), np.float32)}
    forged, forged_large, corrupt_large, corrupt, fine = producer.submit_many(model_name, [x] * 5)
    frame = encode_response({"y": np.zeros((1, 4), np.float32)}, proof=proof_of(model_name, b"\x00" * 16))
    connection.xadd(stream, {"id": forged.id, "frame": frame})
    with pytest.raises(ResponseMismatch, match=forged.id):
        forged.result(timeout=5)
    connection.xadd(keys.large_reply_key(model_name, forged_large.id), {"frame": frame})
    connection.xadd(stream, {"id": forged_large.id, "frame": b""})
    with pytest.raises(ResponseMismatch, match=forged_large.id):
        forged_large.result(timeout=5)
    connection.set(keys.large_reply_key(model_name, corrupt_large.id), b"not a stream")
    connection.xadd(stream, {"id": corrupt_large.id, "frame": b""})
    with pytest.raises(CorruptRecord, match=f"large answer of job {corrupt_large.id}"):
        corrupt_large.result(timeout=5)
    connection.delete(stream)
    connection.set(stream, b"not a stream")
    started = time.monotonic()
    with pytest.raises(CorruptRecord, match=f"reply stream {stream} holds no stream"):
        producer.results([fine, corrupt], timeout=30)
    assert time.monotonic() - started < 10
    connection.delete(stream)  # as a worker's answer replaces a key of another type (common.lua's write)
    answer = encode_response({"y": np.ones((1, 4), np.float32)}, proof=fine.proof)  # as a worker answers
    connection.xadd(stream, {"id": fine.id, "frame": answer})
    np.testing.assert_array_equal(fine.result(timeout=5)["y"], np.ones((1, 4), np.float32))

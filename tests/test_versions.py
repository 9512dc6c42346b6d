"""Model versions (docs/operations.md, "Model versions and rollouts"): every answer names the version
that computed it, a producer may pin one, and a rolling update from one version to the next under
load loses no job and never hands a producer outputs of a model whose signature it did not check
its inputs against."""

from __future__ import annotations

import json
import re
import signal
import textwrap
import threading
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys, wire
from ortq.dashboard.app import create_app
from ortq.errors import UnknownModel, VersionMismatch, WireFormatError
from ortq.info import collect, format_info
from ortq.producer import Producer
from ortq.producer.producer import InferenceJob
from ortq.settings import Settings
from ortq.worker.serve import file_version
from tests import onnx_models
from tests.conftest import Pool, WorkerProcesses, answer_of, answers_of, answers_of_many, eventually
from tests.test_fuzz import job_fields
from tests.test_worker_inprocess import Serving, make_worker

pytestmark = pytest.mark.timeout(240)


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _pool_config(path: Path, model: str, model_path: Path, version: str | None) -> Path:
    """A pool of two batching workers of ``model_path`` (at ``version``; None: the file's digest)."""
    line = "" if version is None else f'version = "{version}"'
    path.write_text(
        textwrap.dedent(f"""
        [pool]
        measure_memory = false
        grace_seconds = 20
        [[model]]
        name = "{model}"
        path = "{model_path}"
        provider = "cpu"
        threads = 1
        max_batch = 8
        max_wait_ms = 2
        rows_independent = true
        {line}
        [[model.workers]]
        count = 2
        """)
    )
    return path


def _versions_live(producer: Producer, model: str) -> list[str]:
    return sorted(str(record.get("version")) for record in producer.workers(model))


def test_a_rolling_update_under_load_loses_nothing_and_each_answer_is_its_versions(
    tmp_path: Path, models_dir: Path, model_name: str, redis_url: str, connection: redis.Redis, pools: list[Pool]
) -> None:
    """A pool of v1 serves; a pool of v2 (the same signature, other weights) starts beside it; the
    first is stopped (SIGTERM: it finishes what it holds), all while a producer keeps submitting.
    Every job is answered once, by the version its reply names, with that version's outputs."""
    v1_path = onnx_models.tiny_model(models_dir / "v1.onnx")
    v2_path = onnx_models.retrained_tiny_model(models_dir / "v2.onnx", scale=3.0)
    v2 = file_version(v2_path)  # the pool names no version for v2: its file's digest
    reference = {"v1": _session(v1_path), v2: _session(v2_path)}
    pools.append(old := Pool(_pool_config(tmp_path / "v1.toml", model_name, v1_path, "v1"), redis_url))
    rng = np.random.default_rng(7)
    submitted: list[tuple[InferenceJob, np.ndarray]] = []
    stop = threading.Event()
    failures: list[BaseException] = []

    with Producer(settings=Settings.from_url(redis_url)) as producer:
        producer.wait_for_workers(model_name, 2, timeout=90)

        def submit_continuously() -> None:
            with Producer(settings=Settings.from_url(redis_url)) as own:
                try:
                    while not stop.is_set() and len(submitted) < 6000:
                        xs = [rng.standard_normal((int(rng.integers(1, 4)), 4)).astype(np.float32) for _ in range(20)]
                        handles = own.submit_many(model_name, [{"x": x} for x in xs])
                        submitted.extend(zip(handles, xs, strict=True))
                        time.sleep(0.01)
                except BaseException as exc:  # reported by the test below
                    failures.append(exc)

        submitter = threading.Thread(target=submit_continuously)
        submitter.start()
        try:
            eventually(lambda: len(submitted) >= 300, 60)
            pools.append(new := Pool(_pool_config(tmp_path / "v2.toml", model_name, v2_path, None), redis_url))
            eventually(lambda: _versions_live(producer, model_name).count(v2) == 2, 90)
            at_switch = len(submitted)
            old.process.send_signal(signal.SIGTERM)
            assert old.wait(60) == 0, old.text()
            eventually(lambda: len(submitted) >= at_switch + 600, 60)
        finally:
            stop.set()
            submitter.join(30)
        assert not failures, failures
        responses = producer.results_of([handle for handle, _ in submitted], timeout=120)

        answered_by: dict[str, int] = {}
        for (handle, x), response in zip(submitted, responses, strict=True):
            assert response.ok, (handle.id, response.error)
            assert response.version in reference, response.version
            expected = reference[response.version].run(None, {"x": x})[0]
            np.testing.assert_array_equal(response.outputs["y"], expected)
            answered_by[response.version] = answered_by.get(response.version, 0) + 1
        assert set(answered_by) == {"v1", v2}, answered_by
        # Answered once each: one entry each in the reply stream, and nothing left queued, started or parked.
        answers = answers_of_many(connection, model_name, [handle.id for handle, _ in submitted])
        assert {len(frames) for frames in answers.values()} == {1}
        assert connection.llen(keys.queue_key(model_name)) == 0
        # The current signature is the version that started last; each version keeps its own.
        signature = producer.signature(model_name)
        assert signature is not None and signature.version == v2
        v1_signature = producer.signature(model_name, "v1")
        assert v1_signature is not None and v1_signature.version == "v1"
        assert v1_signature.digest == signature.digest  # a retrained model: the signature is the same
    assert "v1" in old.text() and new.process.poll() is None


def test_pinned_jobs_are_answered_by_their_version_alone(
    models_dir: Path, model_name: str, redis_url: str, connection: redis.Redis, workers: WorkerProcesses
) -> None:
    """Jobs pinned to v1 or v2 and unpinned ones share the model's queue: a worker of the other version
    parks a pinned job for its own, whose next take starts it (an idle one within its one-second slice)."""
    v1_path = onnx_models.tiny_model(models_dir / "pin-v1.onnx")
    v2_path = onnx_models.retrained_tiny_model(models_dir / "pin-v2.onnx", scale=5.0)
    reference = {"v1": _session(v1_path), "v2": _session(v2_path)}
    workers.serve(v1_path, model_name, redis_url, 1, "--model-version", "v1")
    batching = ("--max-batch", "4", "--max-wait-ms", "1", "--rows-independent")
    workers.start(v2_path, model_name, redis_url, "--model-version", "v2", *batching)
    rng = np.random.default_rng(3)
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        eventually(lambda: _versions_live(producer, model_name) == ["v1", "v2"], 60)
        jobs: list[tuple[InferenceJob, np.ndarray, str | None]] = []
        for round_ in range(20):
            for pin in ("v1", "v2", None):
                x = rng.standard_normal((2, 4)).astype(np.float32)
                jobs.append((producer.submit(model_name, {"x": x}, version=pin), x, pin))
            if round_ % 5 == 0:
                time.sleep(0.3)  # let the workers go idle now and then: parked jobs must still be taken
        responses = producer.results_of([job for job, _, _ in jobs], timeout=60)
        for (job, x, pin), response in zip(jobs, responses, strict=True):
            assert response.version == (pin or response.version), (job.id, pin, response.version)
            expected = reference[str(response.version)].run(None, {"x": x})[0]
            np.testing.assert_array_equal(response.outputs["y"], expected)
        pinned = [response.version for (_, _, pin), response in zip(jobs, responses, strict=True) if pin is not None]
        assert pinned.count("v1") == pinned.count("v2") == 20
        assert not connection.exists(keys.parked_key(model_name, "v1"), keys.parked_key(model_name, "v2"))
        # ortq info and the dashboard's page show each worker's version, and the model's current one.
        info = format_info(collect(connection))
        assert re.search(rf"^{re.escape(model_name)}\s+v2\s", info, re.M), info  # v2 started last
        assert len(re.findall(rf"^{re.escape(model_name)}\.\S+\s+{re.escape(model_name)}\s+v[12]\s", info, re.M)) == 2
        page = create_app(Settings.from_url(redis_url)).test_client().get("/").text
        assert '<td data-field="version">v1</td>' in page and '<td data-field="version">v2</td>' in page
        assert '<code data-field="version">v2</code>' in page

        # A version no worker has served is refused as an unknown model is, naming what serves.
        with pytest.raises(UnknownModel, match=r"version 'v3'.*serve v1, v2"):
            producer.submit(model_name, {"x": np.ones((1, 4), np.float32)}, version="v3")
        with pytest.raises(Exception, match="invalid model version"):
            producer.submit(model_name, {"x": np.ones((1, 4), np.float32)}, version="no/such")


def test_a_job_checked_against_another_signature_is_never_given_its_outputs(
    models_dir: Path, model_name: str, redis_url: str, workers: WorkerProcesses
) -> None:
    """A rollout that changes the signature: a job checked against the old one and answered by the new
    version raises VersionMismatch, and resubmitted, is checked against the new one and answered."""
    old_path = onnx_models.tiny_model(models_dir / "sig-v1.onnx")
    new_path = onnx_models.fixed_batch_model(models_dir / "sig-v2.onnx")  # x: [1, 4], not [batch, 4]
    workers.serve(old_path, model_name, redis_url, 1, "--model-version", "old")
    x = np.ones((1, 4), np.float32)
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        expected = _session(old_path).run(None, {"x": x})[0]
        np.testing.assert_array_equal(producer.infer(model_name, {"x": x})["y"], expected)
        workers.stop_all()
        workers.processes.clear()  # stopped as asked: not to be taken for a failed start below
        job = producer.submit(model_name, {"x": x})  # checked against the cached signature of "old"
        workers.serve(new_path, model_name, redis_url, 1, "--model-version", "new")  # the only worker now
        with pytest.raises(VersionMismatch, match=r"checked against signature .* answered by version 'new'"):
            job.result(timeout=30)
        producer._signatures = type(producer._signatures)()  # what SIGNATURE_CACHE_SECONDS does, at once
        again = producer.submit(model_name, {"x": x})
        np.testing.assert_array_equal(again.result(timeout=30)["y"], _session(new_path).run(None, {"x": x})[0])
        # Pinned to a version that is gone and answered by another: never accepted either.
        assert again.signature is not None
        pinned = InferenceJob(producer, again.id, model_name, again.nonce, again.signature, version="old")
        with pytest.raises(VersionMismatch, match="pinned to version 'old'"):
            pinned.result(timeout=5)


def test_served_by_is_encoded_alike_by_both_encoders_and_checked_on_decode() -> None:
    """The worker's fast encoder (a remembered layout) writes the bytes the general one writes, with
    ``served_by`` last; a response whose ``served_by`` is malformed does not decode."""
    outputs = {"y": np.arange(8, dtype=np.float32).reshape(2, 4)}
    served = wire.Served("v7", "0123456789abcdef")
    proof = wire.proof_of("m", b"n" * 16)
    fast = wire.encode_laid_out(outputs, wire.layout_of(outputs), {"run": 0.5}, proof, served)
    general = wire.encode_laid_out(outputs, None, {"run": 0.5}, proof, served)
    assert fast == general
    response = wire.decode_response(fast)
    assert (response.version, response.signature, response.proof) == ("v7", "0123456789abcdef", proof)
    failed = wire.decode_response(wire.encode_error("InvalidInput", "no", proof=proof, served=served))
    assert (failed.version, failed.signature) == ("v7", "0123456789abcdef")
    body = {"v": wire.WIRE_VERSION, "kind": "response", "ok": False, "timings": {}}
    body["error"] = {"type": "X", "message": "y"}
    for bad in ({"version": "v"}, {"version": 1, "signature": "s"}, {"version": "v" * 65, "signature": "s"}, "v1"):
        header = msgpack.packb({**body, "served_by": bad})
        frame = wire.MAGIC + len(header).to_bytes(4, "little") + header
        frame += bytes(-len(frame) % 8)  # the tensors' alignment (none here)
        with pytest.raises(WireFormatError, match="served_by"):
            wire.decode_response(frame)


def test_a_burst_worker_answers_the_jobs_parked_for_its_version_before_it_exits(
    models_dir: Path, model_name: str, redis_url: str, connection: redis.Redis, workers: WorkerProcesses
) -> None:
    """Jobs pinned to v1 that a v2 worker took and parked: a ``--burst`` worker of v1 (what a KEDA
    ScaledJob runs) finds the queue empty, yet answers them before it exits."""
    v1_path = onnx_models.tiny_model(models_dir / "burst-v1.onnx")
    v2_path = onnx_models.retrained_tiny_model(models_dir / "burst-v2.onnx", scale=5.0)
    v1 = workers.start(v1_path, model_name, redis_url, "--model-version", "v1")
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        eventually(lambda: _versions_live(producer, model_name) == ["v1"], 60)
        v1.send_signal(signal.SIGTERM)  # its signature stays: pinning to v1 is still allowed
        assert v1.wait(30) == 0
        v2 = workers.start(v2_path, model_name, redis_url, "--model-version", "v2")
        xs = [np.full((1, 4), i, np.float32) for i in range(3)]
        jobs = [producer.submit(model_name, {"x": x}, version="v1") for x in xs]
        parked = keys.parked_key(model_name, "v1")
        eventually(lambda: connection.llen(parked) == 3 and connection.llen(keys.queue_key(model_name)) == 0, 30)
        info = collect(connection)
        [model] = [m for m in info["models"] if m["model"] == model_name]
        assert model["queued"] == 0 and model["parked"] == {"v1": 3}  # ortq info counts them, by version
        page = create_app(Settings.from_url(redis_url)).test_client().get("/").text  # and the dashboard shows them
        assert '<p data-field="parked">parked: 3 jobs pinned to version <code>v1</code>' in page
        assert re.search(rf"^{re.escape(model_name)}\s+v2\s+0\s+3 for v1\s", format_info(info), re.M)
        v2.send_signal(signal.SIGTERM)
        assert v2.wait(30) == 0
        burst = workers.start(v1_path, model_name, redis_url, "--model-version", "v1", "--burst")
        assert burst.wait(60) == 0, workers.logs()
        reference = _session(v1_path)
        for job, x in zip(jobs, xs, strict=True):
            np.testing.assert_array_equal(job.result(timeout=5)["y"], reference.run(None, {"x": x})[0])
        assert not connection.exists(parked)


def test_a_starting_worker_removes_the_signature_members_whose_record_expired(
    models_dir: Path, model_name: str, redis_url: str, connection: redis.Redis, workers: WorkerProcesses
) -> None:
    """The workers' set of signature records (what ortq info and the exporter read) would keep one
    member for every version ever served: a starting worker removes those whose record is gone, and
    leaves those whose record is there (another model's, its own)."""
    expired = [f"{model_name}-old", f"{model_name}-old@v9", "no such name!"]
    kept = f"{model_name}-other@v1"
    connection.set(keys.signature_key(f"{model_name}-other", "v1"), "{}", ex=60)
    connection.sadd(keys.SIGNATURES_SET, *expired, kept)
    path = onnx_models.tiny_model(models_dir / "prune.onnx")
    workers.start(path, model_name, redis_url, "--model-version", "v3")
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        eventually(lambda: _versions_live(producer, model_name) == ["v3"], 60)
    members = {m.decode() for m in connection.smembers(keys.SIGNATURES_SET)}  # type: ignore[union-attr]
    assert {model_name, f"{model_name}@v3", kept} <= members
    assert not set(expired) & members
    connection.srem(keys.SIGNATURES_SET, kept)


@pytest.mark.parametrize("pin", [b"", b"v" * 65, b"v1/../v2"])
def test_a_job_pinned_by_a_malformed_version_is_answered_invalid(
    tiny_path: Path, model_name: str, redis_url: str, workers: WorkerProcesses, pin: bytes
) -> None:
    """A pin no ortq producer writes (empty, past 64 characters, outside the name's characters),
    written raw: a worker serving a version takes it off the queue and answers InvalidJob, failed
    in RQ's records; it was dropped unanswered, ``queued`` for ever."""
    workers.serve(tiny_path, model_name, redis_url, 1, "--model-version", "v1")
    connection = redis.Redis.from_url(redis_url)
    job_id = str(uuid.uuid4())
    with connection.pipeline(transaction=True) as pipe:
        pipe.set(keys.request_key(model_name, job_id), wire.encode_request({"x": np.ones((1, 4), np.float32)}), ex=600)
        fields = {**job_fields(model_name), b"ortq_version": pin, b"ortq_reply": keys.new_reply_name(60).encode()}
        pipe.hset(keys.job_key(job_id), mapping=fields)
        pipe.rpush(keys.queue_key(model_name), job_id)
        pipe.execute()
    eventually(lambda: answer_of(connection, model_name, job_id) is not None, 30)
    [frame] = answers_of(connection, model_name, job_id)
    assert frame == answer_of(connection, model_name, job_id)
    error = wire.decode_response(frame).error
    assert error is not None and error.type == "InvalidJob" and "pins a version" in error.message, error
    assert connection.hget(keys.job_key(job_id), "status") == b"failed"
    assert connection.zscore(f"rq:failed:{keys.queue_name(model_name)}", job_id) is not None
    assert not connection.exists(keys.request_key(model_name, job_id))


def test_the_current_version_is_handed_to_a_live_worker_when_its_last_worker_stops(
    tiny_path: Path, models_dir: Path, model_name: str, redis_url: str, connection: redis.Redis
) -> None:
    """issue 35, section 3: the current signature record outlived the worker that wrote it, so a
    producer pinning to the current version pinned to one nobody served."""
    v2_path = onnx_models.retrained_tiny_model(models_dir / "hand-on-v2.onnx", scale=7.0)
    settings = Settings.from_url(redis_url, heartbeat_seconds=0.5)
    first = Serving(make_worker(tiny_path, model_name, settings, model_version="v1", worker_name=f"{model_name}-v1"))
    with Producer(settings=settings) as producer:
        producer.wait_for_workers(model_name, 1, timeout=60)
        second = Serving(make_worker(v2_path, model_name, settings, model_version="v2", worker_name=f"{model_name}-v2"))
        producer.wait_for_workers(model_name, 2, timeout=60)
        current = lambda: json.loads(connection.get(keys.signature_key(model_name)) or b"{}")["version"]  # noqa: E731
        assert current() == "v2"  # the worker that started last
        assert second.stop() == 0
        assert current() == "v1"  # v2's last worker stopped: the current version is one served
        x = np.ones((1, 4), np.float32)
        pinned = producer.submit(model_name, {"x": x}, version=current())
        direct = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_array_equal(pinned.result(timeout=30)["y"], direct)
        assert first.stop() == 0
    assert current() == "v1"  # no live worker left: it stays, and a job enqueued meanwhile waits

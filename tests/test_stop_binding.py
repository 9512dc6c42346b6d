"""A job's stop mark stops it only when it is the job's own stop token (docs/wire-format.md, 3.7):
SHA-256 of ``stop``, a newline and the job's proof, which only the producer holding the job's nonce
can make. Any producer may write any job hash (RQ's job hashes are every model's), and a plain
``HSET rq:job:<id> ortq_stop 1`` by another model's producer stopped a job before its run, its
producer accepting "JobStopped" with a valid proof. Real Redis, real worker processes, real ONNX
Runtime; outputs compared with a direct ``session.run``."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys, redisfunctions, wire
from ortq.errors import InferenceFailed
from ortq.producer import Producer
from ortq.settings import Settings
from ortq.worker.stops import COMMANDED, Stops
from tests import onnx_models
from tests.conftest import REPO, WorkerProcesses, eventually
from tests.test_tenant_safety import ONE_MODEL_RULES, acl_rules

pytestmark = pytest.mark.timeout(240)

RUN_SECONDS = 3.0  # each run outlasts the stop poll (0.5 s) many times: its mark is read while held

PROOFS = {job: hashlib.sha256(job.encode()).digest() for job in ("a", "b")}


def test_only_the_jobs_own_token_or_rqs_command_stops_it() -> None:
    """ortq.worker.stops: a mark applies only when it is the job's stop token; another job's token,
    any other bytes, or any mark on a job whose request had no nonce (no proof) stops nothing."""
    stops = Stops()
    token_a = redisfunctions.stop_token(PROOFS["a"])
    stops.request({"a": token_a, "b": token_a}, held=["a", "b"])  # b carries a's token
    assert stops.applies("a", PROOFS["a"])
    assert not stops.applies("b", PROOFS["b"])
    assert not stops.applies("a", None)
    stops.request({"b": b"1" * redisfunctions.STOP_TOKEN_LENGTH}, held=["a", "b"])
    assert not stops.applies("b", PROOFS["b"])


def test_a_run_whose_marks_are_not_their_tokens_is_not_stopped() -> None:
    """A run in flight is stopped once every job of it is rightly asked, never by forged marks; RQ's
    stop-job command is not undone by a mark written after it."""
    stops = Stops()
    options = ort.RunOptions()
    stops.run_began(PROOFS, options)
    forged = hashlib.sha256(b"anything").hexdigest().encode()
    stops.request({"a": forged, "b": forged}, held=list(PROOFS))
    assert not options.terminate
    stops.request({"a": redisfunctions.stop_token(PROOFS["a"]), "b": COMMANDED}, held=list(PROOFS))
    stops.request({"b": forged}, held=list(PROOFS))
    assert options.terminate and stops.run_ended()


def test_the_pages_example_token_is_the_one_ortq_makes() -> None:
    """docs/wire-format.md's worked example: the stop token of the proof of model ``digits`` and the
    nonce ``0123456789abcdef``."""
    page = (REPO / "docs" / "wire-format.md").read_text()
    example = re.search(r"the stop token is\s+`([0-9a-f]{64})`", page)
    assert example is not None, "the page gives no example stop token"
    proof = wire.proof_of("digits", b"0123456789abcdef")
    assert example.group(1).encode() == redisfunctions.stop_token(proof)


def test_the_pages_stop_script_is_the_one_ortq_sends() -> None:
    """Section 3.7 gives the stop request's EVAL fallback whole, for clients in other languages."""
    page = (REPO / "docs" / "wire-format.md").read_text()
    section = page[page.index("### 3.7") : page.index("## 4. Read the result")]
    found = re.search(r"```lua\n(.*?)```", section, re.S)
    assert found is not None and found.group(1) == redisfunctions.stop_script_source()


def test_the_stop_function_refuses_a_mark_that_is_no_token(
    connection: redis.Redis, model_name: str, producer: Producer
) -> None:
    """ortq_request_stop_v3 writes only a stop token's form (64 lowercase hex digits): an error, and
    nothing written, for anything else."""
    assert redisfunctions.ensure_functions(connection)
    job = keys.job_key(f"{model_name}-form")
    connection.hset(job, mapping={"status": "started", "origin": keys.queue_name(model_name)})
    for bad in ("1", "A" * 64, "0" * 63):
        with pytest.raises(redis.ResponseError, match="stop token"):
            connection.fcall(redisfunctions.STOP_FUNCTION, 1, job, keys.queue_name(model_name), bad)
    assert connection.hget(job, redisfunctions.STOP_FIELD) is None
    token = redisfunctions.stop_token(PROOFS["a"])
    assert connection.fcall(redisfunctions.STOP_FUNCTION, 1, job, keys.queue_name(model_name), token) == 1
    assert connection.hget(job, redisfunctions.STOP_FIELD) == token


def test_another_models_producer_cannot_stop_a_job_by_writing_its_mark(
    model_name: str, models_dir: Path, redis_url: str, connection: redis.Redis, workers: WorkerProcesses
) -> None:
    """The attack, written out: a producer of another model, under the documented per-model ACL rule
    (which grants every job hash, RQ's job hashes being every model's), marks three queued jobs of
    this model with what it can write: the ``1`` of the issue, 8 MB, and a stop token of its own
    job's (the right form, the wrong job). One worker, ``--prefetch 1``, runs them in turn: the first
    is marked while it runs, the other two while they wait taken ahead of it (started, not run).
    Each mark is read (the worker says so) and ignored: every job runs, its answer equal to a direct
    ``session.run``; the attacker's own job (its token its own) is stopped by its own mark."""
    slow = onnx_models.timed_slow_model(models_dir / "bind-slow.onnx", RUN_SECONDS)
    other = f"{model_name}-other"
    user, password = f"attacker-{model_name}", "pw-attacker"
    connection.execute_command(
        "ACL", "SETUSER", user, "reset", "on", f">{password}", *acl_rules(ONE_MODEL_RULES.format(model=other))
    )
    attacker = redis.Redis.from_url(redis_url.replace("redis://", f"redis://{user}:{password}@"))
    xs = [np.full((1, 256), float(i + 1), np.float32) for i in range(3)]
    try:
        with Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
            victims = [producer.submit(model_name, {"x": x}) for x in xs]
            own = producer.submit(model_name, {"x": xs[0]})  # stands for the attacker's own job
            assert own.proof is not None
            marks = [b"1", b"x" * (8 << 20), redisfunctions.stop_token(own.proof)]
            for victim, mark in zip(victims, marks, strict=True):
                attacker.hset(keys.job_key(victim.id), redisfunctions.STOP_FIELD, mark)
            attacker.hset(keys.job_key(own.id), redisfunctions.STOP_FIELD, redisfunctions.stop_token(own.proof))
            with pytest.raises(redis.exceptions.NoPermissionError):  # it is another model's producer
                attacker.get(keys.request_key(model_name, victims[0].id))
            workers.serve(slow, model_name, redis_url, 1, "--prefetch", "1")
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            session = ort.InferenceSession(str(slow), options, providers=["CPUExecutionProvider"])
            for victim, x in zip(victims, xs, strict=True):
                np.testing.assert_array_equal(
                    victim.result(timeout=RUN_SECONDS * 20)["y"], session.run(None, {"x": x})[0]
                )
                assert victim.status() == "finished"
            with pytest.raises(InferenceFailed, match="JobStopped"):
                own.result(timeout=RUN_SECONDS * 20)
    finally:
        connection.acl_deluser(user)
    logs = workers.logs()
    assert f"job {victims[0].id} has a stop mark (ortq_stop) of 1 bytes, no stop token: ignored" in logs, logs[-3000:]
    assert f"job {victims[1].id} has a stop mark (ortq_stop) of {8 << 20} bytes" in logs, logs[-3000:]
    assert f"job {victims[2].id} has a stop mark that is not its stop token" in logs, logs[-3000:]


def test_a_genuine_cancel_of_a_job_taken_ahead_stops_it_before_it_runs(
    model_name: str, models_dir: Path, redis_url: str, workers: WorkerProcesses
) -> None:
    """The producer's own cancel still stops a job a worker has taken ahead (status ``started``, not
    running): it fails JobStopped before its run, while the job it waited behind is answered."""
    # The first run outlasts the stop's way to the worker (its poll: 0.5 s) many times over.
    slow = onnx_models.timed_slow_model(models_dir / "bind-slow-2.onnx", 4 * RUN_SECONDS)
    workers.serve(slow, model_name, redis_url, 1, "--prefetch", "1")
    x = np.ones((1, 256), np.float32)
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        first = producer.submit(model_name, {"x": x})
        second = producer.submit(model_name, {"x": x * 2})
        eventually(lambda: first.status() == "started" and second.status() == "started", 30, "both taken")
        assert second.cancel() is True  # the stop request: it is off the queue, held by the worker
        with pytest.raises(InferenceFailed, match="stopped on request before it ran"):
            second.result(timeout=RUN_SECONDS * 20)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(slow), options, providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(first.result(timeout=RUN_SECONDS * 20)["y"], session.run(None, {"x": x})[0])
        assert second.status() == "stopped"


def test_a_handle_without_the_nonce_cannot_stop_a_started_job(
    model_name: str, connection: redis.Redis, producer: Producer
) -> None:
    """``Producer.job(id, model)`` (a handle on a job submitted elsewhere) has no nonce, so no
    token: its cancel of a started job writes no mark and says False."""
    with Producer(settings=producer.settings, allow_unknown_models=True) as mine:
        job = mine.submit(model_name, {"x": np.ones((1, 4), np.float32)})
    assert redisfunctions.ensure_functions(connection)
    connection.lrem(keys.queue_key(model_name), 0, job.id)
    connection.hset(keys.job_key(job.id), "status", "started")  # as a worker's start writes it
    assert producer.job(job.id, model_name).cancel() is False
    assert connection.hget(keys.job_key(job.id), redisfunctions.STOP_FIELD) is None

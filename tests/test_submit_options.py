"""Fail fast: every submit option and the model are checked before anything is enqueued, by both
producers alike (each test runs with ``Producer`` and with ``AsyncProducer``)."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from ortq import AsyncProducer, Producer, keys, rqjob
from ortq.errors import ConfigurationError, UnknownModel
from ortq.info import collect
from ortq.producer import checks, enqueue
from ortq.settings import Settings
from tests.conftest import REPO, WorkerProcesses

X = {"x": np.ones((1, 4), np.float32)}


def using(kind: str, redis_url: str, **producer_options: Any) -> Callable[..., Any]:
    """``call(method, *args, **kwargs)`` on a fresh producer of ``kind``, returning what it returns
    (a job's id for a submitted job), so that one test body checks both producers."""

    def call(method: str, *args: Any, **kwargs: Any) -> Any:
        settings = Settings.from_url(redis_url)
        if kind == "sync":
            with Producer(settings=settings, **producer_options) as producer:
                found = getattr(producer, method)(*args, **kwargs)
                return found.id if method == "submit" else found

        async def main() -> Any:
            async with AsyncProducer(settings=settings, **producer_options) as producer:
                found = await getattr(producer, method)(*args, **kwargs)
                return found.id if method == "submit" else found

        return asyncio.run(main())

    return call


KINDS = pytest.mark.parametrize("kind", ["sync", "async"])

BAD_OPTIONS = [
    ({"ttl": 0}, "ttl must be positive"),
    ({"ttl": -5}, "ttl must be positive"),
    ({"ttl": math.nan}, "ttl must be positive"),
    ({"ttl": True}, "ttl must be a number of seconds"),
    ({"ttl": "60"}, "ttl must be a number of seconds"),
    ({"ttl": math.inf}, "ttl must be at most a year"),
    ({"ttl": 10**12}, "ttl must be at most a year"),
    ({"ttl": 10**400}, "ttl must be at most a year"),
    ({"job_timeout": 0}, "job_timeout must be positive"),
    ({"job_timeout": -1}, "job_timeout must be positive"),
    ({"job_timeout": False}, "job_timeout must be a number of seconds"),
    ({"job_timeout": 1e30}, "job_timeout must be at most a year"),
    ({"retries": -1}, "retries must be 0 to 100"),
    ({"retries": 101}, "retries must be 0 to 100"),
    ({"retries": 1.5}, "retries must be a whole number"),
    ({"retries": True}, "retries must be a whole number"),
    ({"retries": "2"}, "retries must be a whole number"),
    ({"retry_backoff": -1}, "retry_backoff must be >= 0"),
    ({"retry_backoff": "1"}, "retry_backoff must be a number of seconds"),
    ({"retry_backoff": 10**9}, "retry_backoff must be at most a year"),
    ({"priority": "urgent"}, "priority must be one of normal, high"),
    ({"priority": None}, "priority must be one of normal, high"),
]


@KINDS
def test_bad_options_are_refused_and_nothing_is_enqueued(
    kind: str, redis_url: str, model_name: str, connection: redis.Redis
) -> None:
    # Unknown models allowed: were an option not checked, the job would go in.
    call = using(kind, redis_url, allow_unknown_models=True)
    jobs_before = set(connection.scan_iter(match="rq:job:*", count=1000))
    for options, message in BAD_OPTIONS:
        with pytest.raises(ConfigurationError, match=message):
            call("submit", model_name, X, **options)
    for timeout in (-1, math.nan, "3", None):
        with pytest.raises(ConfigurationError, match="timeout must be a number of seconds >= 0"):
            call("infer", model_name, X, timeout=timeout)
    assert not list(connection.scan_iter(match=f"*{model_name}*"))
    assert not connection.sismember(keys.RQ_QUEUES_SET, keys.queue_key(model_name))
    # No job hash is new (others of earlier tests may expire meanwhile: the set only shrinks).
    assert set(connection.scan_iter(match="rq:job:*", count=1000)) <= jobs_before
    # The same options, well formed, do go in.
    call("submit", model_name, X, ttl=60, job_timeout=5, retries=2, retry_backoff=1, priority="high")
    assert connection.llen(keys.queue_key(model_name)) == 1


@KINDS
def test_fractions_of_seconds_round_up_to_whole_seconds(
    kind: str, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, connection: redis.Redis
) -> None:
    call = using(kind, redis_url, allow_unknown_models=True)
    queued = call("submit", model_name, X, ttl=2.5, job_timeout=0.5, retries=2, retry_backoff=0.2)
    fields = connection.hmget(keys.job_key(queued), ["ttl", "timeout", "retry_intervals"])
    assert fields == [b"3", b"1", b"[1, 2]"]
    half = call("submit", model_name, X, ttl=0.5)  # a raw redis DataError before; now one second
    assert connection.hget(keys.job_key(half), "ttl") == b"1"
    assert 0 < connection.ttl(keys.request_key(model_name, half)) <= 1
    # A worker runs such a job (a fractional timeout in the hash used to fail every job: InvalidJob).
    workers.serve(tiny_path, model_name, redis_url)
    outputs = using(kind, redis_url)("infer", model_name, X, timeout=30)
    np.testing.assert_array_equal(outputs["y"], X["x"] * 2 + 1)


@KINDS
def test_a_model_no_worker_serves_is_unknown_and_leaves_nothing_behind(
    kind: str, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, connection: redis.Redis
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    mistyped = model_name[:-1] + "z"  # one character off: a typo
    jobs_before = set(connection.scan_iter(match="rq:job:*", count=1000))
    for options in ({}, {"validate": False}):
        with pytest.raises(UnknownModel) as caught:
            using(kind, redis_url, **options)("infer", mistyped, X, timeout=30)
        message = str(caught.value)
        assert f"no worker has served model {mistyped!r}" in message and "nothing was enqueued" in message
        assert f"Did you mean {model_name!r}?" in message and model_name in message.split("Models with workers: ")[1]
        assert "allow_unknown_models=True" in message
    assert not list(connection.scan_iter(match=f"*{mistyped}*"))
    assert not connection.sismember(keys.RQ_QUEUES_SET, keys.queue_key(mistyped))
    # No job hash is new (others of earlier tests may expire meanwhile: the set only shrinks).
    assert set(connection.scan_iter(match="rq:job:*", count=1000)) <= jobs_before
    shown = {model["model"] for model in collect(connection)["models"]}
    assert model_name in shown and mistyped not in shown  # no ghost model in `ortq info`
    # Fire and forget before any worker starts: allowed when asked for.
    using(kind, redis_url, allow_unknown_models=True)("submit", mistyped, X)
    assert connection.llen(keys.queue_key(mistyped)) == 1


@KINDS
def test_a_model_is_known_as_soon_as_its_first_worker_publishes(
    kind: str, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    """A missing signature is never cached: the producer that was refused a moment ago submits once
    a worker is up, without waiting out its signature cache."""
    settings = Settings.from_url(redis_url)
    if kind == "sync":
        with Producer(settings=settings) as producer:
            with pytest.raises(UnknownModel):
                producer.submit(model_name, X)
            workers.serve(tiny_path, model_name, redis_url)
            outputs = producer.infer(model_name, X, timeout=30)
    else:

        async def main() -> dict[str, np.ndarray]:
            async with AsyncProducer(settings=settings) as producer:
                with pytest.raises(UnknownModel):
                    await producer.submit(model_name, X)
                await asyncio.to_thread(workers.serve, tiny_path, model_name, redis_url)
                return await producer.infer(model_name, X, timeout=30)

        outputs = asyncio.run(main())
    np.testing.assert_array_equal(outputs["y"], X["x"] * 2 + 1)


def test_the_unknown_model_message_without_any_worker() -> None:
    message = str(checks.unknown_model("digitz", []))
    assert "No worker is running." in message and "Did you mean" not in message
    records = [{"model": "digits"}, {"model": "resnet"}, {"model": "digits"}, {"name": "no model"}]
    message = str(checks.unknown_model("digitz", records))
    assert "Models with workers: digits, resnet. Did you mean 'digits'?" in message


def test_ortq_infer_of_a_mistyped_model_fails_at_once(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, tmp_path: Path
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    np.save(tmp_path / "x.npy", X["x"])
    mistyped = model_name + "z"
    done = subprocess.run(
        [sys.executable, "-m", "ortq", "infer", mistyped, "--input", f"x={tmp_path / 'x.npy'}",
         "--timeout", "60", "--redis-url", redis_url],
        capture_output=True, text=True, timeout=30, cwd=REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "UnknownModel" in done.stderr and f"Did you mean {model_name!r}?" in done.stderr


def test_the_producer_limits_are_the_worker_limits() -> None:
    assert enqueue.MAX_SECONDS == rqjob.MAX_SECONDS
    assert checks.MAX_RETRIES == rqjob.MAX_RETRIES


@KINDS
def test_infer_takes_the_per_job_options_submit_takes(
    kind: str, workers: WorkerProcesses, redis_url: str, model_name: str, models_dir: Path
) -> None:
    """The options reach the job: a run longer than ``job_timeout`` is stopped (JobTimeout), and a
    bad option is refused before anything is enqueued, as ``submit`` refuses it."""
    from ortq.errors import InferenceFailed
    from tests import onnx_models

    slow = onnx_models.timed_slow_model(models_dir / "infer-options-slow.onnx", 4.0)
    workers.serve(slow, model_name, redis_url)
    call = using(kind, redis_url)
    x = {"x": np.full((1, 256), 0.01, np.float32)}
    with pytest.raises(InferenceFailed, match="JobTimeout"):
        call("infer", model_name, x, 30, job_timeout=1, retries=0, priority="high")
    with pytest.raises(ConfigurationError, match="priority"):
        call("infer", model_name, x, 30, priority="urgent")
    with redis.Redis.from_url(redis_url) as connection:
        assert connection.llen(keys.queue_key(model_name)) == 0


@pytest.mark.parametrize("name", ["digits\n", "digits\r\n", "\ndigits", "a" * 65, "", "-digits", "dig its"])
def test_a_model_or_version_name_is_matched_whole(name: str) -> None:
    """The whole name is checked (``fullmatch``): a pattern with ``$`` let a trailing newline through
    into key names and log lines."""
    with pytest.raises(ConfigurationError, match="invalid model name"):
        keys.check_model_name(name)
    with pytest.raises(ConfigurationError, match="invalid model version"):
        keys.check_version_name(name)
    assert keys.check_model_name("digits") == keys.check_version_name("digits") == "digits"

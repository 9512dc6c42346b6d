"""``ortq exporter`` as a process, scraped over HTTP, against a real Redis and real workers: the
queue's series exist with no worker at all, follow real jobs and workers, cover every Redis of a
shard map, and survive a Redis outage and keys of the wrong type."""

from __future__ import annotations

import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from ortq import keys
from ortq.errors import EXIT_CONFIGURATION, InferenceFailed
from ortq.exporter import METRIC_NAMES
from ortq.localredis import LocalRedis, free_port
from ortq.producer import Producer
from ortq.redisurls import redacted_url
from ortq.rqcompat import layout
from ortq.settings import Settings
from tests import onnx_models
from tests.conftest import REPO, WorkerProcesses, eventually

X = {"x": np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)}
#: Samples by metric name, then by their labels (sorted (name, value) pairs).
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


class Exporter:
    """``ortq exporter`` as a subprocess on a free port, its output in a file."""

    def __init__(self, log_dir: Path, *args: str) -> None:
        self.port = free_port()
        self.log = log_dir / f"exporter-{self.port}.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ortq", "exporter", "--port", str(self.port), *args],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            )  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def scrape(self) -> Samples:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as response:
            assert response.status == 200
            body = response.read().decode()
        samples: Samples = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
        return samples

    def wait_serving(self) -> Samples:
        deadline = time.monotonic() + 60
        while True:
            try:
                return self.scrape()
            except (urllib.error.URLError, ConnectionError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the exporter did not serve:\n{self.text()}") from None
                time.sleep(0.1)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"the exporter ignored SIGTERM:\n{self.text()}") from None


@pytest.fixture
def exporters(tmp_path: Path) -> Iterator[list[Exporter]]:
    started: list[Exporter] = []
    yield started
    for exporter in started:  # whatever the test did, nothing outlives it
        if exporter.process.poll() is None:
            exporter.process.kill()
            exporter.process.wait()


def start_exporter(exporters: list[Exporter], log_dir: Path, *args: str) -> Exporter:
    exporter = Exporter(log_dir, *args)
    exporters.append(exporter)
    exporter.wait_serving()
    return exporter


def value(samples: Samples, name: str, model: str, redis_url: str) -> float | None:
    """The sample of ``name`` for ``model`` on ``redis_url`` (None: not exposed)."""
    return samples.get(name, {}).get((("model", model), ("redis", redacted_url(redis_url))))


def redis_up(samples: Samples, redis_url: str) -> float | None:
    return samples.get("ortq_exporter_redis_up", {}).get((("redis", redacted_url(redis_url)),))


def test_a_queue_with_no_worker_is_measured_then_drained(
    exporters: list[Exporter], workers: WorkerProcesses, tmp_path: Path, tiny_path: Path,
    redis_url: str, connection: redis.Redis, model_name: str,
) -> None:  # fmt: skip
    exporter = start_exporter(exporters, tmp_path, "--redis-url", redis_url)
    with Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
        jobs = producer.submit_many(model_name, [X, X, X])
        # The head's enqueued_at set an hour back: the age read must be that job's.
        head = connection.lindex(keys.queue_key(model_name), 0)
        assert head == jobs[0].id.encode()
        connection.hset(keys.job_key(jobs[0].id), "enqueued_at", layout.utcformat(layout.utcnow() - timedelta(hours=1)))
        samples = exporter.scrape()
        assert redis_up(samples, redis_url) == 1
        assert value(samples, "ortq_queue_length", model_name, redis_url) == 3
        age = value(samples, "ortq_queue_oldest_job_age_seconds", model_name, redis_url)
        assert age is not None and 3600 <= age < 3600 + 600
        assert value(samples, "ortq_queue_running_jobs", model_name, redis_url) == 0
        assert value(samples, "ortq_queue_failed_jobs", model_name, redis_url) == 0
        assert value(samples, "ortq_queue_workers_alive", model_name, redis_url) == 0
        assert value(samples, "ortq_queue_newest_heartbeat_age_seconds", model_name, redis_url) is None

        burst = workers.start(tiny_path, model_name, redis_url, "--burst")
        assert burst.wait(120) == 0, workers.logs()
        session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
        for job in jobs:
            np.testing.assert_array_equal(job.result(timeout=30)["y"], session.run(None, X)[0])
    samples = exporter.scrape()
    assert value(samples, "ortq_queue_length", model_name, redis_url) == 0
    assert value(samples, "ortq_queue_oldest_job_age_seconds", model_name, redis_url) is None
    assert value(samples, "ortq_queue_workers_alive", model_name, redis_url) == 0  # the burst worker left
    assert exporter.stop() == 0
    assert {f for f in samples if f.startswith("ortq_")} <= set(METRIC_NAMES)


def test_running_failed_and_workers_follow_real_workers(
    exporters: list[Exporter], workers: WorkerProcesses, tmp_path: Path, models_dir: Path,
    redis_url: str, producer: Producer, model_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "1")  # for the workers and the exporter alike
    gather = onnx_models.gather_model(models_dir / "exporter-gather.onnx")
    exporter = start_exporter(exporters, tmp_path, "--redis-url", redis_url)
    workers.serve(gather, model_name, redis_url)
    good, bad = {"idx": np.array([0, 3], np.int64)}, {"idx": np.array([7], np.int64)}  # 7: Gather fails the run
    session = ort.InferenceSession(str(gather), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(producer.infer(model_name, good, timeout=30)["y"], session.run(None, good)[0])
    with pytest.raises(InferenceFailed):
        producer.infer(model_name, bad, timeout=30)
    eventually(lambda: value(exporter.scrape(), "ortq_queue_failed_jobs", model_name, redis_url) == 1)
    samples = exporter.scrape()
    assert value(samples, "ortq_queue_workers_alive", model_name, redis_url) == 1
    assert value(samples, "ortq_queue_running_jobs", model_name, redis_url) == 0
    beat = value(samples, "ortq_queue_newest_heartbeat_age_seconds", model_name, redis_url)
    assert beat is not None and beat >= 0

    workers.stop_all()  # SIGTERM: the worker unregisters, its records go
    samples = exporter.scrape()
    assert value(samples, "ortq_queue_workers_alive", model_name, redis_url) == 0
    assert value(samples, "ortq_queue_newest_heartbeat_age_seconds", model_name, redis_url) is None
    assert value(samples, "ortq_queue_failed_jobs", model_name, redis_url) == 1  # kept failure_ttl


def test_a_redis_outage_is_reported_and_ridden_out(exporters: list[Exporter], tmp_path: Path, model_name: str) -> None:
    with LocalRedis() as server:
        with Producer(settings=Settings.from_url(server.url), allow_unknown_models=True) as producer:
            producer.submit(model_name, X)
        exporter = start_exporter(exporters, tmp_path, "--redis-url", server.url)
        assert value(exporter.scrape(), "ortq_queue_length", model_name, server.url) == 1
        assert server.process is not None
        server.process.terminate()  # the same port and folder are used again below
        server.process.wait(10)
        samples = exporter.scrape()  # answered, not an error
        assert redis_up(samples, server.url) == 0
        assert value(samples, "ortq_queue_length", model_name, server.url) is None
        server.start()  # an empty Redis again (nothing was saved)
        samples = exporter.scrape()
        assert redis_up(samples, server.url) == 1
        assert exporter.process.poll() is None
        assert exporter.stop() == 0
    assert "ortq_exporter_redis_up 0 until it can" in exporter.text()
    assert "readable again" in exporter.text()


def test_an_exporter_started_while_redis_is_down_serves_and_recovers(exporters: list[Exporter], tmp_path: Path) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    exporter = start_exporter(exporters, tmp_path, "--redis-url", url)
    assert redis_up(exporter.scrape(), url) == 0
    with LocalRedis(port=port):
        assert redis_up(exporter.scrape(), url) == 1
    assert exporter.stop() == 0


def test_every_redis_of_the_shard_map_is_read(
    exporters: list[Exporter], tmp_path: Path, redis_url: str, model_name: str
) -> None:
    elsewhere = model_name + "-big"
    with LocalRedis() as big:
        settings = Settings(redis_url=redis_url, redis_shards=f"{elsewhere}={big.url}")
        with Producer(settings=settings, allow_unknown_models=True) as producer:
            producer.submit_many(model_name, [X])
            producer.submit_many(elsewhere, [X, X])
        exporter = start_exporter(exporters, tmp_path, "--redis-url", redis_url, "--shards", f"{elsewhere}={big.url}")
        samples = exporter.scrape()
        assert redis_up(samples, redis_url) == redis_up(samples, big.url) == 1
        assert value(samples, "ortq_queue_length", model_name, redis_url) == 1
        assert value(samples, "ortq_queue_length", elsewhere, big.url) == 2
        assert value(samples, "ortq_queue_length", elsewhere, redis_url) is None  # not on the default Redis
        assert value(samples, "ortq_queue_length", model_name, big.url) is None
        assert exporter.stop() == 0


def test_keys_of_the_wrong_type_do_not_break_a_scrape(
    exporters: list[Exporter], tmp_path: Path, redis_url: str, connection: redis.Redis, model_name: str
) -> None:
    wrong, garbage, fine = model_name + "-wrong", model_name + "-garbage", model_name + "-fine"
    with Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
        producer.submit_many(fine, [X, X])
        [job] = producer.submit_many(garbage, [X])
    connection.sadd(keys.RQ_QUEUES_SET, layout.QueueKeys.of(keys.queue_name(wrong)).queue)
    connection.hset(keys.queue_key(wrong), "not", "a list")  # the queue is a hash
    connection.zadd(layout.QueueKeys.of(keys.queue_name(wrong)).started, {"x": 1})
    connection.set(layout.QueueKeys.of(keys.queue_name(wrong)).failed, "not a zset")
    connection.lpush(keys.queue_key(garbage), "\x00 no job id \xff")  # at the head, before the real job
    connection.hset(keys.job_key(job.id), "enqueued_at", "yesterday")
    connection.set(keys.worker_key("forged"), b"\x80 not json")
    connection.sadd(keys.WORKERS_SET, "forged")
    exporter = start_exporter(exporters, tmp_path, "--redis-url", redis_url)
    samples = exporter.scrape()
    assert redis_up(samples, redis_url) == 1
    assert value(samples, "ortq_queue_length", fine, redis_url) == 2
    age = value(samples, "ortq_queue_oldest_job_age_seconds", fine, redis_url)
    assert age is not None and age >= 0
    assert value(samples, "ortq_queue_length", wrong, redis_url) == 0  # shown as empty, as by ortq info
    assert value(samples, "ortq_queue_running_jobs", wrong, redis_url) == 1
    assert value(samples, "ortq_queue_failed_jobs", wrong, redis_url) == 0
    assert value(samples, "ortq_queue_length", garbage, redis_url) == 2
    assert value(samples, "ortq_queue_oldest_job_age_seconds", garbage, redis_url) is None
    connection.lpop(keys.queue_key(garbage))  # the real job at the head now, its time unreadable
    assert value(exporter.scrape(), "ortq_queue_oldest_job_age_seconds", garbage, redis_url) is None
    assert exporter.stop() == 0
    assert f"{keys.queue_key(wrong)}: its head is no job id (ResponseError: WRONGTYPE" in exporter.text()
    assert f"{keys.queue_key(garbage)}: its head is no job id" in exporter.text()
    # The Redis is shared with other tests' readers (rq-dashboard's queue list fails on a queue key
    # that is no list): the forged records go.
    wrong_keys = layout.QueueKeys.of(keys.queue_name(wrong))
    connection.delete(wrong_keys.queue, wrong_keys.started, wrong_keys.failed, keys.worker_key("forged"))
    connection.srem(keys.RQ_QUEUES_SET, wrong_keys.queue)
    connection.srem(keys.WORKERS_SET, "forged")


def test_a_port_in_use_is_a_configuration_error(tmp_path: Path, redis_url: str) -> None:
    with LocalRedis() as server:  # something listening on a port: a Redis will do
        ran = subprocess.run(
            [sys.executable, "-m", "ortq", "exporter", "--port", str(server.port), "--redis-url", redis_url],
            capture_output=True, text=True, timeout=60, cwd=REPO, check=False,
        )  # fmt: skip
    assert ran.returncode == EXIT_CONFIGURATION, ran.stderr
    assert f"cannot serve metrics on 127.0.0.1:{server.port}" in ran.stderr


def test_the_exporter_runs_as_the_documented_read_only_user(
    exporters: list[Exporter], workers: WorkerProcesses, tmp_path: Path, tiny_path: Path, model_name: str
) -> None:
    [rules] = re.findall(r"^user ortq-exporter on #<sha256 of its password> (.+)$",
                         (REPO / "docs" / "security.md").read_text(), re.M)  # fmt: skip
    with LocalRedis() as server:
        admin = redis.Redis.from_url(server.url)
        password = secrets.token_hex(8)
        admin.execute_command("ACL", "SETUSER", "ortq-exporter", "reset", "on", f">{password}", *rules.split())
        workers.serve(tiny_path, model_name, server.url)  # the worker as the default user
        with Producer(settings=Settings.from_url(server.url)) as producer:
            session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
            np.testing.assert_array_equal(producer.infer(model_name, X, timeout=30)["y"], session.run(None, X)[0])
            workers.stop_all()
            producer.submit_many(model_name, [X, X])  # the signature is still there: no worker needed
            version = producer.signature(model_name).version  # type: ignore[union-attr]
        admin.rpush(keys.parked_key(model_name, str(version)), "job-a")  # as start.lua parks a pinned job
        admin.acl_log_reset()
        url = f"redis://ortq-exporter:{password}@127.0.0.1:{server.port}/0"
        exporter = start_exporter(exporters, tmp_path, "--redis-url", url)
        scans = admin.info("commandstats").get("cmdstat_scan", {}).get("calls", 0)
        samples = exporter.scrape()
        # The models and versions come from the workers' set of their signatures: no SCAN of the keyspace.
        assert admin.info("commandstats").get("cmdstat_scan", {}).get("calls", 0) == scans
        assert redis_up(samples, url) == 1
        assert value(samples, "ortq_queue_length", model_name, url) == 2
        assert value(samples, "ortq_queue_oldest_job_age_seconds", model_name, url) is not None  # LINDEX, HGET
        assert value(samples, "ortq_queue_workers_alive", model_name, url) == 0
        parked = (("model", model_name), ("redis", redacted_url(url)), ("version", str(version)))
        assert samples["ortq_queue_parked_jobs"] == {parked: 1}
        assert [e for e in admin.acl_log() if e["username"] == "ortq-exporter"] == []
        with redis.Redis.from_url(url) as client, pytest.raises(redis.exceptions.NoPermissionError):
            client.get(keys.request_key(model_name, "x"))  # the rule does refuse: the check above can fail
        assert [e["object"] for e in admin.acl_log() if e["username"] == "ortq-exporter"] == [
            keys.request_key(model_name, "x")
        ]
        assert exporter.stop() == 0
        admin.close()

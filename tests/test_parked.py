"""Jobs parked for a version (docs/wire-format.md, 5.1): a parked list lives no longer than the
latest expiry of the requests parked in it (every park re-armed it to a full ``request_ttl``
before, so one park a day kept it, and every job ever parked in it, for ever), jobs at its head
that can no longer run are dropped at each park, and ``ortq info``, the exporter and the
dashboard show the parked jobs of every version, one that nobody serves included (they showed
only versions with a signature). Real Redis, start.lua itself, a real in-process worker."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ortq import keys
from ortq.dashboard.app import create_app
from ortq.exporter import PARKED, QueueCollector
from ortq.info import MOST_PARKED_VERSIONS, collect, format_info
from ortq.producer import Producer
from ortq.rqcompat.book import Book
from ortq.settings import Settings
from ortq.shards import ShardMap
from tests.conftest import eventually
from tests.test_worker_inprocess import Serving, make_worker

PARKED_TTL = 10_000  # the worker's request_ttl: the most a park may make a list live


def pinned_job(connection: redis.Redis, model: str, pin: str, request_life: int) -> str:
    """A job pinned to ``pin`` on ``model``'s queue, as a producer writes one (docs/wire-format.md
    3.2), its request frame living ``request_life`` seconds."""
    job_id = str(uuid.uuid4())
    connection.set(keys.request_key(model, job_id), b"frame", ex=request_life)
    connection.hset(
        keys.job_key(job_id), mapping={"status": "queued", "origin": keys.queue_name(model), "ortq_version": pin}
    )
    connection.rpush(keys.queue_key(model), job_id)
    return job_id


def park(book: Book) -> list[str]:
    """One start of ``book``'s worker: the ids it parked."""
    reply, moment, _ = book.start(b"", 10)
    started, skipped = book.parse_start(reply, moment)
    assert started == []
    return [s.entry.decode() for s in skipped if s.reason == "parked"]


@pytest.fixture
def book(connection: redis.Redis, model_name: str) -> Book:
    """The start script of a worker serving version v1 of the model."""
    return Book(connection, f"parker-{model_name}", keys.queue_name(model_name), version="v1", parked_ttl=PARKED_TTL)


def test_a_parked_list_lives_as_long_as_its_longest_lived_request_never_longer(
    book: Book, connection: redis.Redis, model_name: str
) -> None:
    """Each park raises the list's expiry to the parked job's request's, never to a full request_ttl
    and never lower; the set naming the versions with a parked list follows its longest list."""
    parked = keys.parked_key(model_name, "v9")
    first = pinned_job(connection, model_name, "v9", 500)
    assert park(book) == [first]
    assert 490 <= connection.ttl(parked) <= 500  # not PARKED_TTL
    assert connection.smembers(keys.parked_versions_key(model_name)) == {b"v9"}
    assert 490 <= connection.ttl(keys.parked_versions_key(model_name)) <= 500
    shorter = pinned_job(connection, model_name, "v9", 100)
    assert park(book) == [shorter]
    assert 490 <= connection.ttl(parked) <= 500  # not lowered: the first job may still run
    longer = pinned_job(connection, model_name, "v9", 800)
    assert park(book) == [longer]
    assert 790 <= connection.ttl(parked) <= 800
    assert 790 <= connection.ttl(keys.parked_versions_key(model_name)) <= 800
    assert connection.lrange(parked, 0, -1) == [first.encode(), shorter.encode(), longer.encode()]


def test_a_park_drops_the_jobs_at_the_lists_head_that_can_no_longer_run(
    book: Book, connection: redis.Redis, model_name: str
) -> None:
    """A park a day kept a list, and every job ever parked in it, for ever: now the jobs at its head
    whose request is gone (expired: deleted here, as its expiry would) leave it at the next park,
    those behind a job that may still run stay until it leaves."""
    parked = keys.parked_key(model_name, "v9")
    ids = [pinned_job(connection, model_name, "v9", 600) for _ in range(4)]
    assert park(book) == ids
    for gone in (ids[0], ids[1], ids[3]):
        connection.delete(keys.request_key(model_name, gone))
    today = pinned_job(connection, model_name, "v9", 300)
    assert park(book) == [today]
    assert connection.lrange(parked, 0, -1) == [ids[2].encode(), ids[3].encode(), today.encode()]
    connection.delete(keys.request_key(model_name, ids[2]))
    tomorrow = pinned_job(connection, model_name, "v9", 300)
    assert park(book) == [tomorrow]
    assert connection.lrange(parked, 0, -1) == [today.encode(), tomorrow.encode()]


def test_a_request_without_an_expiry_makes_a_list_live_at_most_request_ttl(
    book: Book, connection: redis.Redis, model_name: str
) -> None:
    """A request frame with no expiry (no ortq producer writes one) counts as the worker's request_ttl,
    and one already gone as a second: a park never leaves a list without an expiry."""
    no_expiry = pinned_job(connection, model_name, "v9", 60)
    connection.persist(keys.request_key(model_name, no_expiry))
    assert park(book) == [no_expiry]
    assert PARKED_TTL - 10 <= connection.ttl(keys.parked_key(model_name, "v9")) <= PARKED_TTL
    gone = pinned_job(connection, model_name, "v8", 60)
    connection.delete(keys.request_key(model_name, gone))
    assert park(book) == [gone]
    assert 0 <= connection.ttl(keys.parked_key(model_name, "v8")) <= 1


@pytest.fixture
def serving_v1(tiny_path: Path, model_name: str, redis_url: str) -> Iterator[Serving]:
    settings = Settings.from_url(redis_url, heartbeat_seconds=0.5)
    running = Serving(make_worker(tiny_path, model_name, settings, model_version="v1"))
    with Producer(settings=settings) as producer:
        producer.wait_for_workers(model_name, 1, timeout=30)
    yield running
    running.stop()


def exported_parked(redis_url: str, connection: redis.Redis) -> dict[tuple[str, str], float]:
    """The exporter's parked-jobs series, (model, version) -> value, as Prometheus scrapes them."""
    registry = CollectorRegistry()
    registry.register(QueueCollector({redis_url: connection}, ShardMap(redis_url), 0.5))
    series = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name == PARKED:
                series[sample.labels["model"], sample.labels["version"]] = sample.value
    return series


def test_jobs_parked_for_a_version_nobody_serves_are_shown_by_every_reader(
    serving_v1: Serving, tiny_path: Path, model_name: str, redis_url: str, connection: redis.Redis
) -> None:
    """A real worker of v1 parks two jobs pinned to v9, a version with no signature and no worker:
    ``ortq info`` (its table and --json), the exporter's gauge and the dashboard count them, saying
    that nobody serves v9; a job of v1 queued behind them is answered as a direct session.run."""
    pinned = [pinned_job(connection, model_name, "v9", 600) for _ in range(2)]
    x = {"x": np.ones((1, 4), np.float32)}
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        behind = producer.submit(model_name, x)
        session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(behind.result(timeout=30)["y"], session.run(None, x)[0])
    eventually(lambda: connection.llen(keys.parked_key(model_name, "v9")) == 2, 10, "both parked")
    assert not connection.exists(keys.signature_key(model_name, "v9"))
    info = collect(connection, 0.5)
    [model] = [m for m in info["models"] if m["model"] == model_name]
    assert model["parked"] == {"v9": 2} and info["skipped_parked_versions"] == 0
    assert re.search(rf"^{re.escape(model_name)}\s.*\s2 for v9 \(not served\)\s", format_info(info), re.M)
    assert exported_parked(redis_url, connection)[model_name, "v9"] == 2.0
    page = create_app(Settings.from_url(redis_url)).test_client().get("/").text
    assert "2 jobs pinned to version <code>v9</code> <span" in page and "(no worker serves it)" in page
    assert all(connection.hget(keys.job_key(job), "status") == b"queued" for job in pinned)


def test_readers_look_at_a_bounded_number_of_parked_versions_and_say_so(
    connection: redis.Redis, model_name: str
) -> None:
    """Producers may pin to any version name, so the set of versions with a parked list may be
    large: a reader looks at MOST_PARKED_VERSIONS of it a model and says how many it left out. The
    lists and the set are written as start.lua writes them."""
    versions = [f"p{i}" for i in range(MOST_PARKED_VERSIONS + 20)]
    connection.sadd(keys.parked_versions_key(model_name), *versions)
    for version in versions:
        connection.rpush(keys.parked_key(model_name, version), str(uuid.uuid4()))
    connection.sadd(keys.RQ_QUEUES_SET, keys.queue_key(model_name))
    pinned_job(connection, model_name, "p0", 600)  # queued: the model is known by its queue
    try:
        info = collect(connection)
    finally:  # nothing of this is left on the Redis the other tests share
        connection.delete(keys.parked_versions_key(model_name), *(keys.parked_key(model_name, v) for v in versions))
        connection.srem(keys.RQ_QUEUES_SET, keys.queue_key(model_name))
    [model] = [m for m in info["models"] if m["model"] == model_name]
    assert len(model["parked"]) == MOST_PARKED_VERSIONS
    assert set(model["parked"].values()) == {1}
    assert info["skipped_parked_versions"] == 20
    note = f"20 version(s) with a parked list were not looked at (at most {MOST_PARKED_VERSIONS} a model are)"
    assert note in format_info(info)

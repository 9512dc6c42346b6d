"""ortq under both of Redis's protocols (issue 35, §5). redis-py 8 speaks RESP3 by default, redis-py
5 (the oldest ortq allows, scripts/test.sh's second pass) RESP2, and ortq pins neither in
Settings.connect: a ``?protocol=2`` or ``?protocol=3`` in ``redis_url`` chooses, and replies differ
in shape between the two (XREAD's is a map under RESP3, a list under RESP2; pub/sub messages are
RESP3 push frames). So each case here runs once under each, through ``redis_url`` as a user would:
a producer and an in-process worker (its feeder, replier, heartbeat and command channel), a
blocking XREAD that the reply ends, the asyncio producer, ``ortq info`` and an exporter scrape,
and RQ's shutdown command reaching the worker over pub/sub. Every connection the server sees from
them is checked to speak the protocol asked for (CLIENT LIST's ``resp``)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rq.command import send_shutdown_command

from ortq import keys
from ortq.dashboard.app import create_app
from ortq.exporter import QUEUE_LENGTH, WORKERS_ALIVE, QueueCollector
from ortq.info import shard_clients
from ortq.localredis import LocalRedis
from ortq.producer import AsyncProducer, Producer
from ortq.rqcompat import layout
from ortq.settings import Settings
from tests.cli_support import invoke
from tests.conftest import eventually
from tests.test_worker_inprocess import Serving, make_worker

X = {"x": np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.float32)}
#: A wait for a condition that the code under test brings about in well under a second: only a
#: hang's bound, never a timing.
PATIENCE = 120.0


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    """A Redis of this module's own: its CLIENT LIST holds only the connections of these tests,
    and RQ's suspension (global to a Redis) touches no other test."""
    with LocalRedis() as own:
        yield own


@pytest.fixture
def admin(server: LocalRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url, protocol=2)
    yield client
    client.close()


def _clients(admin: redis.Redis, older: Collection[int] = ()) -> list[dict[str, Any]]:
    """CLIENT LIST's entries, but the admin's own connection and those of ids in ``older`` (open
    before the case began: what an earlier case left for the garbage collector)."""
    own = admin.client_id()
    return [c for c in admin.client_list() if int(c["id"]) != own and int(c["id"]) not in older]


def _blocked_in_xread(admin: redis.Redis) -> bool:
    return any(c.get("cmd") == "xread" and "b" in c.get("flags", "") for c in _clients(admin))


@pytest.mark.parametrize("protocol", [None, 2, 3], ids=["default", "2", "3"])
def test_producer_worker_readers_and_commands_under_resp(
    protocol: int | None, server: LocalRedis, admin: redis.Redis, tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``protocol`` None: redis-py's own default (RESP3 on the wire from redis-py 8 on)."""
    caplog.set_level(logging.INFO, "ortq.worker")
    url = server.url if protocol is None else f"{server.url}?protocol={protocol}"
    speaks = str(protocol or _default_resp(server.url))
    settings = Settings.from_url(url, heartbeat_seconds=0.5)
    model = f"resp{protocol or 'default'}-{uuid.uuid4().hex[:8]}"
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    expected = session.run(None, X)[0]
    older = {int(c["id"]) for c in _clients(admin)}
    serving = Serving(make_worker(tiny_path, model, settings))
    try:
        with Producer(settings=settings) as producer:
            [record] = producer.wait_for_workers(model, 1, timeout=PATIENCE)
            name = record["name"]
            # Round trips: one job, and many read by one XREAD of many streams.
            np.testing.assert_array_equal(producer.infer(model, X, timeout=PATIENCE)["y"], expected)
            inputs = [{"x": np.full((1, 4), i, np.float32)} for i in range(8)]
            got = producer.results(producer.submit_many(model, inputs), timeout=PATIENCE)
            for one, outputs in zip(inputs, got, strict=True):
                np.testing.assert_array_equal(outputs["y"], session.run(None, one)[0])

            # A blocking XREAD that the reply ends: the worker held off (RQ's suspension) until
            # the producer is seen blocked in XREAD on the job's reply stream.
            admin.set(layout.suspended_key(), 1)
            try:
                eventually(
                    lambda: admin.hget(layout.worker_key(name), "state") == b"suspended",
                    PATIENCE,
                    "the worker's RQ state 'suspended'",
                )
                job = producer.submit(model, X)
                answer: dict[str, Any] = {}
                waiter = threading.Thread(target=lambda: answer.update(job.result(timeout=PATIENCE)), daemon=True)
                waiter.start()
                eventually(lambda: _blocked_in_xread(admin), PATIENCE, "a client blocked in XREAD")
            finally:
                admin.delete(layout.suspended_key())
            waiter.join(PATIENCE)
            assert not waiter.is_alive(), "the blocked XREAD never returned the reply"
            np.testing.assert_array_equal(answer["y"], expected)

            # The asyncio producer (redis.asyncio, its own pool and reader connections).
            async def infer_async() -> Any:
                async with AsyncProducer(settings=settings) as async_producer:
                    return await async_producer.infer(model, X, timeout=PATIENCE)

            np.testing.assert_array_equal(asyncio.run(infer_async())["y"], expected)

            # Readers: ortq info and one exporter scrape, through the same URL.
            shown = invoke("info", "--json", "--redis-url", url)
            assert shown.exit_code == 0 and shown.no_traceback(), shown.stderr
            [listed] = [m for m in json.loads(shown.stdout)["models"] if m["model"] == model]
            assert [w["name"] for w in listed["workers"]] == [name], listed
            samples = _scrape(settings)
            assert samples[(WORKERS_ALIVE, model)] == 1.0 and samples[(QUEUE_LENGTH, model)] == 0.0, samples
            _dashboard_reads(settings, model, name)

            # Every connection of the worker and the producer speaks the protocol asked for, the
            # worker's command channel (a subscribed connection) among them.
            clients = _clients(admin, older)
            assert {c["resp"] for c in clients} == {speaks}, clients
            assert any(int(c.get("sub", 0)) > 0 for c in clients), clients

        # RQ's shutdown command, over pub/sub: a warm stop.
        assert send_shutdown_command(admin, name) is None
        serving.thread.join(PATIENCE)
        assert serving.status == 0, caplog.text[-4000:]
        assert "shutdown command received" in caplog.text
    finally:
        serving.stop()


def _default_resp(url: str) -> int:
    """The protocol a client of redis-py's defaults speaks (CLIENT INFO's ``resp``)."""
    client = redis.Redis.from_url(url)
    try:
        return int(client.client_info()["resp"])
    finally:
        client.close()


def _dashboard_reads(settings: Settings, model: str, worker: str) -> None:
    """The dashboard's page, its JSON and rq-dashboard's JSON of queues and workers, read through
    ``settings``' URL (the app's clients speak its protocol)."""
    client = create_app(settings).test_client()
    page = client.get("/")
    assert page.status_code == 200 and model in page.text, page.text[:2000]
    info = client.get("/api/info")
    assert info.status_code == 200 and model in [m["model"] for m in _body(info)["models"]], info.text[:2000]
    queues = client.get("/rq/0/data/queues.json")
    assert queues.status_code == 200 and keys.queue_name(model) in [q["name"] for q in _body(queues)["queues"]]
    workers = client.get("/rq/0/data/workers.json")
    assert workers.status_code == 200 and worker in [w["name"] for w in _body(workers)["workers"]], workers.text
    listed = client.get(f"/rq/0/data/jobs/{keys.queue_name(model)}/finished/100/asc/1.json")
    assert listed.status_code == 200, listed.text[:2000]


def _body(response: Any) -> Any:
    """A test client response's JSON (None would mean it was no JSON)."""
    body = response.get_json()
    assert body is not None, response.text[:2000]
    return body


def _scrape(settings: Settings) -> dict[tuple[str, str | None], float]:
    """One exporter scrape (what GET /metrics answers), as (series, model) -> value."""
    shards, clients = shard_clients(settings, "-")
    registry = CollectorRegistry()
    registry.register(QueueCollector(clients, shards, settings.heartbeat_seconds))
    try:
        body = generate_latest(registry).decode()
    finally:
        for client in clients.values():
            client.close()
    return {
        (sample.name, sample.labels.get("model")): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def test_settings_connect_speaks_the_url_s_protocol_and_pins_none(server: LocalRedis) -> None:
    """``?protocol=N`` reaches the connection; without it, redis-py's default (RESP3 from redis-py 8
    on, RESP2 before), both of which the case above covers: ortq pins no protocol of its own."""
    for protocol in (2, 3):
        client = Settings.from_url(f"{server.url}?protocol={protocol}").connect()
        try:
            assert client.connection_pool.connection_kwargs.get("protocol") == protocol
            assert int(client.client_info()["resp"]) == protocol
        finally:
            client.close()
    plain = Settings.from_url(server.url).connect()
    try:
        assert plain.connection_pool.connection_kwargs.get("protocol") is None  # redis-py's own default
    finally:
        plain.close()

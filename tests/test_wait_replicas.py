"""``wait_replicas`` (ortq/replication.py) on a real primary and replica: a submit returns, and a
worker counts an answer given, only once the replica has the write; a replica that does not confirm
(here stopped with SIGSTOP, so it stays connected and answers nothing) makes the submit a
BrokerUnavailable (maybe enqueued) and the worker send its answer again, fenced, until the replica
is back: then every job is answered exactly once, on the primary and on the replica."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys, wire
from ortq.errors import BrokerUnavailable
from ortq.localredis import LocalRedis
from ortq.producer import AsyncProducer, Producer
from ortq.replication import Confirm, NotReplicated
from ortq.rqcompat import layout
from ortq.rqcompat.book import Book, Finished
from ortq.settings import Settings
from tests.conftest import WorkerProcesses, eventually
from tests.test_worker_inprocess import push, start

#: Milliseconds each WAIT may take here: short, so that a stopped replica is noticed quickly.
WAIT_MS = 200


class Replicated:
    """A primary and its replica, each a redis-server of its own; ``paused()`` stops the replica."""

    def __init__(self) -> None:
        self.primary = LocalRedis().start()
        self.replica = LocalRedis(extra_args=("--replicaof", "127.0.0.1", str(self.primary.port))).start()
        self.client = redis.Redis.from_url(self.primary.url)
        self.replica_client = redis.Redis.from_url(self.replica.url)
        eventually(self._synced, timeout=30)

    def _synced(self) -> bool:
        info = self.client.info("replication")
        return any(isinstance(v, dict) and v.get("state") == "online" for k, v in info.items() if k.startswith("slave"))

    def pause(self) -> None:
        os.kill(self.replica.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.replica.process.pid, signal.SIGCONT)

    def both(self) -> list[redis.Redis]:
        """Clients of the primary and of the replica (which has caught up: WAIT 1 answered 1)."""
        assert self.client.wait(1, 10_000) == 1
        return [self.client, self.replica_client]

    def stop(self) -> None:
        self.resume()
        for client in (self.client, self.replica_client):
            client.close()
        self.replica.stop()
        self.primary.stop()


@pytest.fixture
def replicated() -> Iterator[Replicated]:
    servers = Replicated()
    try:
        yield servers
    finally:
        servers.stop()


def _answers(client: redis.Redis, model: str, job_id: str) -> tuple[int, int]:
    """How many reply entries and RQ result entries a job has."""
    return client.xlen(keys.reply_key(model, job_id)), client.xlen(layout.results_key(job_id))


def test_an_answer_no_replica_confirms_raises_and_a_second_send_writes_nothing_again(
    replicated: Replicated, model_name: str
) -> None:
    connection = replicated.client
    book = Book(connection, f"w-{uuid.uuid4().hex[:8]}", keys.queue_name(model_name), confirm=Confirm(1, WAIT_MS))
    finished_id, failed_id = str(uuid.uuid4()), str(uuid.uuid4())
    push(connection, model_name, finished_id)
    push(connection, model_name, failed_id)
    [done], _ = start(connection, book)
    [failed], _ = start(connection, book)
    response = wire.encode_response({"y": np.ones((1, 4), np.float32)})
    error = wire.encode_error("RuntimeError", "it broke")

    replicated.pause()
    with pytest.raises(NotReplicated, match=r"0 of 1 replica\(s\) confirmed the write within 200 ms"):
        book.finish([Finished(done, response, 60, b"\x90")])
    with pytest.raises(NotReplicated):
        book.fail(failed, error, 60, "it broke", None)
    assert _answers(connection, model_name, finished_id) == (1, 1)  # written on the primary alone
    replicated.resume()
    # Sent again, as the worker does: the scripts are fenced, so nothing is written twice; the
    # failure still counts as this worker's answer (written by its first send).
    assert book.finish([Finished(done, response, 60, b"\x90")]) == 0
    assert book.fail(failed, error, 60, "it broke", None) is True
    for client in replicated.both():
        assert _answers(client, model_name, finished_id) == (1, 1)
        assert client.xrange(keys.reply_key(model_name, finished_id))[0][1][b"frame"] == response
        assert _answers(client, model_name, failed_id) == (1, 1)
        assert client.hget(keys.job_key(failed_id), "status") == b"failed"
    # With no replica asked for, nothing is waited for: a stopped replica changes nothing.
    replicated.pause()
    plain = Book(connection, f"w-{uuid.uuid4().hex[:8]}", keys.queue_name(model_name))
    third = str(uuid.uuid4())
    push(connection, model_name, third)
    [job], _ = start(connection, plain)
    assert plain.finish([Finished(job, response, 60, None)]) == 1


def test_a_submit_no_replica_confirms_is_refused_and_its_job_answered_once_when_the_replica_is_back(
    replicated: Replicated, model_name: str, tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTQ_WAIT_REPLICAS", "1")
    monkeypatch.setenv("ORTQ_WAIT_REPLICAS_MS", str(WAIT_MS))
    url = replicated.primary.url
    settings = Settings.from_url(url, wait_replicas=1, wait_replicas_ms=WAIT_MS)
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    workers = WorkerProcesses(tmp_path)
    try:
        workers.serve(tiny_path, model_name, url)
        with Producer(settings=settings) as producer:
            np.testing.assert_array_equal(
                producer.infer(model_name, {"x": x}, timeout=30)["y"], session.run(None, {"x": x})[0]
            )
            replicated.pause()
            refused = [str(uuid.uuid4()), str(uuid.uuid4())]
            with pytest.raises(BrokerUnavailable, match=r"0 of 1 replica\(s\) confirmed.*may have been enqueued"):
                producer.submit(model_name, {"x": x}, job_id=refused[0])

            async def submit_async() -> None:
                async with AsyncProducer(settings=settings) as aproducer:
                    await aproducer.submit(model_name, {"x": x}, job_id=refused[1])

            with pytest.raises(BrokerUnavailable, match=r"0 of 1 replica\(s\) confirmed.*may have been enqueued"):
                asyncio.run(submit_async())
            # Both were enqueued on the primary: the worker runs them, and cannot get their
            # answers confirmed either, until the replica is back.
            eventually(lambda: "replica(s) confirmed the write" in workers.logs(), timeout=30)
            replicated.resume()
            for job_id in refused:
                outputs = producer.job(job_id, model_name).result(timeout=30)
                np.testing.assert_array_equal(outputs["y"], session.run(None, {"x": x})[0])
        eventually(lambda: "delivering results" in workers.logs() and _settled(replicated, model_name, refused), 30)
    finally:
        workers.stop_all()
    for client in replicated.both():
        for job_id in refused:
            assert _answers(client, model_name, job_id) == (1, 1), job_id


def _settled(replicated: Replicated, model: str, job_ids: list[str]) -> bool:
    """Every job finished on the replica too (the worker's answers confirmed)."""
    client = replicated.replica_client
    return all(client.hget(keys.job_key(job_id), "status") == b"finished" for job_id in job_ids)

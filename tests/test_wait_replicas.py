"""``wait_replicas`` (ortq/replication.py) on a real primary and replica: a submit returns, and a
worker counts an answer given, only once the replica has the write; a replica that does not confirm
(here stopped with SIGSTOP, so it stays connected and answers nothing) makes the submit a
BrokerUnavailable (maybe enqueued) and the worker send its answer again, fenced, until the replica
is back: then every job is answered exactly once, on the primary and on the replica.

Under the ACL: a producer and an ``ortq worker`` whose users have exactly docs/security.md's rules
plus its wait_replicas part run jobs end to end; with a part missing, both say what to add, at
once (a ConfigurationError that says the jobs were enqueued; exit 2), neither hangs nor retries.
tests/test_job_ownership.py fails each of the worker's confirmations in turn."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys, wire
from ortq.errors import EXIT_CONFIGURATION, BrokerUnavailable, ConfigurationError, InferenceFailed
from ortq.localredis import LocalRedis
from ortq.producer import AsyncProducer, Producer
from ortq.replication import ACL_RULES, Confirm, NotReplicated
from ortq.rqcompat import layout
from ortq.rqcompat.book import Book, Finished
from ortq.settings import Settings
from tests.conftest import REPO, WorkerProcesses, eventually
from tests.test_tenant_safety import acl_rules
from tests.test_transport_security import PRODUCER_RULES, WORKER_RULES
from tests.test_worker_inprocess import answers, push, start

#: Milliseconds each WAIT may take here: short, so that a stopped replica is noticed quickly.
WAIT_MS = 200


class Replicated:
    """A primary and its replica, each a redis-server of its own; ``paused()`` stops the replica."""

    def __init__(self) -> None:
        # The first sync at once: Redis waits 5 s by default for more replicas to share it.
        self.primary = LocalRedis(extra_args=("--repl-diskless-sync-delay", "0")).start()
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
    """How many entries answer a job in the reply stream its hash names, and how many RQ result entries it has."""
    return len(answers(client, model, [job_id])[job_id]), client.xlen(layout.results_key(job_id))


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
    # The replica caught up first (it may take longer than the book's 200 ms on a busy machine).
    assert connection.execute_command("WAIT", 1, 10_000) == 1
    # Sent again, as the worker does: the scripts are fenced, so nothing is written twice; the
    # failure still counts as this worker's answer (written by its first send).
    assert book.finish([Finished(done, response, 60, b"\x90")]) == 0
    assert book.fail(failed, error, 60, "it broke", None) is True
    for client in replicated.both():
        assert _answers(client, model_name, finished_id) == (1, 1)
        assert answers(client, model_name, [finished_id]) == {finished_id: [response]}
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
        # Served with the replica up (confirmed within 10 s: on a loaded machine the replica's
        # acknowledgement can take longer than WAIT_MS, which the refusal below is about).
        with Producer(settings=Settings.from_url(url, wait_replicas=1, wait_replicas_ms=10_000)) as patient:
            np.testing.assert_array_equal(
                patient.infer(model_name, {"x": x}, timeout=30)["y"], session.run(None, {"x": x})[0]
            )
        with Producer(settings=settings) as producer:
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


# ---------------------------------------------------------------------------- under the ACL

#: What docs/security.md says to add to the producer and the worker rules for ``wait_replicas``: PUBLISH
#: in a selector of its own, so that it reaches ortq:replicated alone (the worker's user may use RQ's
#: command channels too, for SUBSCRIBE: a PUBLISH there would stop other workers).
WAIT_REPLICAS_RULES = "+wait (+publish &ortq:replicated)"


@dataclass
class Users:
    """ACL users on the primary of ``replicated`` (the replica copies the data, not the users)."""

    replicated: Replicated
    passwords: dict[str, str] = field(default_factory=dict)

    def add(self, rules: str) -> str:
        user = f"u-{uuid.uuid4().hex[:8]}"
        password = self.passwords[user] = secrets.token_hex(8)
        self.replicated.client.execute_command("ACL", "SETUSER", user, "on", f">{password}", *acl_rules(rules))
        return user

    def url(self, user: str) -> str:
        return f"redis://{user}:{self.passwords[user]}@127.0.0.1:{self.replicated.primary.port}/0"

    def denied(self) -> set[tuple[str, str, str]]:
        return {(e["username"], e["reason"], e["object"]) for e in self.replicated.client.acl_log()}


def test_the_documented_rules_with_wait_replicas_run_jobs_end_to_end(
    replicated: Replicated, model_name: str, tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer and an ``ortq worker`` process whose users have exactly docs/security.md's rules
    plus its wait_replicas part: jobs (one, a batch, a high-priority one, a bad one) answered, with
    outputs equal to a direct ``session.run``, confirmed on the replica; Redis refused them nothing."""
    users = Users(replicated)
    producer_user = users.add(f"{PRODUCER_RULES} {WAIT_REPLICAS_RULES}")
    worker_user = users.add(f"{WORKER_RULES} {WAIT_REPLICAS_RULES}")
    replicated.client.acl_log_reset()
    monkeypatch.setenv("ORTQ_WAIT_REPLICAS", "1")
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal((int(n), 4)).astype(np.float32) for n in rng.integers(1, 4, 6)]
    workers = WorkerProcesses(tmp_path)
    try:
        batching = ("--max-batch", "4", "--rows-independent")
        workers.serve(tiny_path, model_name, users.url(worker_user), 1, *batching, watch_url=replicated.primary.url)
        settings = Settings.from_url(users.url(producer_user), wait_replicas=1)
        with Producer(settings=settings) as producer, Producer(settings=settings, validate=False) as loose:
            single = producer.infer(model_name, {"x": inputs[0]}, timeout=30)
            jobs = producer.submit_many(model_name, [{"x": x} for x in inputs[1:5]])
            jobs.append(producer.submit(model_name, {"x": inputs[5]}, priority="high"))  # FCALL
            outputs = [single, *producer.results(jobs, timeout=30)]
            bad = loose.submit(model_name, {"x": np.ones((1, 4), np.float64)})
            with pytest.raises(InferenceFailed, match="InvalidInput"):
                bad.result(timeout=30)
        for x, got in zip(inputs, outputs, strict=True):
            np.testing.assert_array_equal(got["y"], session.run(None, {"x": x})[0])
        answered = [job.id for job in jobs] + [bad.id]
        eventually(lambda: _settled(replicated, model_name, [job.id for job in jobs]), 30)
        # Confirmed indeed: the producers' 4 submits, and the worker's answers (the single job, the
        # batch or batches, the failure): 7 WAITs at least.
        assert replicated.client.info("commandstats")["cmdstat_wait"]["calls"] >= 7
        for client in replicated.both():
            for job_id in answered:
                assert _answers(client, model_name, job_id) == (1, 1), job_id
        assert users.denied() == set(), "Redis refused the documented users something"
        # The selector: the worker's user publishes on ortq:replicated alone, not on RQ's command channels.
        worker_client = redis.Redis.from_url(users.url(worker_user))
        with worker_client, pytest.raises(redis.exceptions.NoPermissionError):
            worker_client.publish("rq:pubsub:some-worker", '{"command": "shutdown"}')
        assert workers.processes[0][0].poll() is None, workers.logs()
    finally:
        workers.stop_all()


#: The wait_replicas rules less one part, and Redis's words for what it then refuses.
PARTIAL_RULES = {
    "no WAIT": ("(+publish &ortq:replicated)", "no permissions to run the 'wait' command"),
    "no channel": ("+wait (+publish)", "no permissions to access"),
}


@pytest.mark.parametrize("lacking", sorted(PARTIAL_RULES))
def test_a_user_lacking_the_wait_replicas_rules_gets_a_clear_error(
    replicated: Replicated,
    model_name: str,
    tiny_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    lacking: str,
) -> None:
    """With ``wait_replicas`` set, a producer and an ``ortq worker`` whose users have the documented
    rules but not all of their wait_replicas part (a command, or the channel) are told so, at once:
    the producer's submit raises a ConfigurationError that says its job was enqueued all the same
    (it was: it is answered) and what to add; the worker, whose answer went through before its
    confirmation was refused, exits 2 saying what to add. Neither hangs nor retries."""
    users = Users(replicated)
    partial, refusal = PARTIAL_RULES[lacking]
    producer_user = users.add(f"{PRODUCER_RULES} {partial}")
    worker_user = users.add(f"{WORKER_RULES} {partial}")
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    monkeypatch.setenv("ORTQ_WAIT_REPLICAS", "1")
    advice = f"add `{WAIT_REPLICAS_RULES}` to its ACL rule (docs/security.md, 'ACL users'), or set wait_replicas to 0"
    workers = WorkerProcesses(tmp_path)
    try:
        process = workers.start(tiny_path, model_name, users.url(worker_user))
        job_id = str(uuid.uuid4())
        with Producer(settings=Settings.from_url(replicated.primary.url)) as admin:
            admin.wait_for_workers(model_name, 1, timeout=60)
            settings = Settings.from_url(users.url(producer_user), wait_replicas=1)
            with Producer(settings=settings) as producer, pytest.raises(ConfigurationError) as refused:
                producer.submit(model_name, {"x": x}, job_id=job_id)
            said = str(refused.value)
            assert said.startswith(f"1 job(s) for {model_name!r} were enqueued but not confirmed: "), said
            assert refusal in said and advice in said and users.passwords[producer_user] not in said, said
            outputs = admin.job(job_id, model_name).result(timeout=30)  # enqueued indeed, and run
            np.testing.assert_array_equal(outputs["y"], session.run(None, {"x": x})[0])
        assert process.wait(30) == EXIT_CONFIGURATION, workers.logs()
        [line] = [line for line in workers.logs().splitlines() if " CRITICAL " in line]
        assert "this worker's answers are written but cannot be confirmed" in line, line
        assert refusal in line and advice in line, line
    finally:
        workers.stop_all()


def test_the_documented_wait_replicas_rules_are_the_tested_ones() -> None:
    security = " ".join((REPO / "docs" / "security.md").read_text().split())
    assert f"add `{WAIT_REPLICAS_RULES}` to both users" in security
    assert ACL_RULES == WAIT_REPLICAS_RULES  # what ortq's error tells a user to add

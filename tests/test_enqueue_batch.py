"""A ``submit_many``'s enqueue MULTI (ortq/producer/enqueue.py ``add_enqueues``, docs/wire-format.md
section 3.2): each job's SET, HSET and EXPIRE, then one SADD of ``rq:queues`` and one RPUSH of
all the batch's ids in order (``PUSH_CHUNK`` ids a command), not an SADD and an RPUSH a job.

First the I/O-free plan of the steps (ortq/producer/submitting.py), then both producers on a
redis-server of this module's own, whose ``INFO commandstats`` counts what they sent: the queue,
the jobs' records and their expiries are what one RPUSH a job left, high-priority jobs still go
in by FCALL (or EVAL, without ortq's function) in order, and a queue key of the wrong type fails
every job of the batch and leaves nothing of them behind. The Node client (clients/node) sends the
same (run where its dependencies are installed: tests/test_node_client.py installs them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis

from ortq import keys, redisfunctions
from ortq.errors import CorruptRecord
from ortq.localredis import LocalRedis
from ortq.producer import AsyncProducer, Producer, checks, lookups, submitting
from ortq.producer.enqueue import PUSH_CHUNK, JobOptions, enqueue_errors
from ortq.producer.steps import Round, Stepper
from ortq.rqcompat import layout
from ortq.settings import Settings
from tests.conftest import REPO

X = {"x": np.ones((1, 4), np.float32)}
MODEL = "batch"


class Recorder:
    """A stand-in pipeline that notes each command a Round queues on it, by its Redis name."""

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any, **options: Any) -> None:
        self.commands.append(args)

    def __getattr__(self, name: str) -> Callable[..., None]:  # fcall, eval: redis-py's helpers
        return lambda *args, **kwargs: self.commands.append((name.upper(), *args))


def planned(count: int, priority: str = "normal") -> tuple[list[tuple[Any, ...]], list[str]]:
    """The commands of the enqueue MULTI of ``count`` jobs (every reply a success), and their ids."""
    settings = Settings.from_url("redis://127.0.0.1:1/0")
    check = lookups.ModelCheck(checks.SignatureCache(), validate=False, allow_unknown=True, routes=None)
    options = checks.job_options(settings, priority=priority)
    steps = submitting.submit_many(settings, check, lambda i, *rest: i, MODEL, [X] * count, options, None, False)
    stepper = Stepper(steps)
    multis = []
    while (request := stepper.next()) is not None:
        assert isinstance(request, Round) and request.transaction and request.once, request
        pipe = Recorder()
        request.queue(pipe)
        multis.append(pipe.commands)
        stepper.reply([1] * len(pipe.commands))
    assert len(multis) == 1, "one MULTI, sent once"
    ids: list[str] = stepper.result
    return multis[0], ids


def test_a_batch_is_three_commands_a_job_then_one_sadd_and_one_rpush_of_its_ids_in_order() -> None:
    commands, ids = planned(5)
    queue = keys.queue_key(MODEL)
    assert [c[0] for c in commands] == ["SET", "HSET", "EXPIRE"] * 5 + ["SADD", "RPUSH"]
    assert commands[-2] == ("SADD", keys.RQ_QUEUES_SET, queue)
    assert commands[-1] == ("RPUSH", queue, *ids)
    for i, job_id in enumerate(ids):
        assert commands[3 * i][1] == keys.request_key(MODEL, job_id)
        assert commands[3 * i + 1][1] == commands[3 * i + 2][1] == keys.job_key(job_id)
    # Every job's hash is the same fields, at one moment: that of the MULTI.
    assert len({c[2:] for c in commands if c[0] == "HSET"}) == 1


def test_a_large_batchs_ids_go_in_rpushes_of_push_chunk_ids_in_order() -> None:
    commands, ids = planned(2 * PUSH_CHUNK + 3)
    pushes = [c for c in commands if c[0] == "RPUSH"]
    assert [len(c) - 2 for c in pushes] == [PUSH_CHUNK, PUSH_CHUNK, 3]
    assert [job_id for c in pushes for job_id in c[2:]] == ids
    assert [c[0] for c in commands].count("SADD") == 1
    assert [c[0] for c in commands[-4:]] == ["SADD", "RPUSH", "RPUSH", "RPUSH"]


def test_a_high_priority_batch_is_an_fcall_a_job_and_no_rpush() -> None:
    commands, ids = planned(3, "high")
    assert [c[0] for c in commands] == ["SET", "HSET", "EXPIRE", "FCALL"] * 3 + ["SADD"]
    assert [c[-2] for c in commands if c[0] == "FCALL"] == ids  # its arguments: <id> <wait>


def test_a_failed_rpush_fails_every_job_it_carried_and_a_failed_sadd_none() -> None:
    count = PUSH_CHUNK + 2
    options = JobOptions(60, 60, 60)
    results: list[Any] = [1] * (3 * count) + [redis.ResponseError("sadd refused"), 1, redis.ResponseError("WRONGTYPE")]
    results[3 * 5 + 1] = hset = redis.ResponseError("WRONGTYPE hset")  # job 5's HSET
    failed = enqueue_errors(results, count, options)
    assert failed == [(5, hset), (PUSH_CHUNK, results[-1]), (PUSH_CHUNK + 1, results[-1])]
    results[-3] = 1
    results[-2] = first = redis.ResponseError("WRONGTYPE")
    failed = enqueue_errors(results, count, options)
    assert [index for index, _ in failed] == sorted([*range(PUSH_CHUNK), 5, PUSH_CHUNK, PUSH_CHUNK + 1])
    assert failed[5] == (5, hset) and failed[6] == (5, first)  # a job's own commands' errors first
    high = JobOptions(60, 60, 60, priority="high")
    fcall = redis.ResponseError("ERR Function not found")
    assert enqueue_errors([1, 1, 1, fcall, 1, 1, 1, 1, 1], 2, high) == [(0, fcall)]


# ------------------------------------------------------------------ on a real Redis


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    """A redis-server of this module's own: its command counts are this module's producers' alone."""
    with LocalRedis() as running:
        yield running


@pytest.fixture
def r(server: LocalRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


def calls(r: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = r.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(entry["calls"]) for name, entry in stats.items()}


def sent(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: count - before.get(name, 0) for name, count in after.items() if count != before.get(name, 0)}


def submit(url: str, kind: str, model: str, count: int, **options: Any) -> list[str]:
    settings = Settings.from_url(url)
    if kind == "sync":
        with Producer(settings=settings, allow_unknown_models=True) as producer:
            return [job.id for job in producer.submit_many(model, [X] * count, **options)]

    async def go() -> list[str]:
        async with AsyncProducer(settings=settings, allow_unknown_models=True) as producer:
            return [job.id for job in await producer.submit_many(model, [X] * count, **options)]

    return asyncio.run(go())


def queued(r: redis.Redis, model: str) -> list[str]:
    return [keys.as_text(e) for e in r.lrange(keys.queue_key(model), 0, -1)]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_producers_batch_is_one_rpush_and_one_sadd_and_leaves_every_job_queued(
    server: LocalRedis, r: redis.Redis, kind: str
) -> None:
    model = f"batch-{kind}"
    earlier = submit(server.url, kind, model, 1)
    before = calls(r)
    ids = submit(server.url, kind, model, 7, ttl=90)
    counts = sent(before, calls(r))
    assert {name: counts.get(name, 0) for name in ("set", "hset", "expire", "sadd", "rpush", "multi", "exec")} == {
        "set": 7, "hset": 7, "expire": 7, "sadd": 1, "rpush": 1, "multi": 1, "exec": 1,
    }  # fmt: skip
    assert queued(r, model) == [*earlier, *ids]
    assert r.sismember(keys.RQ_QUEUES_SET, keys.queue_key(model))
    settings = Settings.from_url(server.url)
    created = {r.hget(keys.job_key(job_id), "created_at") for job_id in ids}
    assert len(created) == 1 and None not in created
    for job_id in ids:
        record = r.hgetall(keys.job_key(job_id))
        assert record[b"status"] == b"queued" and record[b"origin"] == keys.queue_name(model).encode()
        assert record[b"ttl"] == b"90" and record[b"enqueued_at"] == record[b"created_at"]
        assert 90 < r.ttl(keys.job_key(job_id)) <= 90 + settings.failure_ttl
        assert 0 < r.ttl(keys.request_key(model, job_id)) <= 90


def test_a_batch_over_push_chunk_jobs_is_queued_whole_in_order(server: LocalRedis, r: redis.Redis) -> None:
    before = calls(r)
    ids = submit(server.url, "sync", "batch-large", PUSH_CHUNK + 1)
    counts = sent(before, calls(r))
    assert (counts["rpush"], counts["sadd"], counts["exec"]) == (2, 1, 1)
    assert queued(r, "batch-large") == ids


@pytest.mark.parametrize("function", ["fcall", "eval"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_high_priority_batch_goes_ahead_of_normal_jobs_in_order(
    server: LocalRedis, r: redis.Redis, kind: str, function: str
) -> None:
    """By FCALL of ortq's function, or (none loaded yet: no worker ran) by EVAL of its code."""
    model = f"batch-high-{kind}-{function}"
    if function == "fcall":
        assert redisfunctions.ensure_functions(r)
    else:
        with contextlib.suppress(redis.ResponseError):
            r.function_delete(redisfunctions.LIBRARY)
    normal = submit(server.url, kind, model, 2)
    first = submit(server.url, kind, model, 1, priority="high")
    before = calls(r)
    high = submit(server.url, kind, model, 3, priority="high")
    counts = sent(before, calls(r))
    assert counts.get(function, 0) == 3 and counts.get("rpush", 0) == 0 and counts["sadd"] == 1
    assert queued(r, model) == [*first, *high, *normal]
    assert r.get(keys.last_high_key(model)) == high[-1].encode()
    for job_id in high:
        assert r.hget(keys.job_key(job_id), "ortq_priority") == b"high"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_queue_key_of_the_wrong_type_fails_the_whole_batch_and_leaves_nothing(
    server: LocalRedis, r: redis.Redis, kind: str
) -> None:
    model = f"batch-wrong-{kind}"
    r.set(keys.queue_key(model), "not a list")
    with pytest.raises(CorruptRecord, match="could not enqueue 4 of 4 job"):
        submit(server.url, kind, model, 4)
    assert r.get(keys.queue_key(model)) == b"not a list"
    assert not r.keys(f"{keys.request_key(model, '')}*")
    job_keys = [keys.as_text(k) for k in r.keys(layout.job_key("*"))]
    origins = [r.hget(key, "origin") for key in job_keys]
    assert keys.queue_name(model).encode() not in origins


NODE = shutil.which("node")
NODE_CLIENT = REPO / "clients" / "node"
NODE_SUBMIT = """
import { Client } from './ortq.mjs';
const [url, model, count, priority] = process.argv.slice(1);
const client = new Client(url, { validate: false, allowUnknownModels: true });
const x = () => ({ x: { dtype: 'float32', shape: [1, 4], data: new Float32Array(4) } });
const inputs = Array.from({ length: Number(count) }, x);
try {
  console.log(JSON.stringify(await client.submitMany(model, inputs, { priority })));
} finally {
  await client.close();
}
"""


@pytest.mark.skipif(
    NODE is None or not (NODE_CLIENT / "node_modules").is_dir(),
    reason="needs node and the Node client's dependencies (installed by tests/test_node_client.py)",
)
@pytest.mark.parametrize(("priority", "count"), [("normal", 6), ("normal", PUSH_CHUNK + 1), ("high", 3)])
def test_the_node_clients_batch_is_one_rpush_and_one_sadd_too(
    server: LocalRedis, r: redis.Redis, priority: str, count: int
) -> None:
    assert NODE is not None
    model = f"batch-node-{priority}-{count}"
    assert redisfunctions.ensure_functions(r)
    before = calls(r)
    done = subprocess.run(
        [NODE, "--input-type=module", "-e", NODE_SUBMIT, server.url, model, str(count), priority],
        cwd=NODE_CLIENT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    ids = json.loads(done.stdout)
    counts = sent(before, calls(r))
    pushes = 0 if priority == "high" else -(-count // PUSH_CHUNK)
    assert (counts.get("rpush", 0), counts["sadd"], counts["exec"], counts["hset"]) == (pushes, 1, 1, count)
    assert counts.get("fcall", 0) == (count if priority == "high" else 0)
    assert queued(r, model) == ids
    for job_id in ids:
        assert r.hget(keys.job_key(job_id), "status") == b"queued"
        assert r.exists(keys.request_key(model, job_id))

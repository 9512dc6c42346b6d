"""What a producer with the documented ACL rules (docs/security.md) can and cannot do to other
producers' jobs, against a real redis-server with those users and a real ``ortq worker`` logged in
as the worker user. Plain TCP here: tests/test_transport_security.py runs the same rules over TLS.

Cannot (each refused by Redis itself): forge, replace or delete a reply (replies are streams only
workers write, read with XREAD); run Lua of its own (no EVAL: a busy loop would block the server,
and SCRIPT KILL cannot stop a script that has written); list queued job ids; push into the
intermediate lists; with per-model rules, enqueue for, or read anything of, another model.
Can, knowing a job's id (ids are random and never listed to producers): read its reply, replace
its queued request frame (its producer then refuses the answer: ResponseMismatch), rewrite or
delete its queued records (the job then fails, or times out). These are asserted too, so that the
docs stay honest.
"""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys, wire
from ortq.errors import ConfigurationError, ResponseMismatch
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.producer.priority import FUNCTION
from ortq.settings import Settings
from tests.conftest import WorkerProcesses
from tests.test_transport_security import PRODUCER_RULES, WORKER_RULES

pytestmark = pytest.mark.timeout(120)

#: A producer that may enqueue for one model only (docs/security.md, "one producer per model").
ONE_MODEL_RULES = (
    "resetchannels resetkeys -@all +ping +select +multi +exec +discard +fcall "
    "+type +strlen +set +get +mget +expire +hset +hget +sadd +srandmember +rpush +lpush +linsert +llen +lrem "
    "+xread +zadd "
    "%W~ortq:req:* ~rq:job:* %W~rq:queues ~rq:queue:ortq:{model} ~ortq:last-high:{model} %R~ortq:reply:* "
    "%W~rq:canceled:ortq:{model} %R~ortq:signature:{model} %R~ortq:workers %R~ortq:worker:* "
    "(+del %W~ortq:req:* %W~rq:job:*)"
)
MODEL, OTHER = "tenant-a", "tenant-b"
X = {"x": np.array([[1, 2, 3, 4]], np.float32)}


def acl_rules(rules: str) -> list[str]:
    """ACL SETUSER's arguments: one per rule, a ``(selector)`` whole."""
    return re.findall(r"\([^)]*\)|\S+", rules)


@dataclass
class Tenants:
    server: LocalRedis
    admin: redis.Redis
    passwords: dict[str, str]
    session: ort.InferenceSession

    def url(self, user: str) -> str:
        return f"redis://{user}:{self.passwords[user]}@127.0.0.1:{self.server.port}/0"

    def producer(self, user: str) -> Producer:
        return Producer(settings=Settings.from_url(self.url(user)))

    def denied(self) -> set[tuple[str, str, str]]:
        return {(e["username"], e["reason"], e["object"]) for e in self.admin.acl_log()}


@pytest.fixture(scope="module")
def tenants(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    users = {
        "producer": PRODUCER_RULES,
        "producer-a": ONE_MODEL_RULES.format(model=MODEL),
        "producer-b": ONE_MODEL_RULES.format(model=OTHER),
        "worker": WORKER_RULES,
    }
    with LocalRedis() as server:
        admin = redis.Redis.from_url(server.url)
        passwords = {user: secrets.token_hex(8) for user in users}
        for user, rules in users.items():
            admin.execute_command("ACL", "SETUSER", user, "on", f">{passwords[user]}", *acl_rules(rules))
        session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
        group = WorkerProcesses(tmp_path_factory.mktemp("tenant-workers"))
        ours = Tenants(server, admin, passwords, session)
        try:
            for model in (MODEL, OTHER):
                group.serve(tiny_path, model, ours.url("worker"), watch_url=server.url)
            admin.acl_log_reset()
            yield ours
            assert all(p.poll() is None for p, _ in group.processes), group.logs()
            assert {d for d in ours.denied() if d[0] == "worker"} == set(), "the worker user was refused something"
        finally:
            group.stop_all()
            admin.close()


def test_producers_run_jobs_and_the_worker_is_refused_nothing(tenants: Tenants) -> None:
    for user, model in (("producer", OTHER), ("producer-a", MODEL)):
        with tenants.producer(user) as producer:
            got = producer.infer(model, X, timeout=30)
            urgent = producer.submit(model, X, priority="high").result(timeout=30)  # FCALL under its rules
            for outputs in (got, urgent):
                np.testing.assert_array_equal(outputs["y"], tenants.session.run(None, X)[0])
    assert {d for d in tenants.denied() if d[0] == "worker"} == set()


def test_a_producer_can_neither_forge_nor_delete_a_reply_nor_run_lua(tenants: Tenants) -> None:
    with tenants.producer("producer") as victim_side:
        job = victim_side.submit(MODEL, X)
        job.result(timeout=30)
    attacker = redis.Redis.from_url(tenants.url("producer"))
    reply = keys.reply_key(job.id)
    forged = wire.encode_response({"y": np.zeros((1, 4), np.float32)})
    refused = {
        "append a forged reply": ("XADD", reply, "*", "frame", forged),
        "replace the reply": ("SET", reply, forged),
        "delete the reply": ("DEL", reply),
        "trim the reply": ("XTRIM", reply, "MAXLEN", "0"),
        "run its own Lua (a busy loop blocks the server)": ("EVAL", "while true do end", "0"),
        "load a function of its own": (
            "FUNCTION",
            "LOAD",
            "#!lua name=evil\nredis.register_function('e', function() end)",
        ),
        "list a queue's job ids": ("LRANGE", keys.queue_key(MODEL), "0", "-1"),
        "read a queued job id": ("LINDEX", keys.queue_key(MODEL), "0"),
        "list keys": ("SCAN", "0"),
        "read a request frame": ("GET", keys.request_key(job.id)),
    }
    for what, command in refused.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            attacker.execute_command(*command)
            pytest.fail(f"a producer could {what}")
    with tenants.producer("producer") as victim_side:
        np.testing.assert_array_equal(
            victim_side.job(job.id, MODEL).result(timeout=5)["y"], tenants.session.run(None, X)[0]
        )
    attacker.close()


def test_a_producer_scoped_to_one_model_cannot_touch_another(tenants: Tenants) -> None:
    b_side = redis.Redis.from_url(tenants.url("producer-b"))
    refused = {
        "enqueue for the other model": ("RPUSH", keys.queue_key(MODEL), "x"),
        "read its newest high-priority job id": ("GET", keys.last_high_key(MODEL)),
        "call ortq's function on its keys": (
            "FCALL",
            FUNCTION,
            "2",
            keys.queue_key(MODEL),
            keys.last_high_key(MODEL),
            "x",
            "60",
        ),
        "read its signature": ("GET", keys.signature_key(MODEL)),
        "count its queue": ("LLEN", keys.queue_key(MODEL)),
        "cancel its jobs": ("LREM", keys.queue_key(MODEL), "0", "x"),
        "push into an intermediate list, even its own model's": ("RPUSH", keys.queue_key(OTHER) + ":intermediate", "x"),
    }
    for what, command in refused.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            b_side.execute_command(*command)
            pytest.fail(f"a producer of {OTHER} could {what}")
    b_side.close()
    with tenants.producer("producer-b") as producer, pytest.raises(ConfigurationError):
        producer.submit(MODEL, X)


def test_a_replaced_request_frame_is_refused_by_its_producer(tenants: Tenants) -> None:
    """The one thing a producer who learns a queued job's id can do to its outputs: replace its
    request frame. The worker echoes the replaced frame's nonce, not the victim's: the victim gets
    ResponseMismatch, never outputs computed from someone else's inputs."""
    model = f"tenant-idle-{uuid.uuid4().hex[:6]}"  # no worker: the job waits while it is replaced
    with tenants.producer("producer") as victim:
        tenants.admin.set(keys.signature_key(model), tenants.admin.get(keys.signature_key(MODEL)) or b"")
        job = victim.submit(model, X)
        attacker = redis.Redis.from_url(tenants.url("producer"))
        other = wire.encode_request({"x": np.full((1, 4), 7, np.float32)}, {"nonce": secrets.token_bytes(16)})
        attacker.set(keys.request_key(job.id), other, ex=600)  # allowed: %W~ortq:req:*
        attacker.close()
        # A worker of that model now takes it (the admin moves it to a served model's queue).
        tenants.admin.lrem(keys.queue_key(model), 0, job.id)
        tenants.admin.rpush(keys.queue_key(MODEL), job.id)
        with pytest.raises(ResponseMismatch):
            job.result(timeout=30)


def test_what_a_producer_knowing_an_id_can_still_do(tenants: Tenants) -> None:
    """Documented in docs/security.md: reading a reply it knows the id of."""
    with tenants.producer("producer-a") as victim:
        job = victim.submit(MODEL, X)
        outputs = job.result(timeout=30)
    snooper = redis.Redis.from_url(tenants.url("producer-b"))  # even a producer of another model
    [(_, [(_, fields)])] = snooper.xread({keys.reply_key(job.id): "0-0"})
    np.testing.assert_array_equal(wire.decode_response(fields[b"frame"]).outputs["y"], outputs["y"])
    snooper.close()


def test_the_documented_per_model_rule_is_the_tested_one() -> None:
    security = (Path(__file__).parent.parent / "docs" / "security.md").read_text()
    assert f"user producer-digits on #<sha256 of its password> {ONE_MODEL_RULES.format(model='digits')}\n" in security

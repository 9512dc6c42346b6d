"""What a producer with the documented ACL rules (docs/security.md) can and cannot do to other
producers' jobs, against a real redis-server with those users and a real ``ortq worker`` logged in
as the worker user. Plain TCP here: tests/test_transport_security.py runs the same rules over TLS.

Cannot (each refused by Redis itself): forge, replace or delete a reply (a producer's reply stream,
or a large answer's own key: streams only workers write, read with XREAD); take a job out of its
queue's finished registry (a job in it is not run again); run Lua of its own (no EVAL: a busy
loop would block the server, and SCRIPT KILL cannot stop a script that has written); list queued
job ids; push into the intermediate lists; with per-model rules, enqueue for, or read anything of, another model: its
queue, request frames and replies (keys named by the model) included.
Cannot, by what the worker does (each attack written out below): make a producer accept outputs not
computed from its own request by a worker of its model (a replayed job is not run again; a job
pushed onto another model's queue is not run there; a replaced request is answered with the
attacker's proof, which its producer refuses); choose the words of an error its victim sees.
Can, knowing a job's id (ids are random and never listed to producers), within its own models: read
its reply, replace its queued request frame (its producer then refuses the answer), rewrite or
delete its queued records (the job then fails, or times out). These are asserted too, so that the
docs stay honest.
"""

from __future__ import annotations

import re
import secrets
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys, wire
from ortq.errors import ConfigurationError, InferenceFailed, ResponseMismatch
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.redisfunctions import FUNCTION
from ortq.rqcompat import layout
from ortq.rqcompat.book import Book
from ortq.settings import Settings
from tests.conftest import WorkerProcesses, eventually
from tests.test_fuzz import answers
from tests.test_transport_security import PRODUCER_RULES, WORKER_RULES

pytestmark = pytest.mark.timeout(120)

#: A producer that may enqueue for one model only (docs/security.md, "one producer per model").
ONE_MODEL_RULES = (
    "resetchannels resetkeys -@all +ping +select +multi +exec +discard +fcall "
    "+type +strlen +set +get +mget +expire +hset +hget +sadd +srandmember +rpush +lpush +linsert +llen +lrem "
    "+xread +zadd "
    "%W~ortq:req:{model}:* ~rq:job:* %W~rq:queues ~rq:queue:ortq:{model} ~ortq:last-high:{model} "
    "%R~ortq:reply:{model}:* %W~rq:canceled:ortq:{model} ~ortq:parked:{model}@* "
    "%R~ortq:signature:{model} %R~ortq:signature:{model}@* %R~ortq:workers %R~ortq:worker:* "
    "(+del %W~ortq:req:{model}:* %W~rq:job:*)"
)
MODEL, OTHER = "tenant-a", "tenant-b"
X = {"x": np.array([[1, 2, 3, 4]], np.float32)}


def acl_rules(rules: str) -> list[str]:
    """ACL SETUSER's arguments: one per rule, a ``(selector)`` whole."""
    return re.findall(r"\([^)]*\)|\S+", rules)


def read_answer(client: redis.Redis, model: str, job_id: str) -> tuple[bytes, dict[bytes, bytes]]:
    """(entry id, fields) of the entry answering ``job_id``, read as a producer that did not follow
    its reply stream reads it, with the commands the producer rules grant (docs/wire-format.md,
    section 4.1): ``ortq_reply`` and ``ortq_answer`` from its hash (two HGETs: no HMGET there), then
    one XREAD of the stream ``ortq_reply`` names, from just below ``ortq_answer``."""
    name = client.hget(keys.job_key(job_id), "ortq_reply")
    entry = client.hget(keys.job_key(job_id), "ortq_answer")
    assert name is not None and entry is not None, (name, entry)
    ms, seq = (int(part) for part in entry.split(b"-"))
    below = f"{ms}-{seq - 1}" if seq else f"{ms - 1}-18446744073709551615"
    [(_, [(found, fields)])] = client.xread({keys.reply_key(model, name.decode()): below}, count=1)
    assert found == entry and fields[keys.REPLY_ID_FIELD] == job_id.encode(), (found, entry, fields)
    return found, fields


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
        stream = keys.reply_key(MODEL, victim_side.reply_name)  # the victim's reply stream
    attacker = redis.Redis.from_url(tenants.url("producer"))
    entry, _ = read_answer(attacker, MODEL, job.id)  # it may read it: it knows the job's id
    large = keys.large_reply_key(MODEL, job.id)  # where the job's frame would be, were it large
    forged = wire.encode_response({"y": np.zeros((1, 4), np.float32)})
    refused = {
        "append a forged answer to a producer's reply stream": ("XADD", stream, "*", "id", job.id, "frame", forged),
        "replace the reply stream": ("SET", stream, forged),
        "delete the reply stream": ("DEL", stream),
        "trim the reply stream": ("XTRIM", stream, "MAXLEN", "0"),
        "delete the job's answer from it": ("XDEL", stream, entry),
        "make the reply stream expire": ("EXPIRE", stream, "1"),
        "write a job's large answer": ("XADD", large, "*", "frame", forged),
        "replace a job's large answer": ("SET", large, forged),
        "delete a job's large answer": ("DEL", large),
        "take a job out of its finished registry (to have it run again)": (
            "ZREM",
            layout.QueueKeys.of(keys.queue_name(MODEL)).finished,
            job.id,
        ),
        "forge an entry of a finished registry": (
            "ZADD",
            layout.QueueKeys.of(keys.queue_name(MODEL)).finished,
            "1",
            "some-job",
        ),
        "run its own Lua (a busy loop blocks the server)": ("EVAL", "while true do end", "0"),
        "load a function of its own": (
            "FUNCTION",
            "LOAD",
            "#!lua name=evil\nredis.register_function('e', function() end)",
        ),
        "list a queue's job ids": ("LRANGE", keys.queue_key(MODEL), "0", "-1"),
        "read a queued job id": ("LINDEX", keys.queue_key(MODEL), "0"),
        "list keys": ("SCAN", "0"),
        "read a request frame": ("GET", keys.request_key(MODEL, job.id)),
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
        "write a request frame of the other model's": ("SET", keys.request_key(MODEL, "x"), "frame"),
        "delete one": ("DEL", keys.request_key(MODEL, "x")),
        "read a reply of the other model's": (
            "XREAD",
            "STREAMS",
            keys.reply_key(MODEL, keys.new_reply_name(600)),
            "0-0",
        ),
        "read a large answer of the other model's": ("XREAD", "STREAMS", keys.large_reply_key(MODEL, "x"), "0-0"),
        "take a job off the other model's parked list": ("LREM", keys.parked_key(MODEL, "v9"), "0", "x"),
        "write its own model's parked versions": ("SADD", keys.parked_versions_key(OTHER), "x"),
    }
    for what, command in refused.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            b_side.execute_command(*command)
            pytest.fail(f"a producer of {OTHER} could {what}")
    b_side.close()
    with tenants.producer("producer-b") as producer, pytest.raises(ConfigurationError):
        producer.submit(MODEL, X)


def test_a_producer_cancels_its_job_parked_for_a_version_under_its_rule(tenants: Tenants) -> None:
    """A job pinned to v9 that a worker of v1 parked (start.lua itself, on the admin's connection)
    is in no queue: its producer's cancel, under the one-model rule, takes it off the parked list
    and cancels it (it returned False and left the job parked before); the rule grants the LREM."""
    with held_in_the_queue(tenants), tenants.producer("producer-a") as producer:
        job = producer.submit(MODEL, X)
        tenants.admin.hset(keys.job_key(job.id), "ortq_version", "v9")  # as a producer pinning it writes it
        book = Book(tenants.admin, "parker", keys.queue_name(MODEL), version="v1", parked_ttl=600)
        reply, moment, _ = book.start(b"", 10)
        _, skipped = book.parse_start(reply, moment)
        assert [(s.entry.decode(), s.reason) for s in skipped] == [(job.id, "parked")]
        assert job.cancel() is True
        assert tenants.admin.llen(keys.parked_key(MODEL, "v9")) == 0
        assert job.status() == "canceled" and not tenants.admin.exists(keys.request_key(MODEL, job.id))
        assert job.cancel() is False  # gone from every list: nothing to take off, not started
    assert not {d for d in tenants.denied() if d[0] == "producer-a"}


def _all_suspended(tenants: Tenants) -> bool:
    """Every worker of both models says, in RQ's record of it, that it is suspended (state
    ``suspended``, which it writes when a take finds the suspension, before waiting instead of
    taking): none is taking, and none takes again until the suspension ends."""
    with Producer(settings=Settings.from_url(tenants.server.url)) as admin:  # the admin reads every record
        names = [record["name"] for model in (MODEL, OTHER) for record in admin.workers(model)]
    assert len(names) == 2, names  # the fixture's two workers, one a model
    return all(tenants.admin.hget(layout.worker_key(name), "state") == b"suspended" for name in names)


@contextmanager
def held_in_the_queue(tenants: Tenants) -> Iterator[None]:
    """Workers take no job meanwhile (RQ's suspension): a job submitted inside waits in its queue.
    Entered once every worker has said it is suspended (its RQ state), whatever that took."""
    suspended = layout.suspended_key()
    tenants.admin.set(suspended, 1)
    try:
        eventually(lambda: _all_suspended(tenants), 90, "every worker's RQ state 'suspended'")
        yield
    finally:
        tenants.admin.delete(suspended)


def test_a_replaced_request_frame_is_refused_by_its_producer(tenants: Tenants) -> None:
    """A producer who learns a queued job's id can replace its request frame. The worker answers
    with the proof of the frame it read (the attacker's nonce, which is not the victim's): the
    victim gets ResponseMismatch, never outputs computed from someone else's inputs."""
    with tenants.producer("producer-a") as victim, held_in_the_queue(tenants):
        job = victim.submit(MODEL, X)
        attacker = redis.Redis.from_url(tenants.url("producer-a"))  # a tenant of the same model
        other = wire.encode_request({"x": np.full((1, 4), 7, np.float32)}, {"nonce": secrets.token_bytes(16)})
        attacker.set(keys.request_key(MODEL, job.id), other, ex=600)  # allowed: %W~ortq:req:<model>:*
        attacker.close()
    with tenants.producer("producer-a") as victim, pytest.raises(ResponseMismatch):
        victim.wait_response(job.id, MODEL, 30, job.proof)


def test_a_replayed_job_is_not_run_again(tenants: Tenants) -> None:
    """Replay (issue 25, 3a): an attacker who knows an answered job's id reads its reply (no nonce
    there any more: only the proof), sets the job back to queued, writes a request of its own and
    pushes the id again. The worker runs no job in its queue's finished or failed registry (which
    only workers write): the job's one answer stays the victim's."""
    with tenants.producer("producer-a") as victim:
        job = victim.submit(MODEL, X)
        outputs = job.result(timeout=30)
        attacker = redis.Redis.from_url(tenants.url("producer-a"))
        _, fields = read_answer(attacker, MODEL, job.id)
        read = wire.decode_response(fields[b"frame"])
        assert read.proof == job.proof and b"nonce" not in fields[b"frame"]  # nothing to replay with
        forged = {"x": np.full((1, 4), 7, np.float32)}
        attacker.hset(keys.job_key(job.id), mapping={"status": "queued"})
        attacker.set(keys.request_key(MODEL, job.id), wire.encode_request(forged, {"nonce": job.proof[:16]}), ex=600)
        attacker.rpush(keys.queue_key(MODEL), job.id)
        eventually(lambda: tenants.admin.llen(keys.queue_key(MODEL)) == 0)
        victim.infer(MODEL, X, timeout=30)  # taken after the replayed entry: that one has been dealt with
        assert tenants.admin.xlen(layout.results_key(job.id)) == 1  # run once
        assert len(answers(tenants.admin, MODEL, job.id)) == 1  # answered once, in the victim's stream
        np.testing.assert_array_equal(job.result(timeout=5)["y"], outputs["y"])
        with tenants.producer("producer-a") as later:  # a handle made later finds it through the hash
            np.testing.assert_array_equal(later.job(job.id, MODEL).result(timeout=5)["y"], outputs["y"])
        attacker.close()


def test_a_job_pushed_onto_another_models_queue_is_not_run_there(tenants: Tenants) -> None:
    """Cross-model (issue 25, 3b): producer-b pushes a job of model a onto b's own queue, as is
    own record and all, or with its record's origin rewritten to b's queue. b's worker runs neither
    on model a's request: the first is skipped (its record names a's queue), the second reads no
    request (b's worker reads b's keys only) and fails there without touching a's request or reply
    (its failure goes to model b's stream of the victim's reply name, which the victim does not
    read). The job of model a is then answered by a's worker, with outputs of its own inputs."""
    x = {"x": np.full((1, 4), 3, np.float32)}
    with tenants.producer("producer-a") as victim:
        with held_in_the_queue(tenants):
            job = victim.submit(MODEL, x)
            b_side = redis.Redis.from_url(tenants.url("producer-b"))
            b_side.rpush(keys.queue_key(OTHER), job.id)  # allowed: its own queue
        eventually(lambda: tenants.admin.llen(keys.queue_key(OTHER)) == 0)
        np.testing.assert_array_equal(job.result(timeout=30)["y"], tenants.session.run(None, x)[0])
        assert answers(tenants.admin, OTHER, job.id) == []  # b's worker answered nothing
        assert len(answers(tenants.admin, MODEL, job.id)) == 1
        with held_in_the_queue(tenants):
            second = victim.submit(MODEL, x)
            b_side.hset(keys.job_key(second.id), "origin", keys.queue_name(OTHER))  # allowed: ~rq:job:*
            b_side.rpush(keys.queue_key(OTHER), second.id)
        eventually(lambda: len(answers(tenants.admin, OTHER, second.id)) == 1)  # b's worker failed it
        assert answers(tenants.admin, MODEL, second.id) == []  # nothing in a's reply stream
        assert not tenants.admin.exists(keys.large_reply_key(MODEL, second.id))
        assert tenants.admin.exists(keys.request_key(MODEL, second.id))  # a's request never read
        [(_, frame)] = answers(tenants.admin, OTHER, second.id)
        assert wire.decode_response(frame).error is not None
        b_side.close()


def test_an_attacker_cannot_choose_the_words_of_a_victims_error(tenants: Tenants) -> None:
    """Errors (issue 25, 3c): what an attacker can write into a victim's job (a request frame that
    does not decode, a job record naming another function) fails the job, but the error its
    producer accepts is in the worker's own words, not the attacker's: an error written without
    reading the request carries fixed words; one written after reading it carries its proof."""
    words = "CALL-555-0100-TO-RESTORE-YOUR-ACCOUNT"
    with tenants.producer("producer-a") as victim:
        with held_in_the_queue(tenants):
            garbled, renamed = victim.submit_many(MODEL, [X, X])
            attacker = redis.Redis.from_url(tenants.url("producer-a"))
            header = msgpack.packb({"v": 1, "kind": "request", "inputs": {words: "x"}})
            attacker.set(keys.request_key(MODEL, garbled.id), wire.MAGIC + struct.pack("<I", len(header)) + header)
            forged_data = msgpack.packb([words, None, [MODEL], {}])
            attacker.hset(keys.job_key(renamed.id), "data", forged_data)
            attacker.close()
        for job, error_type in ((garbled, "WireFormatError"), (renamed, "UnknownJobFunction")):
            with pytest.raises(InferenceFailed) as failed:
                job.result(timeout=30)
            assert failed.value.remote_type == error_type and words not in str(failed.value), failed.value


def test_what_a_producer_knowing_an_id_can_still_do(tenants: Tenants) -> None:
    """Documented in docs/security.md: reading a reply it knows the id of, within the models its
    rule names (the all-models rule: any); not another model's under a per-model rule."""
    with tenants.producer("producer-a") as victim:
        job = victim.submit(MODEL, X)
        outputs = job.result(timeout=30)
    snooper = redis.Redis.from_url(tenants.url("producer"))  # the all-models rule
    _, fields = read_answer(snooper, MODEL, job.id)
    np.testing.assert_array_equal(wire.decode_response(fields[b"frame"]).outputs["y"], outputs["y"])
    snooper.close()
    other_tenant = redis.Redis.from_url(tenants.url("producer-b"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        read_answer(other_tenant, MODEL, job.id)  # its hash read (~rq:job:*), not the stream it names
    with pytest.raises(redis.exceptions.NoPermissionError):
        other_tenant.xread({keys.large_reply_key(MODEL, job.id): "0-0"})
    other_tenant.close()


def test_the_documented_per_model_rule_is_the_tested_one() -> None:
    security = (Path(__file__).parent.parent / "docs" / "security.md").read_text()
    assert f"user producer-digits on #<sha256 of its password> {ONE_MODEL_RULES.format(model='digits')}\n" in security

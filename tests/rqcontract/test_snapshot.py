"""snapshot() and diff() themselves: a difference in what a worker writes is reported, by location."""

from __future__ import annotations

import base64
import json
import zlib

import msgpack
import pytest
import redis

from tests.rqcontract import reference
from tests.rqcontract.classify import Identifiers, Value, classify, score_class, ttl_class
from tests.rqcontract.snapshot import Record, Snapshot, diff, snapshot

pytestmark = pytest.mark.rqcompat

IDS = Identifiers({"J1": "<job>", "W1": "<worker>", "Q1": "<queue>"})


@pytest.mark.parametrize(
    ("raw", "field", "stream", "expected"),
    [
        (b"", None, False, "empty"),
        (b"J1", None, False, "placeholder(<job>)"),
        (b"2026-05-09T07:35:25.123456Z", None, False, "iso-utc"),
        (b"2026-05-09T07:35:25+00:00", None, False, "iso-other(9999-99-99T99:99:99+99:99)"),
        (b"2026-05-09T07:35:25.123Z", None, False, "iso-other(9999-99-99T99:99:99.999Z)"),
        (b"700", None, False, "int(700)"),
        (b"1778311000", None, False, "epoch-int"),
        (b"1778311000.25", None, False, "epoch-float"),
        (b"0.0021", None, False, "float"),
        (b"[300, 1800]", None, False, "json([300,1800])"),
        (b"finished", None, False, "literal(finished)"),
        (b"rq:worker:W1", None, False, "text(rq:worker:<worker>)"),
        (b"Traceback (most recent call last):\n  boom", None, False, "traceback"),
        (b"12345", "pid", False, "volatile"),
        (msgpack.packb({"a": "J1", "t": 1.5}), None, False, 'msgpack({"a":"<job>","t":"<float>"})'),
        (zlib.compress(msgpack.packb(["f", None, [1], {}])), None, False, 'zlib(msgpack(["f",null,[1],{}]))'),
        (base64.b64encode(msgpack.packb(3)), "return_value", True, "base64(msgpack(3))"),
        (base64.b64encode(zlib.compress(b"Traceback (most recent call last):\n")), "exc_string", True,
         "base64(zlib(traceback))"),
        (b"not base64!", "return_value", True, "not-base64(text(not base64!))"),
        (b"\xff\xfe\x00", None, False, "binary(3 bytes)"),
        (b"\x01", None, False, "msgpack(1)"),
        (b"a\tb", None, False, "text(a\tb)"),
    ],
)  # fmt: skip
def test_classify(raw: bytes, field: str | None, stream: bool, expected: str) -> None:
    value = classify(raw, IDS, field, stream=stream)
    assert str(value) == expected
    assert Value.parse(str(value)) == value


def test_ttls_and_scores_by_name() -> None:
    durations = {"result_ttl": 700, "failure_ttl": 1500}
    assert ttl_class(-1, durations) == "none"
    assert ttl_class(698, durations) == "result_ttl"
    assert ttl_class(1000, durations) == "minutes"
    assert ttl_class(30, durations) == "<=60s"
    now = 1_778_311_000.0
    assert score_class(now + 700, now, durations) == "now+result_ttl"
    assert score_class(now - 7200, now, durations) == "now-hours"
    assert score_class(now + 2, now, durations) == "now"
    assert score_class((now + 1500) * 1000, now, durations) == "ms-now+failure_ttl"
    assert score_class(float("inf"), now, durations) == "+inf"
    assert score_class(3.0, now, durations) == "score=3"


def test_snapshot_keeps_only_what_mentions_the_ids(contract_connection: redis.Redis) -> None:
    connection = contract_connection
    connection.sadd("rq:workers", "rq:worker:W1", "rq:worker:someone-else")
    connection.hset("rq:worker:W1", mapping={"state": "idle", "current_job": "J1"})
    connection.set("unrelated", "x")
    connection.hset("rq:worker:someone-else", "state", "busy")
    # Two executions of one job: numbered by when they ran (entry ids, created_at), not by name.
    connection.xadd("rq:results:J1", {"execution_id": "zz-early"}, id="1000-0")
    connection.hset("rq:execution:J1:aa-late", "created_at", "2000.5")
    connection.zadd("rq:wip:Q1", {"J1:aa-late": 1})

    snap = snapshot(connection, {"J1": "<job>", "W1": "<worker>", "Q1": "<queue>"})
    assert sorted(snap.records) == [
        "rq:execution:<job>:<exec2>", "rq:results:<job>", "rq:wip:<queue>", "rq:worker:<worker>", "rq:workers"
    ]  # fmt: skip
    assert snap["rq:workers"].members == ("rq:worker:<worker>",) and snap["rq:workers"].partial
    assert snap["rq:worker:<worker>"].fields["current_job"] == Value("placeholder", "<job>")
    assert [e["execution_id"] for e in snap["rq:results:<job>"].entries] == [Value("placeholder", "<exec1>")]
    assert snap["rq:wip:<queue>"].scores == {"<job>:<exec2>": "score=1"}
    again = Snapshot.from_json(json.loads(json.dumps(snap.to_json())))
    assert again == snap


def test_diff_reports_each_changed_write(contract_connection: redis.Redis) -> None:
    """RQ's own writes, then the same records with one thing wrong each: every one is reported."""
    connection = contract_connection
    # The worker's own records changed when it died after the scenario: compare the job's. RQ's
    # records are read again now rather than taken from the scenario's "ended" stage: on a slow
    # machine the worker's exit after it can outlast classify.DURATION_TOLERANCE, and the TTLs
    # would then read as other durations.
    ended = reference.success(connection)["ended"]
    theirs = snapshot(connection, ended.ids, reference.DURATIONS).without("rq:worker*")
    assert diff(snapshot(connection, theirs.ids, reference.DURATIONS).without("rq:worker*"), theirs) == []

    [job_key] = [k for k in connection.scan_iter("rq:job:*")]
    job_id = job_key.decode().split(":", 2)[2]
    queue = next(k for k, v in theirs.ids.items() if v == "<queue>")
    connection.hdel(job_key, "worker_name")  # a field not written
    connection.hset(job_key, "ended_at", "2026-05-09T07:35:25+00:00")  # a timestamp RQ would not write
    connection.hset(job_key, "result_ttl", "700.0")  # a float where RQ writes an int
    connection.persist(job_key)  # a TTL not set
    connection.zrem(f"rq:finished:{queue}", job_id)  # a registry entry missing
    connection.xadd(f"rq:results:{job_id}", {"type": "1"})  # one result too many
    ours = snapshot(connection, theirs.ids, reference.DURATIONS).without("rq:worker*")

    lines = diff(ours, theirs)
    assert [line.split(": ")[0] for line in lines] == [
        "rq:finished:<queue>",
        "rq:job:<job> ttl",
        "rq:job:<job> field ended_at",
        "rq:job:<job> field result_ttl",
        "rq:job:<job> field worker_name",
        "rq:results:<job> entries",
    ], "\n".join(lines)
    assert "rq:job:<job> field ended_at: ours iso-other(9999-99-99T99:99:99+99:99), theirs iso-utc" in lines
    assert "rq:job:<job> field worker_name: ours absent, theirs placeholder(<worker>)" in lines
    assert "rq:job:<job> field result_ttl: ours float, theirs int(700)" in lines

    allowed = {
        "rq:job:<job> field *_at": "ortq writes ISO offsets (example reason)",
        "rq:results:<job> entries": "a second result (example reason)",
        "rq:queues member *": "never happens here",
    }
    allowed_lines = diff(ours, theirs, allowed)
    assert len(allowed_lines) == len(lines) - 2 + 1
    assert "allowed but not found: 'rq:queues member *' (never happens here)" in allowed_lines
    assert len(diff(ours, theirs, allowed, report_unused=False)) == len(lines) - 2


def test_diff_reports_type_and_member_changes() -> None:
    theirs = Snapshot({"k": Record("zset", "none", scores={"<job>": "now+result_ttl"}),
                       "s": Record("set", "none", members=("a", "b"))}, {})  # fmt: skip
    ours = Snapshot({"k": Record("list", "none", members=("<job>",)),
                     "s": Record("set", "none", members=("a", "c"))}, {})  # fmt: skip
    assert diff(ours, theirs) == [
        "k type: ours list, theirs zset",
        "s member b: only in theirs",
        "s member c: only in ours",
    ]
    ours.records["k"] = Record("zset", "none", scores={"<job>": "now+failure_ttl"})
    assert diff(ours, theirs)[0] == "k score <job>: ours now+failure_ttl, theirs now+result_ttl"

"""``ortq dashboard`` on records it cannot (fully) read: job and worker hashes, result streams and set
members as anyone with write access to Redis may leave them. Every page answers 200 and says what
is wrong (rq-dashboard answered 500 on the first field RQ could not parse, and a failed job with a
fractional ``job_timeout`` left its list on "Loading..."); nothing is inflated without a limit and
nothing unpickled. A Redis of this module's own: these records would break other tests' ``ortq info``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
import rq
import rq.job

from ortq import keys
from ortq.dashboard.app import create_app
from ortq.localredis import LocalRedis
from ortq.settings import Settings
from tests.dashboard_support import Dashboard, browse, forge_job, start_dashboard

QUEUE = keys.queue_name(f"dash-forged-{os.getpid()}")
BOMB = zlib.compress(b"\0" * 50_000_000)  # 50 MB once inflated, ~50 kB stored

#: case -> (fields over a plausible failed ortq job, what its page must say is wrong)
JOB_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "fractional timeout": ({"timeout": "0.5"}, "timeout = b'0.5' cannot be read"),
    "dates that are not": ({"created_at": "garbage", "ended_at": "1e9"}, "created_at = b'garbage' cannot be read"),
    "unknown status": ({"status": "weird"}, "status = b'weird' cannot be read"),
    "no status": ({"status": None}, "status cannot be read"),
    "no data": ({"data": None}, "the record has no data field"),
    "not UTF-8": ({"description": b"\xff\xfe<b>"}, "description = b'\\xff\\xfe<b>' cannot be read"),
    "numbers that are not": ({"result_ttl": "x", "ttl": "1.5", "retries_left": "many"}, "ttl = b'1.5' cannot be read"),
    "dependencies not JSON": ({"dependency_ids": "zzz"}, "dependency_ids = b'zzz' cannot be read"),
    "dependencies not ids": ({"dependency_ids": '[1, {"a": 2}]'}, ""),
    "zlib bomb in data": ({"data": BOMB}, "data inflates past 65536 bytes; left out"),
    "huge description": ({"description": "x" * 200_000}, "description is 200000 bytes"),
    "meta not msgpack": ({"meta": b"\x80\x04garbage"}, ""),
}


@dataclass
class Forged:
    connection: redis.Redis
    url: str
    dashboard: Dashboard
    jobs: dict[str, str]  # case -> job id


def add_result(connection: redis.Redis, job_id: str, **fields: bytes | str) -> None:
    connection.xadd(f"rq:results:{job_id}", {k: v for k, v in fields.items()})


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forged]:
    with LocalRedis() as server:
        connection = redis.Redis.from_url(server.url)
        jobs = {case: forge_job(connection, QUEUE, **fields) for case, (fields, _) in JOB_CASES.items()}
        # Keys of the wrong type, too many fields, and forged result streams.
        jobs["not a hash"] = forge_job(connection, QUEUE)
        connection.delete(keys.job_key(jobs["not a hash"]))
        connection.set(keys.job_key(jobs["not a hash"]), "a string")
        jobs["many fields"] = forge_job(connection, QUEUE, **{f"f{n}": "v" for n in range(1000)})
        jobs["exc_info bomb"] = forge_job(connection, QUEUE, exc_info=BOMB)
        jobs["result bomb"] = forge_job(connection, QUEUE)
        add_result(connection, jobs["result bomb"], type="2", exc_string=base64.b64encode(BOMB))
        jobs["result forged"] = forge_job(connection, QUEUE)
        add_result(connection, jobs["result forged"], type="x", exc_string="not base64 !!")
        jobs["result NaN"] = forge_job(connection, QUEUE, status="finished")
        add_result(connection, jobs["result NaN"], type="1", return_value=base64.b64encode(msgpack.packb(float("nan"))))
        jobs["meta bytes keys"] = forge_job(connection, QUEUE, meta=msgpack.packb({b"k": 1}))
        jobs["dependencies not a set"] = forge_job(connection, QUEUE)
        connection.set(rq.job.Job(jobs["dependencies not a set"], connection=connection).dependencies_key, "a string")
        # Workers: fields RQ cannot parse, a current job whose record is gone, keys that are not workers.
        worker_fields = {"birth": "garbage", "last_heartbeat": "x", "pid": "abc", "queues": QUEUE, "state": "busy",
                         "current_job": "gone-job"}  # fmt: skip
        connection.hset("rq:worker:forged-1", mapping=worker_fields)
        connection.hset("rq:worker:forged-2", mapping={"queues": QUEUE, "state": b"\xff", "current_job": "gone-job"})
        connection.set("rq:worker:forged-3", "a string")
        connection.sadd("rq:workers", "rq:worker:forged-1", "rq:worker:forged-2", "rq:worker:forged-3", "garbage")
        connection.sadd("rq:workers", b"rq:worker:\xff")
        # Queues: a member of rq:queues that is not a queue key.
        connection.sadd(keys.RQ_QUEUES_SET, "garbage")
        log_dir = tmp_path_factory.mktemp("dashboard-records")
        dashboard = start_dashboard(server.url, log_dir)
        try:
            yield Forged(connection, server.url, dashboard, jobs)
        finally:
            dashboard.stop()
            connection.close()


@pytest.mark.parametrize("case", [*JOB_CASES, "not a hash", "many fields", "exc_info bomb", "result bomb",
                                  "result forged", "result NaN", "meta bytes keys",
                                  "dependencies not a set"])  # fmt: skip
def test_a_job_page_says_what_cannot_be_read(forged: Forged, case: str) -> None:
    job_id = forged.jobs[case]
    assert f"<strong>Job ID</strong>: {job_id}" in forged.dashboard.get(f"/rq/0/view/job/{job_id}")
    info = forged.dashboard.json(f"/rq/0/data/job/{job_id}.json")
    assert info["id"] == job_id
    expected = {
        **{name: said for name, (_, said) in JOB_CASES.items()},
        "not a hash": f"rq:job:{job_id} is not a hash",
        "many fields": "the record has 1005 fields; only the usual ones were read",
        "result forged": "the latest result's type b'x' cannot be read",
        "dependencies not a set": "the dependencies cannot be read (ResponseError: WRONGTYPE",
    }.get(case, "")
    assert expected in info.get("unreadable", ""), info
    if case in ("exc_info bomb", "result bomb"):
        assert info["exc_info"].startswith("(an exception text that inflates past 65536 bytes")
    if case == "result NaN":
        assert info["result"] == "nan"  # repr: JSON has no NaN
    if case == "meta bytes keys":
        assert "cannot be shown as JSON" in json.loads(info["metadata"])["unreadable"]
    if case == "meta not msgpack":
        assert "this job was not written by ortq" in json.loads(info["metadata"])["unreadable"]
    if case == "huge description":
        assert info["description"] is None


def test_job_lists_show_every_job_and_what_is_wrong(forged: Forged, tmp_path: Path) -> None:
    listed = forged.dashboard.json(f"/rq/0/data/jobs/{QUEUE}/failed/100/asc/1.json")["jobs"]
    rows = {row["id"]: row for row in listed}
    assert set(rows) == set(forged.jobs.values())
    assert "timeout = b'0.5' cannot be read" in rows[forged.jobs["fractional timeout"]]["unreadable"]
    # In the browser: the failed list fills in (it stayed on "Loading..." on a fractional timeout).
    dom = browse(forged.dashboard.url + f"rq/0/view/jobs/{QUEUE}/failed/100/asc/1", tmp_path / "list")
    assert "Loading..." not in dom and forged.jobs["fractional timeout"] in dom
    assert "not readable: timeout = b'0.5' cannot be read" in dom
    dom = browse(forged.dashboard.url + f"rq/0/view/job/{forged.jobs['unknown status']}", tmp_path / "job")
    assert "<strong>Not readable</strong>:<br>status = b'weird' cannot be read" in dom


def test_workers_and_queues_pages_list_what_they_can(forged: Forged, tmp_path: Path) -> None:
    workers = {w["name"]: w for w in forged.dashboard.json("/rq/0/data/workers.json")["workers"]}
    assert set(workers) == {"forged-1", "forged-2", "forged-3", "?"}  # "?": members that are no worker key
    assert "RQ cannot read this worker's record (ValueError" in workers["forged-1"]["unreadable"]
    assert workers["forged-1"]["queues"] == [QUEUE] and workers["forged-1"]["state"] == "busy"
    if rq.__version__.startswith("2."):  # RQ 3 finds a worker's current job in its execution records
        assert workers["forged-1"]["current_job"]["description"] == "(its record is gone)"
    assert "UnicodeDecodeError" in workers["forged-2"]["unreadable"]
    assert "ResponseError" in workers["forged-3"]["unreadable"]  # not a hash
    assert "not a worker key" in workers["?"]["unreadable"]
    dom = browse(forged.dashboard.url + "rq/0/view/workers", tmp_path / "workers")
    assert "forged-1" in dom and "RQ cannot read this worker" in dom and "Loading..." not in dom
    forged.connection.sadd(keys.RQ_QUEUES_SET, b"rq:queue:\xff")
    try:
        queues = [q["name"] for q in forged.dashboard.json("/rq/0/data/queues.json")["queues"]]
        assert queues == [QUEUE]  # "garbage" and the undecodable member are left out (and logged)
        for page in ("/rq/", "/rq/0/view/jobs", "/rq/0/view/workers", "/"):
            forged.dashboard.get(page)
        assert "rq:queues holds b'garbage', which is not a queue key: left out" in forged.dashboard.logs()
        assert "rq:queues holds b'rq:queue:\\xff', which is not a queue key" in forged.dashboard.logs()
    finally:
        forged.connection.srem(keys.RQ_QUEUES_SET, b"rq:queue:\xff")


def test_a_key_of_the_wrong_type_is_explained(forged: Forged, tmp_path: Path) -> None:
    """A job key that is not a hash is one line of ortq's latest failures. A registry that is not a
    sorted set breaks the whole list that counts it: its JSON says why (502; the page's script shows
    the message), the page itself still answers."""
    page = forged.dashboard.get("/")
    assert 'id="problem"' not in page
    assert f'<tr class="failure" data-job="{forged.jobs["not a hash"]}">' in page
    assert "cannot be read: ResponseError: WRONGTYPE" in page
    broken = keys.queue_name(f"dash-broken-{os.getpid()}")
    forged.connection.sadd(keys.RQ_QUEUES_SET, "rq:queue:" + broken)
    forged.connection.set(f"rq:failed:{broken}", "a string")
    try:
        answer = forged.dashboard.request("/rq/0/data/queues.json")
        assert answer.status == 502, answer
        assert answer.json()["message"].startswith("this page cannot be built from what Redis holds: ResponseError")
        assert "WRONGTYPE" in answer.json()["message"]
        forged.dashboard.get("/")  # ortq's page: whatever ``ortq info`` makes of it, not a 500
        # rq-dashboard's page says why its list is empty, in ortq's banner, instead of "Loading..." forever.
        dom = browse(forged.dashboard.url + "rq/", tmp_path / "queues")
        banner = re.search(r'<div id="ortq-problem"[^>]*>([^<]*)</div>', dom)
        assert banner and "display: none" not in banner.group(0), dom[:3000]
        assert banner.group(1).startswith("GET /rq/0/data/queues.json: this page cannot be built from what Redis")
    finally:
        forged.connection.srem(keys.RQ_QUEUES_SET, "rq:queue:" + broken)
        forged.connection.delete(f"rq:failed:{broken}")
    forged.dashboard.json("/rq/0/data/queues.json")


@pytest.mark.parametrize(
    "record",
    [b"not json", b"[1, 2]", b'{"name": "w"}'],
    ids=["not JSON", "not a map", "no model"],
)
def test_the_ortq_page_on_ortq_records_it_cannot_read(forged: Forged, record: bytes) -> None:
    model = f'data-model="{QUEUE.removeprefix(keys.PREFIX)}"'
    assert model in forged.dashboard.get("/")
    forged.connection.sadd(keys.WORKERS_SET, "forged-ortq")
    forged.connection.set(keys.worker_key("forged-ortq"), record)
    try:
        # ``ortq info`` skips such a record, or fails as a whole: then the page says why instead.
        page = forged.dashboard.get("/")
        assert model in page or '<p id="problem" class="bad">' in page
        answer = forged.dashboard.request("/api/info")
        assert answer.status == 200 or (answer.status == 502 and "cannot be read" in answer.json()["error"]), answer
    finally:
        forged.connection.srem(keys.WORKERS_SET, "forged-ortq")
        forged.connection.delete(keys.worker_key("forged-ortq"))


def test_the_ortq_page_says_why_it_cannot_show_the_models(forged: Forged, monkeypatch: pytest.MonkeyPatch) -> None:
    """When ``ortq info`` cannot read Redis (made to raise here, as it did on a forged worker record),
    the page answers 200 with the reason and /api/info 502 with it."""

    def unreadable(connection: redis.Redis, *args: object) -> dict[str, Any]:
        raise ValueError("Expecting value: line 1 column 1 (char 0)")

    monkeypatch.setattr("ortq.dashboard.page.collect", unreadable)
    monkeypatch.setattr("ortq.dashboard.app.collect", unreadable)
    app = create_app(Settings.from_url(forged.url))
    page = app.test_client().get("/")
    assert page.status_code == 200
    assert '<p id="problem" class="bad">ortq&#39;s records in this Redis cannot be read (ValueError: Expecting' in (
        page.text
    )
    info = app.test_client().get("/api/info")
    assert info.status_code == 502 and info.json == {
        "error": "ortq's records in this Redis cannot be read: ValueError: Expecting value: line 1 column 1 (char 0)"
    }


@pytest.mark.parametrize(
    "path",
    ["/rq/1/view/jobs", "/rq/0/view/jobs/q/nowhere/8/asc/1", "/rq/0/data/jobs/q/failed/0/asc/1.json",
     "/rq/0/data/jobs/q/failed/8/asc/x.json", "/rq/0/data/jobs/q/failed/99999/asc/1.json", "/rq/0/view/job/nope"],
)  # fmt: skip
def test_requests_rq_dashboard_would_fail_on_are_a_404(forged: Forged, path: str) -> None:
    answer = forged.dashboard.request(path)
    assert answer.status == 404, answer
    assert "Internal Server Error" not in answer.body

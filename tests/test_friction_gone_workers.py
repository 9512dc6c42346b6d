"""A worker killed with SIGKILL leaves its records (RQ's state "idle" among them) for minutes:
``ortq info``, ``ortq info --json`` and the dashboard's ortq page show each worker's heartbeat age,
and one past 3 heartbeat intervals as gone, not idle. Real Redis, a real worker process."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from ortq import keys
from ortq.dashboard.app import create_app
from ortq.info import GONE_AFTER_BEATS, collect
from ortq.rqcompat import layout
from ortq.settings import Settings
from tests.cli_support import invoke
from tests.conftest import WorkerProcesses, eventually
from tests.dashboard_support import PageFields

BEAT = 0.5  # the worker's heartbeat interval (s): gone after 3 of them without one


def shown_worker(redis_url: str, model_name: str) -> dict[str, Any]:
    """The model's one worker as ``ortq info --json`` shows it."""
    done = invoke("info", "--json", "--redis-url", redis_url)
    assert done.returncode == 0, done.stderr
    [model] = [m for m in json.loads(done.stdout)["models"] if m["model"] == model_name]
    [worker] = model["workers"]
    return dict(worker)


def table_row(redis_url: str, worker: str) -> str:
    done = invoke("info", "--redis-url", redis_url)
    assert done.returncode == 0, done.stderr
    [row] = [line for line in done.stdout.splitlines() if line.startswith(worker + " ")]
    return row


def page_fields(redis_url: str, model_name: str, worker: str) -> dict[str, str]:
    """The worker's row of the dashboard's ortq page (the app as ``ortq dashboard`` makes it)."""
    app = create_app(Settings.from_url(redis_url, heartbeat_seconds=BEAT))
    page = app.test_client().get("/")
    assert page.status_code == 200
    fields = PageFields(page.text).fields
    return {field: fields[model_name, worker, field] for field in ("state", "ready", "heartbeat")}


def test_a_killed_worker_is_shown_gone_within_a_few_heartbeats(
    workers: WorkerProcesses,
    redis_url: str,
    model_name: str,
    tiny_path: Path,
    connection: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Inherited by the worker and by `ortq info` (the reader's rule for records that do not say).
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", str(BEAT))
    workers.serve(tiny_path, model_name, redis_url)
    process, _ = workers.processes[0]
    time.sleep(GONE_AFTER_BEATS * BEAT + 0.5)  # longer than the rule: a live worker beats on
    alive = shown_worker(redis_url, model_name)
    name = alive["name"]
    assert (alive["state"], alive["rq_state"]) == ("idle", "idle"), alive
    assert alive["heartbeat_seconds"] == BEAT  # its own interval, published in its record
    assert 0 <= alive["heartbeat_age"] <= GONE_AFTER_BEATS * BEAT, alive
    assert re.search(r"\s+idle\s+CPUExecutionProvider\s+.*\s+\d\.\d s ago$", table_row(redis_url, name))
    page = page_fields(redis_url, model_name, name)
    assert (page["state"], page["ready"]) == ("idle", "ready") and page["heartbeat"].endswith(" s ago"), page

    process.send_signal(signal.SIGKILL)
    assert process.wait(10) == -signal.SIGKILL
    killed_at = time.monotonic()
    eventually(lambda: shown_worker(redis_url, model_name)["state"] == "gone", timeout=10)
    # Within a few heartbeats (and a second for the reads), not when the records expire minutes later.
    assert time.monotonic() - killed_at < GONE_AFTER_BEATS * BEAT + 3
    gone = shown_worker(redis_url, model_name)
    assert gone["rq_state"] == "idle"  # what RQ's record still says
    assert gone["heartbeat_age"] > GONE_AFTER_BEATS * BEAT, gone
    assert connection.exists(keys.worker_key(name), layout.worker_key(name)) == 2  # the records are still there
    row = table_row(redis_url, name)
    assert re.search(r"\s+gone \(no heartbeat for \d+ s\)\s+CPUExecutionProvider\s+", row), row
    assert " idle " not in row
    page = page_fields(redis_url, model_name, name)
    assert re.fullmatch(r"gone \(no heartbeat for \d+ s\)", page["state"]) and page["ready"] == "not ready", page
    assert re.fullmatch(r"\d+\.\d s ago", page["heartbeat"]), page


def test_a_record_that_does_not_say_its_interval_is_judged_by_the_readers(
    connection: redis.Redis, model_name: str
) -> None:
    """An ortq from before workers published their interval, or a record someone wrote: the reader's
    heartbeat_seconds ($ORTQ_HEARTBEAT_SECONDS) applies; a value that is no interval is ignored."""
    name = f"{model_name}.forged.1"
    worker_hash = layout.worker_key(name)
    beat = layout.utcformat(layout.utcnow())
    connection.hset(worker_hash, mapping={"state": "busy", "last_heartbeat": beat})
    connection.sadd(keys.WORKERS_SET, name)
    try:
        for claimed in (None, "10", -1, 1e300, True):
            record = {"name": name, "model": model_name, "heartbeat_seconds": claimed}
            connection.set(keys.worker_key(name), json.dumps(record))
            time.sleep(0.7)
            [model] = [m for m in collect(connection, heartbeat_seconds=0.2)["models"] if m["model"] == model_name]
            [worker] = model["workers"]
            assert (worker["state"], worker["rq_state"]) == ("gone", "busy"), (claimed, worker)
            assert worker["heartbeat_age"] >= 0.6
            [model] = [m for m in collect(connection, heartbeat_seconds=60)["models"] if m["model"] == model_name]
            assert model["workers"][0]["state"] == "busy", claimed
        # Its own interval, where it gives one, is what it is judged by.
        connection.set(keys.worker_key(name), json.dumps({"name": name, "model": model_name, "heartbeat_seconds": 60}))
        [model] = [m for m in collect(connection, heartbeat_seconds=0.2)["models"] if m["model"] == model_name]
        assert model["workers"][0]["state"] == "busy"
        # No heartbeat in RQ's record (or one that cannot be read): no age, RQ's state as it is.
        for unreadable in ("not a time", ""):
            connection.hset(worker_hash, "last_heartbeat", unreadable)
            [model] = [m for m in collect(connection, heartbeat_seconds=0.2)["models"] if m["model"] == model_name]
            assert (model["workers"][0]["state"], model["workers"][0]["heartbeat_age"]) == ("busy", None)
    finally:
        connection.delete(worker_hash, keys.worker_key(name))
        connection.srem(keys.WORKERS_SET, name)

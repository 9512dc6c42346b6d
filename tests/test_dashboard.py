"""``ortq dashboard`` as an operator runs it: a real Redis, real ``ortq worker`` processes, the
dashboard as its own process with unpickling banned in it (tests/pickle_ban), read over HTTP and
in headless Chromium; and the unpatched rq-dashboard, on the same Redis, shown to unpickle."""

from __future__ import annotations

import json
import os
import pickle
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
from rq_dashboard import web

from ortq import keys
from ortq.dashboard import rqdash
from ortq.dashboard.app import create_app
from ortq.errors import ConfigurationError, InferenceFailed
from ortq.info import collect
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests import onnx_models
from tests.cli_support import invoke
from tests.conftest import REPO, WorkerProcesses, eventually
from tests.dashboard_support import (
    BAN,
    Dashboard,
    PageFields,
    browse,
    chromium,
    forge_job,
    need_chromium,
    start_dashboard,
)

X = np.ones((1, 4), np.float32)


@dataclass
class Scene:
    """What the dashboard shows: ``tiny`` (one worker, 3 finished jobs, 1 failed, 1 forged
    failed job), ``waiting`` (2 jobs queued, no worker) and ``idle`` (a queue, no job, no worker)."""

    dashboard: Dashboard
    connection: redis.Redis
    producer: Producer
    redis_url: str
    tiny: str
    waiting: str
    idle: str
    finished: list[str]
    failed: str
    forged: str
    worker_name: str


def forge_failed_job(connection: redis.Redis, queue: str) -> str:
    """A failed job's hash as someone with write access to Redis could leave it: pickled data and meta."""
    job_id = str(uuid.uuid4())
    connection.hset(
        keys.job_key(job_id),
        mapping={
            "status": "failed",
            "origin": queue,
            "description": "forged",
            "created_at": "2026-01-01T00:00:00.000000Z",
            "data": pickle.dumps(["os.system", None, ["echo unpickled"], {}]),
            "meta": pickle.dumps({"forged": True}),
        },
    )
    connection.zadd("rq:failed:" + queue, {job_id: time.time() + 3600})
    return job_id


@pytest.fixture(scope="module")
def scene(redis_server: LocalRedis, tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    log_dir = tmp_path_factory.mktemp("dashboard")
    tiny, waiting, idle = (f"dash-{name}-{os.getpid()}" for name in ("tiny", "waiting", "idle"))
    group = WorkerProcesses(log_dir)
    dashboard = start_dashboard(redis_server.url, log_dir)
    producer = Producer(settings=Settings.from_url(redis_server.url), validate=False, allow_unknown_models=True)
    try:
        group.serve(tiny_path, tiny, redis_server.url)
        finished = producer.submit_many(tiny, [{"x": X}] * 3)
        for outputs in producer.results(finished, timeout=30):
            np.testing.assert_array_equal(outputs["y"], X * 2 + 1)
        bad = producer.submit(tiny, {"wrong_name": X})
        with pytest.raises(InferenceFailed, match="InvalidInput"):
            bad.result(timeout=30)
        producer.submit_many(waiting, [{"x": X}] * 2)
        connection = producer.connection
        # RQ's bookkeeping lands just after the reply.
        eventually(lambda: connection.zcard("rq:finished:" + keys.queue_name(tiny)) == 3)
        eventually(lambda: connection.zcard("rq:failed:" + keys.queue_name(tiny)) == 1)
        forged = forge_failed_job(connection, keys.queue_name(tiny))
        connection.sadd(keys.RQ_QUEUES_SET, keys.queue_key(idle))  # a model once used: its queue, empty
        [worker] = producer.workers(tiny)
        yield Scene(
            dashboard, connection, producer, redis_server.url, tiny, waiting, idle, [j.id for j in finished], bad.id,
            forged, worker["name"],
        )  # fmt: skip
    finally:
        dashboard.stop()
        group.stop_all()
        producer.close()


def test_ortq_page_shows_models_workers_queues_and_failures(scene: Scene) -> None:
    html = scene.dashboard.get("/")
    fields = PageFields(html).fields
    tiny, worker = scene.tiny, scene.worker_name
    assert {f: fields[tiny, None, f] for f in ("queued", "started", "finished", "failed")} == {
        "queued": "0", "started": "0", "finished": "3", "failed": "2",
    }  # fmt: skip
    assert fields[tiny, worker, "provider"] == "CPUExecutionProvider"
    assert fields[tiny, worker, "ready"] == "ready"
    assert fields[tiny, worker, "state"] == "idle"
    assert re.fullmatch(r"\d+\.\d s ago", fields[tiny, worker, "heartbeat"])  # a gone one: test_friction_gone_workers
    assert fields[tiny, worker, "adapter"] == "cpu"
    assert (fields[tiny, worker, "successful_jobs"], fields[tiny, worker, "failed_jobs"]) == ("3", "1")
    assert fields[tiny, scene.failed, "reason"].startswith("InvalidInput: inputs do not match the model")
    assert fields[tiny, scene.forged, "reason"] == "(no reason recorded)"
    assert f'href="/rq/0/view/job/{scene.failed}"' in html
    assert fields[scene.waiting, None, "queued"] == "2"
    # Only a queue with jobs and no worker is a problem (red); an idle model without workers is not.
    assert fields[scene.waiting, None, "no_workers"] == "no workers: 2 jobs wait in the queue"
    assert '<p class="bad" data-field="no_workers">no workers: 2 jobs' in html
    # A queue name in RQ's queue set with no job, worker or signature is no model (anyone may add one).
    assert not any(key[0] == scene.idle for key in fields), fields
    assert '<meta http-equiv="refresh"' in html
    # Offline-safe: nothing is loaded from another host.
    assert "http://" not in html.replace(scene.redis_url, "") and "https://" not in html and "//cdn" not in html


def without_heartbeat_ages(info: dict[str, Any], model: str) -> tuple[dict[str, Any], list[float]]:
    """``info`` with each worker's heartbeat age taken out (it grows between two reads), and those
    of ``model``'s workers (the Redis is shared: others may be gone)."""
    info = json.loads(json.dumps(info))
    ages = {(m["model"], w["name"]): w.pop("heartbeat_age") for m in info["models"] for w in m["workers"]}
    return info, [age for (of, _), age in ages.items() if of == model]


def test_api_info_is_ortq_info(scene: Scene) -> None:
    served, served_ages = without_heartbeat_ages(scene.dashboard.json("/api/info"), scene.tiny)
    read, read_ages = without_heartbeat_ages(collect(scene.connection), scene.tiny)
    assert served == read
    assert len(served_ages) == len(read_ages) == 1
    assert all(0 <= age <= 15 for age in served_ages + read_ages), (served_ages, read_ages)  # it beats every 5 s


def test_rq_dashboard_pages_show_ortq_jobs(scene: Scene) -> None:
    dash, queue = scene.dashboard, keys.queue_name(scene.tiny)
    for job_id in (scene.finished[0], scene.failed, scene.forged):
        assert f"<strong>Job ID</strong>: {job_id}" in dash.get(f"/rq/0/view/job/{job_id}")
    done = dash.json(f"/rq/0/data/job/{scene.finished[0]}.json")
    assert (done["status"], done["origin"], done["description"]) == (
        "finished",
        queue,
        f"{keys.JOB_FUNC}({scene.tiny!r})",
    )
    assert done["result"]["outputs"] == {"y": ["float32", [1, 4]]}  # ortq's job result: the reply's summary
    failed = dash.json(f"/rq/0/data/job/{scene.failed}.json")
    assert failed["status"] == "failed" and failed["exc_info"].startswith("InvalidInput:")
    forged = dash.json(f"/rq/0/data/job/{scene.forged}.json")
    assert forged["status"] == "failed" and "unreadable" in json.loads(forged["metadata"])  # not unpickled
    lists = {
        registry: [j["id"] for j in dash.json(f"/rq/0/data/jobs/{queue}/{registry}/8/asc/1.json")["jobs"]]
        for registry in ("finished", "failed")
    }
    assert sorted(lists["finished"]) == sorted(scene.finished)
    assert sorted(lists["failed"]) == sorted([scene.failed, scene.forged])
    queued = dash.json(f"/rq/0/data/jobs/{keys.queue_name(scene.waiting)}/queued/8/asc/1.json")["jobs"]
    assert len(queued) == 2
    counts = {q["name"]: q for q in dash.json("/rq/0/data/queues.json")["queues"]}
    assert counts[queue]["finished_job_registry_count"] == 3 and counts[queue]["failed_job_registry_count"] == 2
    assert counts[keys.queue_name(scene.waiting)]["count"] == 2
    for page in ("/rq/", "/rq/0/view/jobs", "/rq/0/view/workers", "/rq/static/js/jquery-3.5.1.min.js"):
        dash.get(page)


def test_busy_worker_requeue_and_delete(
    scene: Scene, workers: WorkerProcesses, model_name: str, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dash, queue = scene.dashboard, keys.queue_name(model_name)
    # RQ 3 finds a worker's current job in its executions, which a worker writes at its heartbeats
    # (executions.lua): runs of ~1 s and a beat every 0.5 s, so that one is seen running.
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "0.5")
    slow_model = onnx_models.timed_slow_model(models_dir / "dashboard-slow-1s.onnx", 1.0)
    workers.serve(slow_model, model_name, scene.redis_url)
    [worker] = scene.producer.workers(model_name)
    # Requeue and delete, through the dashboard, a job that failed and a forged one (pickled meta).
    bad = scene.producer.submit(model_name, {"wrong_name": X})
    with pytest.raises(InferenceFailed, match="InvalidInput"):
        bad.result(timeout=30)
    eventually(lambda: scene.connection.zscore("rq:failed:" + queue, bad.id) is not None)
    forged = forge_failed_job(scene.connection, queue)
    # ortq jobs are refused, saying why: their request tensors went with the failure, so a requeued
    # copy could only fail again with RequestExpired. Nothing moves.
    for job_id in (bad.id, forged):
        refused = dash.post(f"/rq/job/{job_id}/requeue")
        assert refused.status == 409, refused
        assert refused.json()["status"] == "REFUSED"
        assert "RequestExpired" in refused.json()["message"] and "Submit it again" in refused.json()["message"]
    refused = dash.post(f"/rq/requeue/{queue}")
    assert refused.status == 409 and "nothing was requeued" in refused.json()["message"]
    assert scene.connection.zcard("rq:failed:" + queue) == 2 and scene.connection.llen(keys.queue_key(model_name)) == 0
    # A job of another RQ application's queue is requeued as RQ does; one naming ortq's function is not.
    other = f"other-{model_name}"
    plain = forge_job(scene.connection, other, data=msgpack.packb(["app.tasks.resize", None, [], {}]))
    ortq_function = forge_job(scene.connection, other)
    assert dash.json(f"/rq/requeue/{other}", "POST") == {"status": "OK", "count": 1, "skipped": 1}
    assert scene.connection.lrange("rq:queue:" + other, 0, -1) == [plain.encode()]
    assert dash.post(f"/rq/job/{ortq_function}/requeue").status == 409
    for job_id in (bad.id, forged, plain, ortq_function):
        assert dash.json(f"/rq/job/{job_id}/delete", "POST") == {"status": "OK"}
        assert not scene.connection.exists(keys.job_key(job_id))
    # A busy worker: rq-dashboard reads its current job (RQ decodes that job's data to describe it).
    slow = scene.producer.submit_many(model_name, [{"x": np.ones((1, 256), np.float32)}] * 4)

    def current_job() -> Any:
        listed = {w["name"]: w for w in dash.json("/rq/0/data/workers.json")["workers"]}
        return listed[worker["name"]]["current_job"]

    seen: list[Any] = []

    def busy() -> bool:
        seen.append(current_job())
        return isinstance(seen[-1], dict)  # else "idle", between two jobs

    eventually(busy, timeout=30)
    assert seen[-1]["job_id"] in {j.id for j in slow}
    assert seen[-1]["call_string"] == f"{keys.JOB_FUNC}({model_name!r})"
    dash.get("/rq/0/view/workers")

    def page_shows_busy() -> bool:
        fields = PageFields(dash.get("/")).fields
        return (fields[model_name, worker["name"], "state"], fields[model_name, worker["name"], "ready"]) == (
            "busy", "ready",
        )  # fmt: skip

    eventually(page_shows_busy, timeout=30)


def test_chromium_renders_the_pages(scene: Scene, tmp_path: Path) -> None:
    need_chromium()
    artifacts = Path(os.environ.get("ORTQ_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    screenshot = artifacts / "dashboard.png"
    dom = chromium(f"--screenshot={screenshot}", "--dump-dom", scene.dashboard.url, user_data_dir=tmp_path / "a")
    fields = PageFields(dom).fields
    assert fields[scene.tiny, scene.worker_name, "provider"] == "CPUExecutionProvider"
    assert fields[scene.tiny, scene.worker_name, "ready"] == "ready"
    assert fields[scene.tiny, None, "failed"] == "2"
    assert screenshot.stat().st_size > 10_000 and screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # rq-dashboard's pages fill themselves in with their own scripts from the JSON: the job page,
    # the queues, a job list and the workers.
    url, queue = scene.dashboard.url, keys.queue_name(scene.tiny)
    dom = browse(url + f"rq/0/view/job/{scene.failed}", tmp_path / "b")
    assert "InvalidInput: inputs do not match the model" in dom and f"{keys.JOB_FUNC}({scene.tiny!r})" in dom
    dom = browse(url + "rq/", tmp_path / "c")
    assert f"<td>{queue}</td>" in dom and "Loading..." not in dom
    dom = browse(url + f"rq/0/view/jobs/{queue}/failed/8/asc/1", tmp_path / "d")
    assert scene.failed in dom and scene.forged in dom and "Loading..." not in dom
    dom = browse(url + "rq/0/view/workers", tmp_path / "e")
    assert scene.worker_name in dom and queue in dom and "Loading..." not in dom
    assert 'id="ortq-problem"' in dom and 'style="display: none"' in dom  # no request failed
    scene.dashboard.check_no_pickle()


STOCK_CLIENT = """
import json, os, sys
import redis
from rq_dashboard.cli import make_flask_app
from rq_dashboard.web import setup_rq_connection
app = make_flask_app(None, None, None, "/rq")
if sys.argv[2] == "ortq":
    from ortq.dashboard import rqdash
    rqdash.install()
    rqdash.connect_blueprint(app, {sys.argv[1]: redis.Redis.from_url(sys.argv[1])})
else:
    app.config["RQ_DASHBOARD_REDIS_URL"] = sys.argv[1]
    setup_rq_connection(app)
client, trap, unpickled = app.test_client(), os.environ["ORTQ_PICKLE_TRAP"], []
for path in sys.argv[3:]:
    client.get(path)
    if os.path.exists(trap):
        unpickled.append(path)
        os.remove(trap)
print(json.dumps(unpickled))
"""


def test_unpatched_rq_dashboard_unpickles(scene: Scene, tmp_path: Path) -> None:
    """The ban is real, and what ortq replaces matters: the same rq-dashboard requests, with and
    without :func:`rqdash.install`, in a process where unpickling is banned."""
    paths = [f"/rq/0/view/job/{scene.forged}", f"/rq/0/data/job/{scene.finished[0]}.json",
             f"/rq/0/data/jobs/{keys.queue_name(scene.tiny)}/finished/8/asc/1.json"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=f"{BAN}{os.pathsep}{REPO}", ORTQ_PICKLE_TRAP=str(tmp_path / "trap.log"))

    def unpickled(mode: str) -> list[str]:
        command = [sys.executable, "-c", STOCK_CLIENT, scene.redis_url, mode, *paths]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, env=env, cwd=REPO)
        assert done.returncode == 0, done.stderr[-4000:]
        result: list[str] = json.loads(done.stdout.splitlines()[-1])
        return result

    assert unpickled("stock") == paths
    assert unpickled("ortq") == []


def test_rq_dashboard_reads_through_ortqs_client() -> None:
    """rq-dashboard would open a client of its own on every request, from the URL it shows (which
    has no password): it reads through the app's ortq client instead, and no page shows the password."""
    with LocalRedis() as server:
        redis.Redis.from_url(server.url).config_set("requirepass", "s3cret-pw")
        url = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
        redis.Redis.from_url(url).sadd(keys.RQ_QUEUES_SET, keys.queue_key("guarded"))
        client = create_app(Settings.from_url(url)).test_client()
        answer = client.get("/rq/0/data/queues.json")
        assert answer.status_code == 200 and [q["name"] for q in answer.json["queues"]] == [keys.queue_name("guarded")]
        for path in ("/", "/rq/", "/rq/0/view/workers"):
            page = client.get(path)
            assert (
                page.status_code == 200 and "s3cret-pw" not in page.text and f"127.0.0.1:{server.port}/0" in page.text
            )


def test_install_refuses_an_unknown_rq_dashboard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(web, "Job", type("SomethingElse", (), {}))
    with pytest.raises(ConfigurationError, match=r"rq_dashboard\.web\.Job is not RQ's Job"):
        rqdash.install()


def test_unreachable_redis_is_a_503(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:  # a port that nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("ORTQ_REDIS_URL", f"redis://127.0.0.1:{port}/0")  # --redis-url's variable
    dashboard = start_dashboard(None, tmp_path)
    try:
        status, body = dashboard.fetch("/")
        assert status == 503 and f"cannot reach Redis at redis://127.0.0.1:{port}/0" in body
    finally:
        dashboard.stop()


def test_a_busy_port_is_one_line_and_status_2(redis_url: str) -> None:
    """werkzeug would print two lines and exit 1; the port is bound before Redis is asked anything."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "ortq", "dashboard", "--port", str(port), "--redis-url", redis_url]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (
        f"ortq: ConfigurationError: cannot listen on 127.0.0.1:{port}: Address already in use; another program "
        "(a second dashboard?) listens there: choose another --port, or --port 0 for any free one\n"
    )
    assert done.stdout == ""


def test_help_has_examples() -> None:
    done = invoke("dashboard", "--help")
    assert done.returncode == 0, done.stderr
    assert "Examples:" in done.stdout and "--redis-url" in done.stdout and "ortq dashboard --port" in done.stdout

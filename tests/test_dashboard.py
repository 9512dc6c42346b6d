"""``ortq dashboard`` as an operator runs it: a real Redis, real ``ortq worker`` processes, the
dashboard as its own process with unpickling banned in it (tests/pickle_ban), read over HTTP and
in headless Chromium; and the unpatched rq-dashboard, on the same Redis, shown to unpickle."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from rq_dashboard import web

from ortq import keys
from ortq.dashboard import rqdash
from ortq.errors import ConfigurationError, InferenceFailed
from ortq.info import collect
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests import onnx_models
from tests.conftest import REPO, WorkerProcesses, eventually

BAN = Path(__file__).parent / "pickle_ban"
X = np.ones((1, 4), np.float32)


class PageFields(HTMLParser):
    """The text of every ``data-field`` element of the ortq page, keyed by
    (model, worker name or failed job id or None, field)."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.fields: dict[tuple[str | None, str | None, str], str] = {}
        self._model: str | None = None
        self._row: str | None = None
        self._field: tuple[str | None, str | None, str] | None = None
        self._depth = 0
        self._text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._field is not None:
            self._depth += 1
            return
        a = dict(attrs)
        self._model = a.get("data-model") or self._model
        self._row = a.get("data-worker") or a.get("data-job") or self._row
        if a.get("data-field"):
            self._field, self._depth, self._text = (self._model, self._row, str(a["data-field"])), 1, []

    def handle_endtag(self, tag: str) -> None:
        if self._field is None:
            self._row = None if tag == "tr" else self._row
            self._model = None if tag == "section" else self._model
            return
        self._depth -= 1
        if self._depth == 0:
            self.fields[self._field] = " ".join("".join(self._text).split())
            self._field = None

    def handle_data(self, data: str) -> None:
        if self._field is not None:
            self._text.append(data)


@dataclass
class Dashboard:
    """A running ``ortq dashboard`` process and the file its pickle ban writes to when it fires."""

    process: subprocess.Popen[str]
    url: str
    log: Path
    trap: Path

    def fetch(self, path: str, method: str = "GET") -> tuple[int, str]:
        request = urllib.request.Request(self.url + path, method=method, data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, body = response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read().decode(errors="replace")
        self.check_no_pickle()
        return status, body

    def get(self, path: str) -> str:
        status, body = self.fetch(path)
        assert status == 200, f"GET {path}: {status}\n{body[:2000]}\n{self.log.read_text()[-4000:]}"
        return body

    def json(self, path: str, method: str = "GET") -> Any:
        status, body = self.fetch(path, method)
        assert status == 200, f"{method} {path}: {status}\n{body[:2000]}\n{self.log.read_text()[-4000:]}"
        return json.loads(body)

    def check_no_pickle(self) -> None:
        assert not self.trap.exists(), f"the dashboard unpickled: {self.trap.read_text()}\n{self.log.read_text()}"
        assert self.process.poll() is None, f"the dashboard exited:\n{self.log.read_text()}"


@dataclass
class Scene:
    """What the dashboard shows: ``tiny`` (one worker, 3 finished jobs, 1 failed, 1 forged
    failed job) and ``waiting`` (2 jobs queued, no worker)."""

    dashboard: Dashboard
    connection: redis.Redis
    producer: Producer
    redis_url: str
    tiny: str
    waiting: str
    finished: list[str]
    failed: str
    forged: str
    worker_name: str


def start_dashboard(redis_url: str | None, log_dir: Path) -> Dashboard:
    """``ortq dashboard --port 0`` with unpickling banned in it; returns once it listens."""
    trap, log = log_dir / "dashboard-trap.log", log_dir / "dashboard.log"
    env = dict(os.environ, PYTHONPATH=f"{BAN}{os.pathsep}{REPO}", ORTQ_PICKLE_TRAP=str(trap))
    command = [sys.executable, "-m", "ortq", "dashboard", "--port", "0"]
    command += ["--redis-url", redis_url] if redis_url else []
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=REPO, env=env)
    assert process.stdout is not None
    line = process.stdout.readline()  # "ortq dashboard on http://127.0.0.1:PORT/ ..." once listening
    assert line.startswith("ortq dashboard on http://"), f"{line!r}\n{log.read_text()}"
    return Dashboard(process, line.split()[3], log, trap)


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
    tiny, waiting = f"dash-tiny-{os.getpid()}", f"dash-waiting-{os.getpid()}"
    group = WorkerProcesses(log_dir)
    dashboard = start_dashboard(redis_server.url, log_dir)
    producer = Producer(settings=Settings.from_url(redis_server.url), validate=False)
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
        [worker] = producer.workers(tiny)
        yield Scene(
            dashboard, connection, producer, redis_server.url, tiny, waiting, [j.id for j in finished], bad.id, forged,
            worker["name"],
        )  # fmt: skip
    finally:
        dashboard.process.terminate()
        dashboard.process.wait(15)
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
    assert fields[tiny, worker, "adapter"] == "cpu"
    assert (fields[tiny, worker, "successful_jobs"], fields[tiny, worker, "failed_jobs"]) == ("3", "1")
    assert fields[tiny, scene.failed, "reason"].startswith("InvalidInput: inputs do not match the model")
    assert fields[tiny, scene.forged, "reason"] == "(no reason recorded)"
    assert f'href="/rq/0/view/job/{scene.failed}"' in html
    assert fields[scene.waiting, None, "queued"] == "2"
    assert fields[scene.waiting, None, "no_workers"].startswith("no workers")
    assert '<meta http-equiv="refresh"' in html
    # Offline-safe: nothing is loaded from another host.
    assert "http://" not in html.replace(scene.redis_url, "") and "https://" not in html and "//cdn" not in html


def test_api_info_is_ortq_info(scene: Scene) -> None:
    assert scene.dashboard.json("/api/info") == collect(scene.connection)


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
    scene: Scene, workers: WorkerProcesses, model_name: str, models_dir: Path
) -> None:
    dash, queue = scene.dashboard, keys.queue_name(model_name)
    workers.serve(onnx_models.slow_model(models_dir / "dashboard-slow.onnx"), model_name, scene.redis_url)
    [worker] = scene.producer.workers(model_name)
    # Requeue and delete, through the dashboard, a job that failed and a forged one (pickled meta).
    bad = scene.producer.submit(model_name, {"wrong_name": X})
    with pytest.raises(InferenceFailed, match="InvalidInput"):
        bad.result(timeout=30)
    eventually(lambda: scene.connection.zscore("rq:failed:" + queue, bad.id) is not None)
    forged = forge_failed_job(scene.connection, queue)
    for job_id in (bad.id, forged):
        assert dash.json(f"/rq/job/{job_id}/requeue", "POST") == {"status": "OK"}
    # The worker fails both again, saying why: the request tensors went with the first failure,
    # and the forged job names nothing an ortq worker runs.
    for job_id, reason in ((bad.id, "RequestExpired"), (forged, "UnknownJobFunction")):
        # (B023: the lambda runs within this iteration.)
        eventually(lambda: (dash.json(f"/rq/0/data/job/{job_id}.json")["exc_info"] or "").startswith(reason))  # noqa: B023
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


def chromium(*args: str, user_data_dir: Path) -> str:
    """Run headless Chromium once; returns its stdout (the DOM with --dump-dom)."""
    binary = shutil.which("chromium")
    assert binary is not None
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               f"--user-data-dir={user_data_dir}", "--window-size=1280,900", *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_chromium_renders_the_pages(scene: Scene, tmp_path: Path) -> None:
    if shutil.which("chromium") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing on CI: .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium): the browser check did not run")
    artifacts = Path(os.environ.get("ORTQ_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    screenshot = artifacts / "dashboard.png"
    dom = chromium(f"--screenshot={screenshot}", "--dump-dom", scene.dashboard.url, user_data_dir=tmp_path / "a")
    fields = PageFields(dom).fields
    assert fields[scene.tiny, scene.worker_name, "provider"] == "CPUExecutionProvider"
    assert fields[scene.tiny, scene.worker_name, "ready"] == "ready"
    assert fields[scene.tiny, None, "failed"] == "2"
    assert screenshot.stat().st_size > 10_000 and screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # rq-dashboard's job page fills itself in with its own script from the job's JSON.
    job_page = scene.dashboard.url + f"rq/0/view/job/{scene.failed}"
    dom = chromium("--virtual-time-budget=5000", "--dump-dom", job_page, user_data_dir=tmp_path / "b")
    assert "InvalidInput: inputs do not match the model" in dom and f"{keys.JOB_FUNC}({scene.tiny!r})" in dom
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
    rqdash.connect_blueprint(app, redis.Redis.from_url(sys.argv[1]), sys.argv[1])
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
        dashboard.process.terminate()
        dashboard.process.wait(15)


def test_help_has_examples() -> None:
    done = subprocess.run([sys.executable, "-m", "ortq", "dashboard", "--help"], capture_output=True, text=True,
                          timeout=60, check=False, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Examples:" in done.stdout and "--redis-url" in done.stdout and "ortq dashboard --port" in done.stdout

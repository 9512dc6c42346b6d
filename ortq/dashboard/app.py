"""The dashboard's one Flask app: the ortq page at ``/``, its data at ``/api/info`` and
rq-dashboard (made pickle-free by :mod:`ortq.dashboard.rqdash`, its pages escaped by
:mod:`ortq.dashboard.templates`) at ``/rq/``, every request checked by :mod:`ortq.dashboard.guard`."""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from functools import cached_property

import click
import redis
from flask import Flask, Response, jsonify, make_response, render_template_string, url_for
from jinja2 import BaseLoader
from werkzeug.serving import LISTEN_QUEUE, get_sockaddr, make_server, select_address_family

from ortq.dashboard import guard, rqdash, rqviews
from ortq.dashboard.history import HEIGHT, SAMPLE_SECONDS, WIDTH, History
from ortq.dashboard.page import TEMPLATE, UNREACHABLE, page_context
from ortq.dashboard.records import describe
from ortq.dashboard.templates import PatchedTemplates
from ortq.errors import ConfigurationError
from ortq.info import collect, collect_shards, shard_clients
from ortq.redisurls import redacted_url
from ortq.settings import REDIS_DOWN, Settings

log = logging.getLogger(__name__)

#: Where rq-dashboard's blueprint is mounted.
RQ_PREFIX = "/rq"
#: Seconds between reloads of the ortq page.
REFRESH_SECONDS = 5


class DashboardFlask(Flask):
    """Flask with rq-dashboard's templates as :mod:`ortq.dashboard.templates` patches them, and
    every template autoescaped (Flask's default leaves rq-dashboard's ``*.js`` includes raw)."""

    def select_jinja_autoescape(self, filename: str | None) -> bool:
        return True

    @cached_property
    def jinja_loader(self) -> BaseLoader | None:  # searched before the blueprint's own templates
        return PatchedTemplates()


def create_app(settings: Settings, access: guard.Access | None = None, refresh_seconds: int = REFRESH_SECONDS) -> Flask:
    """The app for the Redis in ``settings``, open to ``access`` (default: anyone who reaches it,
    any Host). Makes rq-dashboard pickle-free process-wide; refuses (ConfigurationError) an
    rq-dashboard whose names, views or templates are not the ones ortq's fixes were made for."""
    blueprint = rqdash.install()
    # rq-dashboard's base template links the app's own favicon.ico: its static folder is the app's.
    app = DashboardFlask(__name__, static_folder=str(rqdash.STATIC_DIR), static_url_path="/static")
    assert app.jinja_loader is not None  # patches and checks the templates now, not at the first page
    guard.install(app, access or guard.Access())
    # A wrong password or certificate stops it here; an unreachable Redis is served anyway, the
    # pages saying so until it is back.
    shards, connections = shard_clients(settings, "serving anyway")
    app.register_blueprint(blueprint, url_prefix=RQ_PREFIX)
    rqdash.connect_blueprint(app, connections)
    rqviews.install_views(app)
    app.before_request(rqviews.check_arguments)
    where = ", ".join(redacted_url(url) for url in connections)
    history = History(connections, settings.heartbeat_seconds)
    app.extensions["ortq_history"] = history  # serve() samples it in a thread of its own

    def job_url(job_id: str, instance: int = 0) -> str:
        return url_for("rq_dashboard.job_view", instance_number=instance, job_id=job_id)

    @app.get("/")
    def overview() -> Response:
        context = page_context(connections, shards, settings.heartbeat_seconds)
        html = render_template_string(
            TEMPLATE, refresh_seconds=refresh_seconds, rq_url=url_for("rq_dashboard.queues_overview"),
            job_url=job_url, charts=history.charts(), chart_size=(WIDTH, HEIGHT), sample_seconds=SAMPLE_SECONDS,
            **context,
        )  # fmt: skip
        return make_response(html)

    @app.get("/api/info")
    def api_info() -> Response | tuple[Response, int]:
        try:
            if len(connections) == 1:
                return jsonify(collect(next(iter(connections.values())), settings.heartbeat_seconds))
            return jsonify(collect_shards(connections, shards, settings.heartbeat_seconds))  # "redis", "warnings"
        except REDIS_DOWN:
            raise
        except Exception as exc:  # a record ortq cannot read (the page at / says the same)
            return jsonify(error=f"ortq's records in this Redis cannot be read: {describe(exc)}"), 502

    @app.errorhandler(redis.exceptions.ConnectionError)
    @app.errorhandler(redis.exceptions.TimeoutError)
    def redis_down(exc: redis.exceptions.RedisError) -> tuple[str, int]:
        log.warning("Redis unreachable: %s", exc)
        # Reloads itself too, so that a page left open comes back with Redis.
        return render_template_string(UNREACHABLE, refresh_seconds=refresh_seconds, error=str(exc),
                                      where=where), 503  # fmt: skip

    return app


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (0: a free port), bound the way werkzeug binds. A port in
    use or an address not of this machine is ConfigurationError (one line, exit status 2), where
    werkzeug would print two lines and exit 1; bound before anything else starts, it fails at once."""
    family = select_address_family(host, port)
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        if os.name != "nt":  # as werkzeug: restart at once after a stop (on Windows it would share a busy port)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(get_sockaddr(host, port, family))
        listener.listen(LISTEN_QUEUE)
    except OSError as exc:
        listener.close()
        hint = (
            "another program (a second dashboard?) listens there: choose another --port, or --port 0 for any free one"
            if exc.errno == errno.EADDRINUSE
            else "is --host an address of this machine?"
        )
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; {hint}") from exc
    return listener


def serve(app: Flask, host: str, listener: socket.socket) -> None:
    """Serve ``app`` on ``listener`` (:func:`listen` on ``host``) with one thread per request until
    interrupted.

    Prints the URL once listening, so that whoever started it (a script, a test) can read the port.
    """
    port = listener.getsockname()[1]
    server = make_server(host, port, app, threaded=True, fd=listener.fileno())
    stop_sampling = threading.Event()
    if isinstance(history := app.extensions.get("ortq_history"), History):
        history.start(stop_sampling)
    listener.close()  # the server listens on its own copy of the socket
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"ortq dashboard on http://{shown}:{port}/ (rq-dashboard at {RQ_PREFIX}/)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        stop_sampling.set()
        server.server_close()

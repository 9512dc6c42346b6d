"""The dashboard's one Flask app: the ortq page at ``/``, its data at ``/api/info`` and
rq-dashboard (made pickle-free by :mod:`ortq.dashboard.rqdash`) at ``/rq/``."""

from __future__ import annotations

import logging

import click
import redis
from flask import Flask, Response, jsonify, make_response, render_template_string, url_for
from werkzeug.serving import make_server

from ortq.dashboard import rqdash
from ortq.dashboard.page import TEMPLATE, UNREACHABLE, page_context
from ortq.info import collect
from ortq.settings import Settings, redacted_url

log = logging.getLogger(__name__)

#: Where rq-dashboard's blueprint is mounted.
RQ_PREFIX = "/rq"
#: Seconds between reloads of the ortq page.
REFRESH_SECONDS = 5


def create_app(settings: Settings, refresh_seconds: int = REFRESH_SECONDS) -> Flask:
    """The app for the Redis in ``settings``. Makes rq-dashboard pickle-free process-wide."""
    blueprint = rqdash.install()
    # rq-dashboard's base template links the app's own favicon.ico: its static folder is the app's.
    app = Flask(__name__, static_folder=str(rqdash.STATIC_DIR), static_url_path="/static")
    try:
        connection = settings.connect()  # a wrong password or certificate stops it here
    except redis.ConnectionError as exc:
        # Unreachable for now: serve anyway; the pages say so until Redis is back.
        log.warning("Redis at %s is unreachable (%s); serving anyway", redacted_url(settings.redis_url), exc)
        connection = settings.connect(check=False)
    app.register_blueprint(blueprint, url_prefix=RQ_PREFIX)
    rqdash.connect_blueprint(app, connection, settings.redis_url)

    @app.get("/")
    def overview() -> Response:
        context = page_context(connection, settings.redis_url)
        html = render_template_string(
            TEMPLATE, refresh_seconds=refresh_seconds, rq_url=url_for("rq_dashboard.queues_overview"), **context
        )
        return _no_store(make_response(html))

    @app.get("/api/info")
    def api_info() -> Response:
        return _no_store(jsonify(collect(connection)))

    @app.errorhandler(redis.exceptions.ConnectionError)
    def redis_down(exc: redis.exceptions.ConnectionError) -> tuple[str, int]:
        log.warning("Redis unreachable: %s", exc)
        # Reloads itself too, so that a page left open comes back with Redis.
        return render_template_string(UNREACHABLE, refresh_seconds=refresh_seconds, error=str(exc),
                                      where=redacted_url(settings.redis_url)), 503  # fmt: skip

    return app


def _no_store(response: Response) -> Response:
    response.headers["Cache-Control"] = "no-store"  # always the live state, never a cached page
    return response


def serve(app: Flask, host: str, port: int) -> None:
    """Serve ``app`` on ``host:port`` (0: a free port) with one thread per request until interrupted.

    Prints the URL once listening, so that whoever started it (a script, a test) can read the port.
    """
    server = make_server(host, port, app, threaded=True)
    click.echo(f"ortq dashboard on http://{host}:{server.server_port}/ (rq-dashboard at {RQ_PREFIX}/)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()

"""The ``ortq dashboard`` command."""

from __future__ import annotations

import click

from ortq.cliopts import redis_url_option
from ortq.settings import Settings


@click.command(
    epilog="""Examples:

\b
  ortq dashboard
  ortq dashboard --port 8080 --redis-url redis://redis-host:6379/0
  ortq dashboard --host 0.0.0.0 --port 0        # any free port; the URL is printed
  curl http://127.0.0.1:9181/api/info           # the page's data as JSON (same as `ortq info --json`)

It has no login: keep --host on 127.0.0.1 (the default) or put it behind a proxy that checks
who is asking, since rq-dashboard's pages at /rq/ can delete and requeue jobs.
"""
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=9181,
    show_default=True,
    help="Port to listen on; 0: any free port.",
)
@redis_url_option()
def dashboard(host: str, port: int, redis_url: str | None) -> None:
    """Serve the web dashboard: ortq's models, workers and queues at /, rq-dashboard at /rq/.

    Nothing it reads from Redis is unpickled: rq-dashboard runs with ortq's msgpack serializer
    and job class. Needs the dashboard extra: pip install "ortq[dashboard]".
    """
    try:
        from ortq.dashboard.app import create_app, serve
    except ImportError as exc:
        raise click.UsageError(f'{exc}: install the dashboard extra, pip install "ortq[dashboard]"') from exc
    serve(create_app(Settings.from_env(redis_url=redis_url)), host, port)

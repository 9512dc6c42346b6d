"""The ``ortq dashboard`` command."""

from __future__ import annotations

import click

from ortq.cliopts import redis_url_option, shards_option
from ortq.errors import ConfigurationError
from ortq.settings import Settings

AUTH_ENV = "ORTQ_DASHBOARD_AUTH"  # ortq.dashboard.guard.AUTH_ENV (not imported: Flask may be missing)


@click.command(
    epilog=f"""Examples:

\b
  ortq dashboard
  ortq dashboard --port 8080 --redis-url redis://redis-host:6379/0
  {AUTH_ENV}=ops:long-random-password ortq dashboard --host 0.0.0.0
  ortq dashboard --host 0.0.0.0 --allowed-host gpu-box --allowed-host gpu-box.lan
  ortq dashboard --host 0.0.0.0 --port 0        # any free port; the URL is printed
  curl http://127.0.0.1:9181/api/info           # the page's data as JSON (same as `ortq info --json`)

Its pages can delete and requeue jobs. Every value read from Redis is escaped; actions need a
POST from the dashboard's own page with its CSRF token. Anyone who can reach the port can use
it unless --auth is set (HTTP Basic: put it behind TLS, e.g. a reverse proxy, off a trusted LAN).
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
@click.option(
    "--auth",
    envvar=AUTH_ENV,
    metavar="USER:PASSWORD",
    default=None,
    help=f"Require this login (HTTP Basic) for every page (default: ${AUTH_ENV}; prefer the variable: "
    "a flag shows in the process list).",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="A host name or address the dashboard is reached by; requests naming another Host are refused "
    "(DNS rebinding). Repeatable. Listening on 127.0.0.1 allows only localhost names.",
)
@redis_url_option()
@shards_option()
def dashboard(
    host: str, port: int, auth: str | None, allowed_hosts: tuple[str, ...], redis_url: str | None, shards: str | None
) -> None:
    """Serve the web dashboard: ortq's models, workers and queues at /, rq-dashboard at /rq/.

    With a shard map, every Redis in it: a section each at /, and rq-dashboard's instances 0, 1,
    ... (its instance menu), the default Redis first.

    Nothing it reads from Redis is unpickled: rq-dashboard runs with ortq's msgpack serializer
    and job class. Needs the dashboard extra: pip install "ortq[dashboard]".
    """
    try:
        from ortq.dashboard.app import create_app, listen, serve
        from ortq.dashboard.guard import Access, is_loopback
    except ImportError as exc:
        raise click.UsageError(f'{exc}: install the dashboard extra, pip install "ortq[dashboard]"') from exc
    try:
        access = Access.for_listener(host, auth, allowed_hosts)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="--auth") from exc
    listener = listen(host, port)  # a busy port fails now, before Redis is asked anything
    if access.credentials is None and not is_loopback(host):
        click.echo(
            f"warning: listening on {host} without --auth: anyone who can reach this port can delete and requeue "
            f"jobs (set {AUTH_ENV}=user:password)",
            err=True,
        )
    try:
        app = create_app(Settings.from_env(redis_url=redis_url, redis_shards=shards), access)
    except BaseException:
        listener.close()
        raise
    serve(app, host, listener)

"""The ``ortq pool`` command: plan a pool from pool.toml, then start and supervise its workers."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from ortq.cliopts import redis_url_option, shards_option
from ortq.errors import ConfigurationError
from ortq.redisurls import redacted_url

if TYPE_CHECKING:
    from ortq.pool.config import PoolConfig
    from ortq.pool.plan import Plan
    from ortq.settings import Settings
    from ortq.shards import ShardMap


@click.command(
    epilog="""Examples:

\b
  ortq pool --config pool.toml --check      # validate, resolve adapters, print the plan; start nothing
  ortq pool --config pool.toml              # start the workers and keep them running
  ortq pool --config pool.toml --force      # start even where memory estimates exceed an adapter's
  ortq pool --config pool.toml --redis-url redis://queue-host:6379/0
  ortq pool --config pool.toml --shards conv=redis://redis-big:6379/0   # conv's workers on their own Redis

\b
Exit status: 0 stopped cleanly (SIGINT/SIGTERM/CTRL_BREAK) or every burst worker finished;
1 some worker had to be killed or failed while stopping; 2 bad config or refused plan, or
nothing left to run after giving up on workers. See docs/pool.md, deploy/pool.example.toml
(deploy/pool.cpu.example.toml: a CPU pool of the bundled digits model to start from).
"""
)
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The pool's TOML file (see deploy/pool.example.toml).",
)
@click.option("--check", is_flag=True, help="Validate, resolve adapters and print the plan, then exit (0 / 2).")
@click.option("--force", is_flag=True, help="Start even where the workers' memory estimate exceeds an adapter's.")
@redis_url_option(
    help="Redis for every worker (default: the config's redis_url, else $ORTQ_REDIS_URL, else redis://127.0.0.1:6379/0)."
)
@shards_option(
    help="Models whose workers go to another Redis: MODEL=URL,MODEL=URL (default: $ORTQ_REDIS_SHARDS); a model's "
    "redis_url in the file must agree with it. See docs/pool.md, 'Sharding'."
)
@click.pass_context
def pool(
    ctx: click.Context, config_path: Path, check: bool, force: bool, redis_url: str | None, shards: str | None
) -> None:
    """Run N worker processes per adapter from a config file, and keep them running.

    Every adapter spec is resolved once against a fresh enumeration; each worker gets the
    adapter's stable spec (uuid:/luid:) and resolves it again itself. Dead workers are restarted
    with backoff (at once after a lost device; slowly, then never, after a configuration error).
    SIGINT/SIGTERM (CTRL_BREAK on Windows) stop every worker cleanly within grace_seconds.
    """
    from ortq.pool.config import PoolConfig
    from ortq.pool.devices import enumerate_for
    from ortq.pool.plan import format_plan, make_plan
    from ortq.settings import Settings

    config = PoolConfig.from_file(config_path)
    redis_url, source = _pool_redis_url(ctx.get_parameter_source("redis_url"), redis_url, config)
    try:  # checked now, so that --check catches it too
        settings = Settings.from_env(redis_url=redis_url, redis_shards="")
    except ConfigurationError as exc:
        raise ConfigurationError(f"{source}: {exc}") from None
    logging.getLogger("ortq.pool").info("workers' Redis: %s (from %s)", redacted_url(settings.redis_url), source)
    # The map's own messages name where it came from; its default is the pool's Redis.
    shard_map = config.shard_map(Settings.from_env(redis_url=settings.redis_url, redis_shards=shards))
    adapters, notes, plugins = enumerate_for(config)
    plan = make_plan(config, adapters, notes, plugins=plugins)
    click.echo(format_plan(plan, shard_map), err=not check)
    if over_budget := plan.budget_refusals():
        raise ConfigurationError(f"{config.source}: the memory budget cannot be kept: {'; '.join(over_budget)}")
    refusals = plan.refusals()
    if refusals and not force:
        why = "; ".join(refusals)
        raise ConfigurationError(f"{config.source}: not enough memory: {why} (--force starts it anyway)")
    if check:
        return
    sys.exit(_run(plan, settings, shard_map))


def _pool_redis_url(given: ParameterSource | None, redis_url: str | None, config: PoolConfig) -> tuple[str | None, str]:
    """The workers' Redis and where it comes from: an explicit --redis-url, else the file's [pool]
    redis_url, else $ORTQ_REDIS_URL, else the default (None). The file wins over the variable (it
    was written for this pool; the variable may be left in a shell), and says so when they differ:
    nobody who set the variable should find the pool elsewhere without a word."""
    if given is ParameterSource.COMMANDLINE:
        return redis_url, "--redis-url"
    file_key = f"{config.source}: [pool] redis_url"
    if config.redis_url is None:
        source = "$ORTQ_REDIS_URL" if redis_url else "the default (no --redis-url, redis_url or $ORTQ_REDIS_URL)"
        return redis_url, source
    if redis_url is not None and redis_url != config.redis_url:  # from $ORTQ_REDIS_URL
        logging.getLogger("ortq.pool").warning(
            "%s (%s) is used, not $ORTQ_REDIS_URL (%s): the file wins over the variable; --redis-url wins over "
            "both, or leave redis_url out of the file to use the variable",
            file_key,
            redacted_url(config.redis_url),
            redacted_url(redis_url),
        )
    return config.redis_url, file_key


def _run(plan: Plan, settings: Settings, shards: ShardMap) -> int:
    from ortq.pool.follow import QueueReader
    from ortq.pool.plan import build_slots
    from ortq.pool.status import Publisher
    from ortq.pool.supervisor import Supervisor

    log = logging.getLogger("ortq.pool")
    for url in sorted({shards.url_for(model.name) for model in plan.config.models}):
        try:
            settings.for_redis(url).connect().ping()
        except Exception as exc:  # redis-py's connection errors, which name host and port (never the password)
            log.warning("Redis does not answer (%s); starting the workers anyway, they retry with backoff", exc)
    verbose = logging.getLogger().isEnabledFor(logging.DEBUG)
    config = plan.config
    # An elastic pool reads its models' queues with the workers' own credentials, on each one's Redis.
    queues = QueueReader(lambda url: settings.for_redis(url).connect(check=False), shards.url_for)
    # Its record (budgets, resident models, evictions) goes to the pool's own Redis, for ortq info.
    publisher = Publisher(settings.connect(check=False), f"{socket.gethostname()}.{os.getpid()}")
    supervisor = Supervisor(build_slots(plan, shards, verbose), config.restart, config.grace_seconds,
                            config.log_dir, send_shutdown=_shutdown_through_redis(settings),
                            queues=queues if config.elastic else None,
                            publisher=publisher if config.elastic else None)  # fmt: skip

    def stop(signum: int, frame: FrameType | None) -> None:
        supervisor.request_stop(f"got {signal.Signals(signum).name}")

    names = ["SIGINT", "SIGTERM", "SIGBREAK" if sys.platform == "win32" else "SIGHUP"]
    for name in names:
        signal.signal(getattr(signal, name), stop)
    return supervisor.run()


def _shutdown_through_redis(settings: Settings) -> Callable[[str, str | None], None] | None:
    """On Windows, how the pool asks a worker to stop: RQ's shutdown command over its Redis, which
    needs no console (POSIX pools send SIGTERM)."""
    if sys.platform != "win32":
        return None
    from rq.command import send_shutdown_command

    def send(worker_name: str, redis_url: str | None) -> None:
        connection = (settings if redis_url is None else settings.for_redis(redis_url)).connect(check=False)
        try:
            send_shutdown_command(connection, worker_name)
        finally:
            connection.close()

    return send

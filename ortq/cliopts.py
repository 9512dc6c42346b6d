"""Options several ``ortq`` commands share (their own module: the command packages and
ortq/cli.py both import it, and ortq/cli.py imports the command packages)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click


def redis_url_option(
    help: str = "Redis to use (default: $ORTQ_REDIS_URL, else redis://127.0.0.1:6379/0); "
    "redis+sentinel://HOST:26379,HOST:26379/SERVICE/DB for a Sentinel group (docs/ha.md).",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--redis-url``, read from $ORTQ_REDIS_URL when not given (None when neither is)."""
    return click.option("--redis-url", envvar="ORTQ_REDIS_URL", default=None, help=help)


def shards_option(
    help: str = "Models on other Redis instances than --redis-url: MODEL=URL,MODEL=URL (default: $ORTQ_REDIS_SHARDS; "
    "docs/pool.md, 'Sharding').",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--shards``, the shard map (ortq/shards.py); None when not given, so that Settings.from_env
    reads $ORTQ_REDIS_SHARDS itself."""
    return click.option("--shards", default=None, metavar="MODEL=URL,...", help=help)

"""What a ``redis_url`` may be, and how one is shown: the checks every Redis URL ortq is given
passes (``Settings.redis_url``, each URL of the shard map) and its form without the password, for
messages and logs.

Both ``settings.py`` and ``shards.py`` check URLs, and ``Settings`` parses its shard map: the checks
live here, below both, so that neither imports the other back.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import redis

from ortq import sentinel
from ortq.errors import ConfigurationError

_SCHEMES = ("redis", "rediss", "unix")
#: What a redis_url may start with: one Redis (or a socket), or a Sentinel group (ortq/sentinel.py).
_ALL_SCHEMES = (*_SCHEMES, *sentinel.SCHEMES)
_SCHEMES_TEXT = ", ".join(f"{scheme}://" for scheme in _ALL_SCHEMES[:-1]) + f" or {_ALL_SCHEMES[-1]}://"

#: TLS options redis-py takes as ``rediss://`` URL query parameters (e.g. ``?ssl_ca_certs=/etc/ortq/ca.crt``).
_TLS_URL_OPTIONS = frozenset(
    p for p in inspect.signature(redis.SSLConnection.__init__).parameters if p.startswith("ssl_")
)
#: Those of them that name a file, checked when the settings are made rather than at the first connection.
_TLS_FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")


def redacted_url(redis_url: str) -> str:
    """``redis_url`` without its password and query, for messages and logs. Never raises, even for
    text that is no URL (shown as its host:port part alone)."""
    if "://" not in redis_url:
        return redis_url.partition("?")[0].rpartition("@")[2]
    if sentinel.is_sentinel_url(redis_url):
        return sentinel.redacted(redis_url)
    parts = urlsplit(redis_url)
    user = f"{unquote(parts.username)}@" if parts.username else ""
    if parts.scheme == "unix":
        return f"unix://{user}{parts.path}"
    try:
        port = parts.port or 6379
    except ValueError:  # not a number, or out of range: shown as written
        return f"{parts.scheme}://{user}{parts.netloc.rpartition('@')[2]}{parts.path}"
    host = parts.hostname or "localhost"  # redis-py's default host
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{user}{host}:{port}{parts.path}"


def _suggested_url(text: str) -> str:
    """What a redis_url written without a scheme most likely meant (password left out)."""
    if text.startswith("/"):
        return f"unix://{text.partition('?')[0]}"
    for scheme in _SCHEMES:  # "redis:/host", "redis//host": a mangled separator ("redis:6379" is a host)
        if text.startswith((f"{scheme}:/", f"{scheme}/")):
            text = text[len(scheme) :].lstrip(":/")
            break
    url = redacted_url(f"redis://{text}")
    if urlsplit(f"redis://{text}").password:
        url = url.replace("@", ":PASSWORD@", 1)
    return url if urlsplit(url).path.strip("/") else url.rstrip("/") + "/0"


def check_redis_url(redis_url: str) -> None:
    """Refuse a redis_url that redis-py would reject with a traceback, or worse read differently
    from what was meant (it ignores a path that is no database number and uses db 0)."""
    if "://" not in redis_url:
        raise ConfigurationError(
            f"redis_url {redacted_url(redis_url)!r} has no scheme; did you mean {_suggested_url(redis_url)}? "
            "(redis://HOST:PORT/DB, rediss:// for TLS, unix:///PATH for a socket)"
        )
    shown = redacted_url(redis_url)
    if sentinel.is_sentinel_url(redis_url):
        sentinel.SentinelURL.parse(redis_url)  # ConfigurationError, in one line, for a malformed one
        return
    parts = urlsplit(redis_url)
    if parts.scheme not in _SCHEMES:
        raise ConfigurationError(f"redis_url must start with {_SCHEMES_TEXT}, got {shown!r}")
    try:
        redis.ConnectionPool.from_url(redis_url)  # redis-py's own reading of the URL; connects to nothing
    except ValueError as exc:
        raise ConfigurationError(f"redis_url {shown!r}: {exc}") from None
    if parts.scheme != "unix" and not re.fullmatch(r"/?(\d+/?)?", unquote(parts.path)):
        raise ConfigurationError(
            f"redis_url {shown!r}: after HOST:PORT comes the database number (/0), not {parts.path!r}"
        )


def check_tls_options(redis_url: str) -> None:
    """Refuse misspelt, misplaced or missing-file TLS options: redis-py would only fail at the first
    connection, with a TypeError or an ``Error 2 connecting`` that names no file."""
    parts = urlsplit(redis_url)
    for name, values in parse_qs(parts.query).items():
        if not name.startswith("ssl_"):
            continue
        if parts.scheme not in ("rediss", "rediss+sentinel"):
            tls = "rediss+sentinel://" if sentinel.is_sentinel_url(redis_url) else "rediss://"
            raise ConfigurationError(f"redis_url option {name} needs the {tls} scheme (TLS), not {parts.scheme}://")
        if name not in _TLS_URL_OPTIONS:
            raise ConfigurationError(
                f"unknown TLS option {name} in redis_url; redis-py takes {', '.join(sorted(_TLS_URL_OPTIONS))}"
            )
        if name in _TLS_FILE_OPTIONS and not Path(values[-1]).exists():
            raise ConfigurationError(f"redis_url option {name}={values[-1]}: no such file")

"""Redis Sentinel URLs: one ``redis_url`` that names a Sentinel group instead of one Redis.

``redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB][?OPTIONS]``
(``rediss+sentinel://`` for TLS to the sentinels and the primary alike). HOST:PORT are the
sentinels (port 26379 unless given; an IPv6 address in brackets), SERVICE is the name they monitor
the primary under (``sentinel monitor SERVICE ...``), DB the database number (0 unless given).
USER and PASSWORD are the primary's (and its replicas'); the sentinels' own login, when they have
one (``requirepass`` in sentinel.conf), is given as the options ``sentinel_username`` and
``sentinel_password``. With ``rediss+sentinel://`` the ``ssl_*`` options of ``rediss://`` apply.

Nothing here fails over by itself: the clients are redis-py's own (``redis.sentinel.Sentinel``,
``redis.asyncio.sentinel.Sentinel``), whose connection pool asks the sentinels for the primary
at each new connection and drops a connection that meets a demoted primary (READONLY, or the
UNBLOCKED error of a blocked command) as a ConnectionError, which every ortq loop already takes as
"Redis unavailable, retry" (``settings.REDIS_DOWN``). docs/ha.md says what a failover looks like.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qs, unquote

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel

from ortq import redispack
from ortq.errors import ConfigurationError

SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_PORT = 26379
#: The options of the sentinels' own login (the URL's USER:PASSWORD are the primary's).
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
#: ``ssl_*`` options a sentinel client takes too (redis.Redis's own parameters), for rediss+sentinel.
_CLIENT_TLS_OPTIONS = frozenset(p for p in inspect.signature(redis.Redis.__init__).parameters if p.startswith("ssl_"))
_FORM = "redis+sentinel://[USER:PASSWORD@]HOST:26379,HOST:26379/SERVICE/DB"


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` is written with one of :data:`SCHEMES`."""
    return url.partition("://")[0].lower() in SCHEMES


@dataclass(frozen=True)
class SentinelURL:
    """A parsed Sentinel URL. Passwords are left out of the repr."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    tls: bool = False
    #: The ``ssl_*`` options, parsed as redis-py parses them for ``rediss://``.
    tls_options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, url: str) -> SentinelURL:
        """ConfigurationError, in one line naming the URL without its password, for a URL that
        names no sentinel, no service, a bad port or database, or an option this form has not."""
        shown = redacted(url)
        scheme, _, rest = url.partition("://")
        if scheme.lower() not in SCHEMES:
            raise ConfigurationError(f"redis_url {shown!r} is not a Sentinel URL ({' or '.join(SCHEMES)}://)")
        rest, _, query = rest.partition("?")
        netloc, _, path = rest.partition("/")
        userinfo, at, hostlist = netloc.rpartition("@")
        if not at:
            userinfo = ""
        username, colon, password = userinfo.partition(":")
        sentinels = tuple(_sentinel_address(entry, shown) for entry in hostlist.split(","))
        service, _, db_text = path.partition("/")
        service = unquote(service)
        if not service:
            raise ConfigurationError(
                f"redis_url {shown!r} names no Sentinel service: after the sentinels comes the name they "
                f"monitor the primary under ({_FORM})"
            )
        db_text = db_text.rstrip("/")
        if db_text and not re.fullmatch(r"\d+", db_text):
            raise ConfigurationError(
                f"redis_url {shown!r}: after /SERVICE comes the database number (/0), not {'/' + db_text!r}"
            )
        options = _options(query, shown)
        tls = scheme.lower() == "rediss+sentinel"
        tls_options = _tls_options(query, shown) if tls else ()
        return cls(
            sentinels=sentinels,
            service=service,
            db=int(db_text or 0),
            username=unquote(username) or None,
            password=unquote(password) if colon else None,
            sentinel_username=options.get("sentinel_username"),
            sentinel_password=options.get("sentinel_password"),
            tls=tls,
            tls_options=tls_options,
        )

    def where(self) -> str:
        """The sentinels, for messages: ``host:port,host:port``."""
        return ",".join(_address(host, port) for host, port in self.sentinels)

    def primary_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the primary's connections that come from the URL."""
        kwargs: dict[str, Any] = {"db": self.db, "username": self.username, "password": self.password}
        if self.tls:
            kwargs.update(ssl=True, **dict(self.tls_options))
        return kwargs

    def sentinel_kwargs(self, socket_timeout: float) -> dict[str, Any]:
        """The keyword arguments of the clients that ask the sentinels (redis.Redis's)."""
        kwargs: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_timeout,
            "username": self.sentinel_username,
            "password": self.sentinel_password,
        }
        if self.tls:
            kwargs.update(ssl=True, **dict(self.tls_options))
        return kwargs


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _sentinel_address(entry: str, shown: str) -> tuple[str, int]:
    """One ``HOST[:PORT]`` of the sentinel list (``[IPv6][:PORT]`` too)."""
    if not entry:
        raise ConfigurationError(
            f"redis_url {shown!r} names no sentinel (or an empty one between commas): "
            f"list them as HOST:PORT separated by commas ({_FORM})"
        )
    if entry.startswith("["):
        host, bracket, port_text = entry[1:].partition("]")
        if not bracket or (port_text and not port_text.startswith(":")):
            raise ConfigurationError(f"redis_url {shown!r}: sentinel {entry!r} is no [IPv6]:PORT")
        port_text = port_text[1:]
    else:
        host, _, port_text = entry.partition(":")
    if not host:
        raise ConfigurationError(f"redis_url {shown!r}: sentinel {entry!r} has no host")
    if not port_text:
        return unquote(host), DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigurationError(f"redis_url {shown!r}: sentinel {entry!r} has no valid port (1-65535)")
    return unquote(host), int(port_text)


def _options(query: str, shown: str) -> dict[str, str]:
    """The sentinels' login options; ConfigurationError for one this form does not take."""
    values = parse_qs(query, keep_blank_values=True)
    for name in values:
        if name not in SENTINEL_OPTIONS and not name.startswith("ssl_"):
            raise ConfigurationError(
                f"redis_url {shown!r}: unknown option {name}; a Sentinel URL takes "
                f"{', '.join(SENTINEL_OPTIONS)} (and ssl_* options with rediss+sentinel://)"
            )
    return {name: values[name][-1] for name in SENTINEL_OPTIONS if name in values}


def _tls_options(query: str, shown: str) -> tuple[tuple[str, Any], ...]:
    """The ``ssl_*`` options, read by redis-py's own URL parser (its types: booleans, ...)."""
    tls_query = "&".join(part for part in query.split("&") if part.startswith("ssl_"))
    try:
        parsed: dict[str, Any] = redis.connection.parse_url(f"rediss://localhost/0?{tls_query}")  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ConfigurationError(f"redis_url {shown!r}: {exc}") from None
    options = tuple(sorted((name, value) for name, value in parsed.items() if name.startswith("ssl_")))
    for name, _ in options:
        if name not in _CLIENT_TLS_OPTIONS:
            raise ConfigurationError(f"redis_url {shown!r}: TLS option {name} cannot be passed to the sentinels")
    return options


def redacted(url: str) -> str:
    """A Sentinel URL without passwords and options (``redis+sentinel://USER@H1:26379,H2:26379/SERVICE/DB``),
    for messages and logs. Never raises: a part it cannot read is shown as written, less the login."""
    scheme, _, rest = url.partition("://")
    rest = rest.partition("?")[0]
    netloc, slash, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    user = f"{unquote(userinfo.partition(':')[0])}@" if at and userinfo.partition(":")[0] else ""
    shown_hosts = []
    for entry in (hostlist if at else netloc).split(","):
        try:
            shown_hosts.append(_address(*_sentinel_address(entry, "")))
        except ConfigurationError:
            shown_hosts.append(entry)
    return f"{scheme}://{user}{','.join(shown_hosts)}{slash}{path}"


# ---------------------------------------------------------------------------- clients

#: What a primary answers a write with once it has fewer good replicas than its
#: ``min-replicas-to-write`` (docs/ha.md: what keeps a graceful failover from losing writes).
NOREPLICAS = "NOREPLICAS"


def _cut_off() -> redis.ConnectionError:
    return redis.ConnectionError(
        "the primary refuses writes: NOREPLICAS (its replica left: promoted by a failover, or lagging); "
        "asking the sentinels for the primary again"
    )


class PrimaryConnection(redis.sentinel.SentinelManagedConnection):
    """redis-py's Sentinel connection, which drops itself on a demoted primary's READONLY and
    UNBLOCKED answers (ConnectionError), dropping itself on NOREPLICAS too: a primary configured
    with ``min-replicas-to-write`` answers that from the moment the sentinels promote its replica
    until they demote it (seconds), and only a new connection finds the new primary sooner."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if str(exc).startswith(NOREPLICAS) and self.connection_pool.is_master:
                self.disconnect()  # type: ignore[no-untyped-call]
                raise _cut_off() from exc
            raise


class PrimarySSLConnection(PrimaryConnection, redis.SSLConnection):
    """:class:`PrimaryConnection` over TLS (rediss+sentinel://)."""


class AsyncPrimaryConnection(redis.asyncio.sentinel.SentinelManagedConnection):
    """:class:`PrimaryConnection` for redis.asyncio."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if str(exc).startswith(NOREPLICAS) and self.connection_pool.is_master:
                await self.disconnect()
                raise _cut_off() from exc
            raise


class AsyncPrimarySSLConnection(AsyncPrimaryConnection, redis.asyncio.SSLConnection):
    """:class:`AsyncPrimaryConnection` over TLS."""


def connect(url: str, **connection_kwargs: Any) -> redis.Redis:
    """A client of the primary of ``url``'s service, through redis-py's Sentinel. Connects to
    nothing yet: the first command asks the sentinels for the primary."""
    parsed = SentinelURL.parse(url)
    socket_timeout = float(connection_kwargs.get("socket_timeout") or 10.0)
    sentinel = redis.sentinel.Sentinel(
        parsed.sentinels, sentinel_kwargs=parsed.sentinel_kwargs(socket_timeout), **connection_kwargs
    )
    kwargs = parsed.primary_kwargs()
    kwargs["connection_class"] = PrimarySSLConnection if kwargs.pop("ssl", False) else PrimaryConnection
    client: redis.Redis = sentinel.master_for(parsed.service, redis_class=PrimaryClient, **kwargs)
    return client


class PrimaryClient(redis.Redis):
    """A client of a Sentinel group's primary whose ``close`` closes the sentinels' clients too:
    redis-py leaves those (one connection to each sentinel that was asked) open until they are
    garbage-collected, and before 8.2 has no call that closes them."""

    def close(self) -> None:
        super().close()
        for client in _sentinel_clients(self.connection_pool):
            client.close()


class AsyncPrimaryClient(redis.asyncio.Redis):
    """:class:`PrimaryClient` for redis.asyncio. Two clients may share the sentinels
    (``async_primary``): closing one closes them, and the other's next question reopens them."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for client in _sentinel_clients(self.connection_pool):
            await client.aclose()


def _sentinel_clients(pool: object) -> list[Any]:
    manager = getattr(pool, "sentinel_manager", None)
    return list(getattr(manager, "sentinels", []))


class BlockingSentinelPool(redis.asyncio.sentinel.SentinelConnectionPool, redis.asyncio.BlockingConnectionPool):
    """redis-py's asyncio Sentinel pool that waits for a free connection once ``max_connections``
    are in use (what ``AsyncProducer``'s pools do), where its own raises "Too many connections"."""


def async_connect(url: str, max_connections: int, **connection_kwargs: Any) -> redis.asyncio.Redis:
    """An asyncio client of the primary of ``url``'s service, on a pool of at most
    ``max_connections`` that callers wait on. Connects to nothing yet."""
    parsed = SentinelURL.parse(url)
    socket_timeout = float(connection_kwargs.get("socket_timeout") or 10.0)
    sentinel = redis.asyncio.sentinel.Sentinel(
        parsed.sentinels, sentinel_kwargs=parsed.sentinel_kwargs(socket_timeout), **connection_kwargs
    )
    kwargs = parsed.primary_kwargs()
    primary = AsyncPrimarySSLConnection if kwargs.pop("ssl", False) else AsyncPrimaryConnection
    kwargs["connection_class"] = redispack.packing(primary)  # commands packed by hiredis in one call
    return async_primary(sentinel, parsed.service, max_connections, **kwargs)


def async_primary(
    sentinel: redis.asyncio.sentinel.Sentinel, service: str, max_connections: int, **kwargs: Any
) -> redis.asyncio.Redis:
    """Another asyncio client of ``service``'s primary from ``sentinel`` (e.g. a second pool of
    another size, sharing the sentinels' clients)."""
    client: redis.asyncio.Redis = sentinel.master_for(
        service,
        redis_class=AsyncPrimaryClient,
        connection_pool_class=BlockingSentinelPool,
        max_connections=max_connections,
        timeout=None,
        **kwargs,
    )
    return client


def unknown_service(client: redis.Redis) -> ConfigurationError | None:
    """What only the URL can fix when no primary was found for ``client``'s service: a
    ConfigurationError when a sentinel refused the login, or when sentinels answered and none of
    them monitors the service; None when none answered (unreachable) or one knows the service but
    has no primary for it now (a failover in progress: try again)."""
    pool = client.connection_pool
    if not isinstance(pool, redis.sentinel.SentinelConnectionPool):
        return None
    manager: redis.sentinel.Sentinel = pool.sentinel_manager
    service: str = pool.service_name
    where = ",".join(_address(**_host_port(s)) for s in manager.sentinels)
    known: set[str] = set()
    answered = False
    for each in manager.sentinels:
        try:
            masters = cast(dict[str, Any], each.sentinel_masters())
        except (redis.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError) as refused:
            return ConfigurationError(
                f"a sentinel of {where} refused the login: {refused} "
                "(the sentinels' own: sentinel_username and sentinel_password in redis_url)"
            )
        except redis.RedisError:
            continue
        if service in masters:
            return None
        answered = True
        known.update(masters)
    if not answered:
        return None
    return ConfigurationError(
        f"no sentinel of {where} monitors a service named {service!r} (they monitor: "
        f"{', '.join(sorted(known)) or 'nothing'}); check SERVICE in redis_url ({_FORM})"
    )


def _host_port(client: redis.Redis) -> dict[str, Any]:
    kwargs = client.connection_pool.connection_kwargs
    return {"host": str(kwargs.get("host")), "port": int(kwargs.get("port") or DEFAULT_PORT)}

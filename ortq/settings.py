"""Connection and retention settings shared by producers and workers.

One frozen object; ``from_env()`` reads ``ORTQ_*`` variables and CLI flags map onto the
same fields, so a deployment can be configured either way.
"""

from __future__ import annotations

import inspect
import os
import re
import ssl
from dataclasses import dataclass, fields, replace
from dataclasses import field as dataclass_field
from typing import Any

import redis
from redis.sentinel import MasterNotFoundError

from ortq import redispack, sentinel
from ortq.errors import EXIT_CONFIGURATION, EXIT_UNAVAILABLE, ConfigurationError
from ortq.redisurls import check_redis_url, check_tls_options, redacted_url
from ortq.shards import ENV_VAR, ShardMap
from ortq.wire import DEFAULT_MAX_FRAME_BYTES

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: What redis-py raises when Redis cannot be reached (refused, reset, timed out), which every
#: ortq loop that rides out an outage catches. A refused login (AuthenticationError) is one too.
#: So is all that a Sentinel failover raises through redis-py's Sentinel clients: MasterNotFoundError
#: (no primary while the sentinels elect one), a demoted primary's READONLY or UNBLOCKED answer,
#: which its connections turn into "ConnectionError: The previous master is now a slave", and a
#: primary's NOREPLICAS, which ortq.sentinel.PrimaryConnection turns into a ConnectionError too.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)

#: Frames at least this large go to redis-py as memoryviews (see frame_argument).
LARGE_FRAME = 64 * 1024


def _packs_memoryviews_whole() -> bool:
    """Whether this redis-py sends a memoryview argument as it is. Its Python packer always has; its
    hiredis packer (used when hiredis is installed) does from redis-py 8.2 (it hands a command with
    a memoryview to the Python packer), and before that copied each memoryview into bytes first."""
    from redis.connection import HiredisRespSerializer
    from redis.utils import HIREDIS_AVAILABLE

    return not HIREDIS_AVAILABLE or "fallback" in inspect.signature(HiredisRespSerializer.__init__).parameters


_MEMORYVIEWS_WHOLE = _packs_memoryviews_whole()


def frame_argument(frame: bytes) -> bytes | memoryview:
    """``frame`` as a command argument: with hiredis, redis-py packs a command's arguments into one
    new buffer, copying every frame once more before the socket does (0.44 ms for a finish call
    with eight 600 KB frames on the CI VM); from redis-py 8.2 a command with a memoryview among its
    arguments is packed in chunks instead, each large one sent as it is (13 us). Small frames stay
    bytes (hiredis packs those faster than the Python packer), and so does every frame where
    redis-py would copy a memoryview into bytes anyway (before 8.2: a copy more, not one fewer)."""
    return memoryview(frame) if _MEMORYVIEWS_WHOLE and len(frame) >= LARGE_FRAME else frame


_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _from_text(kind: type, raw: str) -> Any:
    """An environment variable's text as a field of type ``kind`` (``bool("0")`` would be True)."""
    if kind is bool:
        try:
            return _BOOLEANS[raw.strip().lower()]
        except KeyError:
            raise ValueError(f"expected one of {', '.join(_BOOLEANS)}") from None
    return kind(raw)


@dataclass(frozen=True)
class Settings:
    """Where Redis is and how long ortq keeps what it writes there."""

    redis_url: str = DEFAULT_REDIS_URL
    #: Seconds a single Redis command may take. Blocking reads are issued in slices
    #: shorter than this, so a long wait never trips the socket timeout.
    socket_timeout: float = 10.0
    #: Seconds a job's request tensors wait for a worker before they expire.
    request_ttl: int = 24 * 3600
    #: Seconds a finished job's response (and RQ's record of it) is kept.
    result_ttl: int = 600
    #: Seconds a failed job's response and RQ record are kept.
    failure_ttl: int = 24 * 3600
    #: Largest request or response frame accepted, checked before decoding.
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    #: Seconds between a worker's heartbeats while a run is in progress.
    heartbeat_seconds: float = 5.0
    #: Backpressure: ``submit`` raises QueueFull once a model's queue holds this many jobs (0: no limit).
    max_queue_length: int = 0
    #: Workers write RQ's result record (``rq:results:<id>``: what RQ's ``job.return_value()``, the
    #: dashboards' result column read) for each successful job. ortq's producers read the reply
    #: instead, so turning it off (``ORTQ_RQ_RESULTS=0``) loses nothing they see and saves Redis ~15%
    #: of its scripts' time per small job (docs/performance.md); failures are always recorded.
    rq_results: bool = True
    #: Workers write RQ's execution records of the jobs they run (``rq:execution:<id>:<execution>``,
    #: ``rq:executions:<id>`` and RQ 3's ``rq:worker:<name>:executions``: what RQ's
    #: ``job.get_executions()`` and a worker's current job in ``rq info`` and rq-dashboard read;
    #: ``ortq info`` shows it from ortq's own worker record either way). They are written at the
    #: worker's heartbeats, for the jobs it holds then (ortq/rqcompat/lua/executions.lua), not at
    #: each start: a job that ends before a heartbeat never has them, and costs Redis nothing for
    #: them. ortq's recovery finds a running job's worker in its execution id, so turning them off
    #: (``ORTQ_RQ_EXECUTIONS=0``) loses only those views. The started registry is written either way.
    rq_executions: bool = True
    #: Replicas that must have each enqueue and each answer before a producer's submit returns and
    #: a worker counts a job answered (Redis's WAIT: ortq/replication.py). 0, the default: none,
    #: and a failover can lose the last writes its old primary acknowledged (docs/ha.md). A submit
    #: whose jobs are not confirmed in time raises BrokerUnavailable (they may be enqueued); a
    #: worker sends such an answer again (fenced: it is written once) until it is confirmed.
    wait_replicas: int = 0
    #: Milliseconds each WAIT for ``wait_replicas`` may take.
    wait_replicas_ms: int = 1000
    #: Seconds a producer's submit goes on trying while Redis is unavailable (a Sentinel failover's
    #: window, a restart), backing off from 0.1 s to 1 s; 0, the default: it raises
    #: BrokerUnavailable at once. Only what cannot enqueue a job twice is tried again: a submit with
    #: ``job_id`` and ``unique=True`` (and ``infer``, which then picks its job's id itself), and any
    #: submit whose failure came before its write (docs/ha.md).
    submit_retry_seconds: float = 0.0
    #: Models whose queues are on another Redis than ``redis_url``: ``MODEL=URL,MODEL=URL``
    #: (ortq/shards.py). Producers and the ``ortq`` commands route by it; workers ignore it (each
    #: takes its model's URL as its ``redis_url``). Empty: every model on ``redis_url``. Left out of
    #: the repr: its URLs may hold passwords.
    redis_shards: str = dataclass_field(default="", repr=False)

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url)
        check_tls_options(self.redis_url)
        if self.socket_timeout < 2:
            raise ConfigurationError(f"socket_timeout must be at least 2 seconds, got {self.socket_timeout}")
        for name in ("request_ttl", "result_ttl", "failure_ttl", "max_frame_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_seconds <= 0:
            raise ConfigurationError(f"heartbeat_seconds must be positive, got {self.heartbeat_seconds}")
        if self.wait_replicas < 0 or self.wait_replicas_ms <= 0:
            raise ConfigurationError(
                f"wait_replicas must be >= 0 and wait_replicas_ms positive, got {self.wait_replicas}"
                f" and {self.wait_replicas_ms}"
            )
        if not 0 <= self.submit_retry_seconds <= 3600:
            raise ConfigurationError(
                f"submit_retry_seconds must be between 0 and 3600, got {self.submit_retry_seconds}"
            )
        if self.max_queue_length < 0:
            raise ConfigurationError(f"max_queue_length must be >= 0, got {self.max_queue_length}")
        if self.redis_shards:
            source = f"shard map (redis_shards, --shards, ${ENV_VAR})"
            shards = ShardMap.parse(self.redis_shards, self.redis_url, source=source)
            object.__setattr__(self, "_shards", shards)  # parsed once; frozen for everyone else

    @classmethod
    def from_url(cls, redis_url: str, **overrides: Any) -> Settings:
        return cls(redis_url=redis_url, **overrides)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``ORTQ_<FIELD>`` variables (e.g. ``ORTQ_REDIS_URL``); ``overrides`` win.

        Overrides that are None are ignored, so CLI options that were not given fall through.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in fields(cls):
            raw = env.get("ORTQ_" + field.name.upper())
            if raw is None:
                continue
            try:
                values[field.name] = _from_text(type(getattr(cls(), field.name)), raw)
            except ValueError as exc:
                raise ConfigurationError(f"ORTQ_{field.name.upper()}={raw!r}: {exc}") from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @property
    def shards(self) -> ShardMap | None:
        """The parsed ``redis_shards`` (its default: ``redis_url``), None when it is empty."""
        shards: ShardMap | None = self.__dict__.get("_shards")
        return shards

    def for_redis(self, redis_url: str) -> Settings:
        """These settings for one Redis of the shard map: ``redis_url`` replaced, no map."""
        return replace(self, redis_url=redis_url, redis_shards="")

    @property
    def block_slice(self) -> float:
        """Longest single blocking read (BLMOVE/BLPOP), kept under the socket timeout."""
        return max(1.0, self.socket_timeout - 1.0)

    def connect(self, check: bool = True) -> redis.Redis:
        """A client for ``redis_url`` (hiredis parser when installed) with this socket timeout.

        With ``check``, one PING first, so that refused credentials, an untrusted certificate or a
        user without PING fail here, as ConfigurationError (the CLI's one-line message and exit
        status 2), rather than as a traceback from deep inside the first command. An unreachable
        server still raises redis.ConnectionError: that one may pass, and a restart may help.
        """
        options: dict[str, Any] = {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_timeout,
            "health_check_interval": 30,
            # Frames are large: read them in 1 MiB slices, not 64 KiB (fewer syscalls per frame).
            "socket_read_size": 1 << 20,
        }
        if redispack.PACKER is not None:  # each command packed by hiredis in one call (ortq.redispack)
            options["command_packer"] = redispack.PACKER
        try:
            if sentinel.is_sentinel_url(self.redis_url):
                client = sentinel.connect(self.redis_url, **options)  # the primary, wherever it is now
            else:
                client = redis.Redis.from_url(self.redis_url, **options)
        except ValueError as exc:  # a query option redis-py cannot read (check_redis_url passed the rest)
            raise ConfigurationError(f"redis_url {redacted_url(self.redis_url)!r}: {exc}") from None
        if check:
            _ping(client, redacted_url(self.redis_url))
        return client


def _not_redis_hint(message: str) -> str:
    """What kind of server answered, from the first byte of a non-RESP answer as redis-py quotes it
    (hiredis: ``Protocol error, got "<" as reply type byte``; its Python parser:
    ``Protocol Error: b'<!DOCTYPE...'``)."""
    found = re.search(r'got "(.+?)"|Protocol Error: b[\'"](\\x[0-9a-f]{2}|.)', message)
    first = (found.group(1) or found.group(2)) if found else ""
    if first in ("<", "H"):
        return " (an HTTP server, by its answer)"
    if first in ("\\x15", "\\x16"):  # a TLS alert or handshake record
        return " (a TLS server, by its answer: use rediss:// for a TLS port)"
    return ""


def _ping(client: redis.Redis, where: str) -> None:
    """PING through ``client``; what only the configuration can fix becomes a ConfigurationError."""
    try:
        client.ping()
    except MasterNotFoundError as exc:  # a Sentinel URL (a ConnectionError: before that branch)
        if (refusal := sentinel.unknown_service(client)) is not None:
            client.close()
            raise refusal from exc
        raise
    except redis.AuthenticationError as exc:  # a subclass of ConnectionError: caught first
        client.close()
        raise ConfigurationError(
            f"Redis at {where} refused the login: {exc} "
            "(check the user and password in redis_url: rediss://USER:PASSWORD@HOST:PORT/DB)"
        ) from exc
    except redis.exceptions.NoPermissionError as exc:
        client.close()
        # PING, or SELECT for a db other than 0: the ACL rules of docs/security.md grant both.
        raise ConfigurationError(f"the Redis user of {where} lacks a permission: {exc} (see docs/security.md)") from exc
    except redis.exceptions.InvalidResponse as exc:
        # Something answered, but not in Redis's protocol (RESP): the wrong port, most likely.
        client.close()
        said = str(exc) if len(str(exc)) <= 80 else str(exc)[:77] + "..."
        raise ConfigurationError(
            f"the server at {where} is not Redis{_not_redis_hint(str(exc))}: it answered PING with "
            f"{said!r}. Check the host and port in redis_url (Redis listens on 6379 unless told otherwise)"
        ) from exc
    except redis.exceptions.ResponseError as exc:  # e.g. SELECT of a database the server does not have
        client.close()
        raise ConfigurationError(f"Redis at {where} refused the connection: {exc}") from exc
    except redis.ConnectionError as exc:
        cause = exc.__context__
        if not isinstance(cause, ssl.SSLError):
            # Connected, then dropped at the first read: what a Redis TLS port does to a plain client.
            dropped = str(exc).startswith(("Connection closed by server", "Error while reading from"))
            if dropped and where.startswith("redis://"):
                raise redis.ConnectionError(f"{exc} (if that port serves TLS, use rediss://)") from exc
            raise
        client.close()
        why = cause.verify_message if isinstance(cause, ssl.SSLCertVerificationError) else cause.reason or str(cause)
        raise ConfigurationError(
            f"TLS with Redis at {where} failed: {why} (check ssl_ca_certs: the CA that signed the server's "
            "certificate; and ssl_certfile/ssl_keyfile if the server asks for a client certificate)"
        ) from exc


def redis_message(exc: BaseException) -> str:
    """What Redis said in ``exc``, without redis-py's note of which pipelined command it answered
    (``Command # 2 (SET ortq:req:... <the frame's bytes>) of pipeline caused error: ...``): that
    quotes the command's arguments, a request frame's binary bytes and newlines included."""
    text = str(exc)
    if text.startswith("Command # ") and _PIPELINE_NOTE in text:
        return text.rpartition(_PIPELINE_NOTE)[2]
    if isinstance(exc, MasterNotFoundError) and " : " in text:
        # redis-py lists each sentinel's error after the repr of its whole client (~1,200
        # characters a sentinel); what each sentinel answered is its address and reason.
        head = text.partition(" : ")[0]
        reasons = [f"{where} {why}" for where, why in _SENTINEL_REFUSAL.findall(text)]
        return f"{head}: " + ("; ".join(dict.fromkeys(reasons)) or "no sentinel answered")
    return text


_PIPELINE_NOTE = ") of pipeline caused error: "
#: One sentinel's connection error in redis-py's MasterNotFoundError: "Error 111 connecting to
#: HOST:PORT. Connection refused." (a timeout: "Timeout connecting to server" names no address).
_SENTINEL_REFUSAL = re.compile(r"connecting to (\S+?:\d+)\. ([^'\",]+?)\.?(?=['\",)]|$)")


def describe_redis_error(exc: redis.RedisError) -> tuple[str, int]:
    """A one-line message and the ``ortq`` exit status for a redis-py error that no ortq layer turned
    into an OrtqError (a client made without the PING check, a refusal in the middle of a command)."""
    message = redis_message(exc)
    if isinstance(exc, redis.AuthenticationError):
        return f"Redis refused the login: {message} (check the user and password in the URL)", EXIT_CONFIGURATION
    if isinstance(exc, REDIS_DOWN):
        return f"Redis unavailable: {message}", EXIT_UNAVAILABLE
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return f"the Redis user lacks a permission: {message} (see docs/security.md)", EXIT_CONFIGURATION
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return f"Redis refused a write: {message} (a read-only replica? use the primary's URL)", EXIT_CONFIGURATION
    if isinstance(exc, redis.exceptions.InvalidResponse):
        return f"the server is not Redis (check the host and port of the URL): {message}", EXIT_CONFIGURATION
    return f"Redis error: {type(exc).__name__}: {message}", EXIT_UNAVAILABLE

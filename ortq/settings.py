"""Connection and retention settings shared by producers and workers.

One frozen object; ``from_env()`` reads ``ORTQ_*`` variables and CLI flags map onto the
same fields, so a deployment can be configured either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

import redis

from ortq.errors import ConfigurationError
from ortq.wire import DEFAULT_MAX_FRAME_BYTES

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


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

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigurationError(
                f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}"
            )
        if self.socket_timeout < 2:
            raise ConfigurationError(f"socket_timeout must be at least 2 seconds, got {self.socket_timeout}")
        for name in ("request_ttl", "result_ttl", "failure_ttl", "max_frame_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_seconds <= 0:
            raise ConfigurationError(f"heartbeat_seconds must be positive, got {self.heartbeat_seconds}")
        if self.max_queue_length < 0:
            raise ConfigurationError(f"max_queue_length must be >= 0, got {self.max_queue_length}")

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
                values[field.name] = type(getattr(cls(), field.name))(raw)
            except ValueError as exc:
                raise ConfigurationError(f"ORTQ_{field.name.upper()}={raw!r}: {exc}") from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @property
    def block_slice(self) -> float:
        """Longest single blocking read (BLMOVE/BLPOP), kept under the socket timeout."""
        return max(1.0, self.socket_timeout - 1.0)

    def connect(self) -> redis.Redis:
        """A client for ``redis_url`` (hiredis parser when installed) with this socket timeout."""
        client: redis.Redis = redis.Redis.from_url(
            self.redis_url,
            socket_timeout=self.socket_timeout,
            socket_connect_timeout=self.socket_timeout,
            health_check_interval=30,
            # Frames are large: read them in 1 MiB slices, not 64 KiB (fewer syscalls per frame).
            socket_read_size=1 << 20,
        )
        return client

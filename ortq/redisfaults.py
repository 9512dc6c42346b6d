"""What a failed Redis call means: every redis-py exception a producer meets becomes an OrtqError,
worded the same by ``Producer`` and ``AsyncProducer`` (which raise the same redis-py classes); the
worker asks the same questions of its own errors (a key of the wrong type, a refusal by the ACL).

No I/O here: the callers catch, these helpers name.
"""

from __future__ import annotations

import redis

from ortq.errors import (
    EXIT_CONFIGURATION,
    BrokerUnavailable,
    ConfigurationError,
    CorruptRecord,
    OrtqError,
    ResultTimeout,
)
from ortq.settings import REDIS_DOWN, Settings, describe_redis_error, redis_message


def is_down(exc: BaseException) -> bool:
    """Redis unreachable (refused, reset, timed out): waiting may help. A refused login is a
    ConnectionError too, but waiting will not help it."""
    return isinstance(exc, REDIS_DOWN) and not isinstance(exc, redis.AuthenticationError)


def is_wrong_type(exc: BaseException) -> bool:
    """A command refused because a key holds another type than the command works on."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE")


def is_refused(exc: BaseException) -> bool:
    """The Redis user may not run that command on that key (ACL); inside a script or function,
    Redis 7.0 words it "The user executing the script can't run this command", Valkey 8 "ACL failure
    in script: User ... has no permissions to run the '...' command" (no NOPERM either)."""
    text = str(exc)
    return isinstance(exc, redis.exceptions.NoPermissionError) or any(
        words in text for words in ("NOPERM", "can't run this command", "ACL failure in script")
    )


def failure(exc: redis.RedisError, doing: str, wrong_type: str | None = None) -> OrtqError:
    """The OrtqError to raise for ``exc``, caught while ``doing`` (e.g. "could not enqueue ..."):
    BrokerUnavailable when Redis is unreachable, CorruptRecord (``wrong_type`` says which key) when
    a key holds what ortq did not write, ConfigurationError for a refusal that only the settings or
    the ACL can fix (login, permission, read-only replica, a server that is not Redis)."""
    if is_down(exc):
        return BrokerUnavailable(f"{doing}: Redis unavailable ({redis_message(exc)})")
    if wrong_type is not None and is_wrong_type(exc):
        return CorruptRecord(f"{wrong_type}: {redis_message(exc)}")
    message, status = describe_redis_error(exc)
    if status == EXIT_CONFIGURATION:
        return ConfigurationError(f"{doing}: {message}")
    return BrokerUnavailable(f"{doing}: {message}")


def block_seconds(settings: Settings, socket_timeout: float | None) -> float:
    """The longest single blocking read (XREAD BLOCK) on a connection with ``socket_timeout``: a
    second under it, so that a long wait is never cut short by the socket timeout (redis-py 8 sets
    5 s unless told otherwise, whatever ``Settings.socket_timeout`` says)."""
    if socket_timeout is None:
        return settings.block_slice
    return max(0.1, min(settings.block_slice, float(socket_timeout) - 1.0))


class Outage:
    """A wait that rides out Redis restarting (replies are kept by Redis, so a result may still come)
    until its deadline, then says whether it was Redis that was missing. The caller sleeps."""

    def __init__(self) -> None:
        self.last: redis.RedisError | None = None
        self._delay = 0.05

    def failed(self, exc: redis.RedisError, doing: str) -> float:
        """Seconds to wait before reading again after ``exc``; raises at once what waiting will not mend."""
        if not is_down(exc):
            raise failure(exc, doing) from exc
        self.last = exc
        delay = self._delay
        self._delay = min(self._delay * 2, 1.0)
        return delay

    def recovered(self) -> None:
        """A read went through: the next outage backs off from the start again."""
        self._delay = 0.05

    def error(self, message: str) -> OrtqError:
        """What a wait that ran out raises: BrokerUnavailable if Redis failed during it."""
        if self.last is None:
            return ResultTimeout(message)
        return failure(self.last, message)

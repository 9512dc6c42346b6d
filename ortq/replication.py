"""Writes confirmed on replicas (``Settings.wait_replicas``): Redis replicates asynchronously, so a
primary acknowledges a write before any replica has it, and a failover in that moment loses it (a
Sentinel failover is not coordinated with the old primary: docs/ha.md, "What a failover loses").
With ``wait_replicas`` set, a producer's submit returns, and a worker counts a job answered, only
once that many replicas have the write.

Redis's ``WAIT n ms`` waits for the replication offset of the connection's own last write. A
producer's enqueue and a worker's retried (fenced, so possibly write-free) answer may have gone
over another pooled connection, so the wait follows a ``PUBLISH`` on the same connection: it is
replicated like a write and moves that offset to the primary's current one, which covers every
write made before it, on any connection. Nobody subscribes to the channel.

No I/O here: the callers queue these commands on their pipelines and check the reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from ortq.settings import Settings, redis_message

#: The channel of the PUBLISH before each WAIT (the ACL rules in docs/security.md name it).
CHANNEL = "ortq:replicated"


class NotReplicated(redis.ConnectionError):
    """Fewer replicas than ``wait_replicas`` confirmed a write within ``wait_replicas_ms``: the
    write stands on the primary but a failover now could lose it. A ConnectionError, so that what
    rides out an outage (the worker's answers, a producer's BrokerUnavailable) treats it as one."""


class ConfirmRefused(redis.exceptions.NoPermissionError):
    """Redis's ACL refused the user the PUBLISH or WAIT of a confirmation (its rule lacks the
    wait_replicas part of docs/security.md): the write itself went through. A NoPermissionError, so
    that it is taken for what only the operator can fix (ConfigurationError, a worker's exit 2)."""


#: The rules docs/security.md adds to the producer and worker users for wait_replicas: PUBLISH in
#: a selector of its own, to this channel alone (a worker's user may name RQ's command channels
#: too, for SUBSCRIBE, and a PUBLISH there would stop other workers).
ACL_RULES = f"+wait (+publish &{CHANNEL})"


@dataclass(frozen=True)
class Confirm:
    """How many replicas must confirm a write (0: none, nothing is sent) and how long to wait."""

    replicas: int = 0
    timeout_ms: int = 1000

    @classmethod
    def of(cls, settings: Settings) -> Confirm:
        return cls(settings.wait_replicas, settings.wait_replicas_ms)

    def queue(self, pipe: Any) -> None:
        """Queue the two commands that confirm every write made so far (none when replicas is 0)."""
        if self.replicas:
            pipe.publish(CHANNEL, b"")
            pipe.wait(self.replicas, self.timeout_ms)

    def check(self, replies: list[Any]) -> None:
        """Raise NotReplicated unless ``replies`` (those of :meth:`queue`'s commands) say enough
        replicas have the writes; ConfirmRefused for a command the ACL refused, and any other
        command Redis refused as it is."""
        if not self.replicas:
            return
        for reply in replies:
            if isinstance(reply, redis.exceptions.NoPermissionError):
                raise ConfirmRefused(
                    f"Redis refused this user the PUBLISH {CHANNEL} and WAIT that confirm each write on"
                    f" replicas (wait_replicas={self.replicas}): {redis_message(reply)}; add `{ACL_RULES}` to"
                    " its ACL rule (docs/security.md, 'ACL users'), or set wait_replicas to 0"
                ) from reply
            if isinstance(reply, Exception):
                raise reply
        acknowledged = int(replies[-1])
        if acknowledged < self.replicas:
            raise NotReplicated(
                f"{acknowledged} of {self.replicas} replica(s) confirmed the write within {self.timeout_ms} ms"
                " (wait_replicas): a failover could lose it"
            )


#: Nothing to confirm (wait_replicas 0).
NO_CONFIRM = Confirm()

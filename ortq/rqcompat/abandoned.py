"""Which of a queue's started jobs no live worker holds: the question the recovery of orphans asks
at every upkeep (ortq.worker.upkeep), answered from RQ's records without RQ's execution hashes.

A started entry's worker is known from its execution id, whose first hex digits are its worker's
tag (``execution_tag``), and its liveness from that worker's last heartbeat in its RQ worker hash.
"""

from __future__ import annotations

import hashlib
from typing import Any, cast

import redis

from ortq import keys
from ortq.rqcompat import layout
from ortq.rqcompat.layout import QueueKeys, utcnow
from ortq.rqcompat.startedscan import StartedScan
from ortq.rqjob import parse_rq_time

#: Workers of one queue that the recovery of orphans tells apart by their tags; past that, some
#: are known only by their jobs' execution hashes (Settings.rq_executions).
MAX_QUEUE_WORKERS = 10_000

#: Hex digits of an execution id that name its worker (``execution_tag``); the rest are random.
TAG_DIGITS = 12


def execution_tag(worker_name: str) -> str:
    """The first hex digits of every execution id a worker of this name makes: how the recovery
    of orphans finds which worker runs a started job with no execution hash to say so
    (Settings.rq_executions off, or the hash deleted). A worker restarted under its old name has
    its old tag: its earlier life's jobs are its own orphans."""
    return hashlib.blake2b(worker_name.encode(), digest_size=TAG_DIGITS // 2).hexdigest()


def queue_worker_keys(connection: redis.Redis, queue: QueueKeys, limit: int) -> list[str]:
    """Up to ``limit`` members of ``queue``'s RQ worker registration set (worker hash keys, as RQ
    writes them); nothing when the key holds another type, and no member longer than any worker
    key could be (anyone with write access may have added it)."""
    if keys.as_text(connection.type(queue.workers)) != "set":
        return []
    members = cast(list[bytes], connection.srandmember(queue.workers, limit) or [])
    return [keys.as_text(m) for m in members if len(m) <= 4096]


class Abandoned:
    """The started jobs of one queue whose worker is gone, as one worker (``worker_name``) sees them."""

    def __init__(self, connection: redis.Redis, queue: QueueKeys, worker_name: str) -> None:
        self.connection = connection
        self.queue = queue
        self.worker_name = worker_name
        self._scan = StartedScan(queue.started)

    def find(
        self, dead_after: float, own: bool, held: frozenset[str] = frozenset(), limit: int = 1000
    ) -> list[tuple[str, str, str]]:
        """(job id, execution id, worker name) of this queue's started jobs whose worker has sent
        no heartbeat for ``dead_after`` seconds (or whose records are gone). With ``own``, this
        worker's own entries count too, but for those it holds (``held``: execution ids): a
        started job of its own that it does not hold is one whose start reply was lost. At most
        ``limit`` entries are looked at per call, the next ones at the next call (StartedScan).

        A job's worker is the one of this queue's registered workers whose tag begins its
        execution id (``execution_tag``); failing that (a job started by an ortq from before
        tags), the one its execution hash names, where there is one."""
        if keys.as_text(self.connection.type(self.queue.started)) != "zset":
            return []
        parsed = self._scan.window(self.connection, limit)
        if not parsed:
            return []
        owners = self._owners(parsed)
        beats = self._last_heartbeats(sorted({w for w in owners if w is not None and w != self.worker_name}))
        now = utcnow()
        found = []
        for (job_id, execution), owner in zip(parsed, owners, strict=True):
            if owner == self.worker_name:
                if own and execution not in held:
                    found.append((job_id, execution, owner))
                continue
            beat = beats.get(owner) if owner else None
            last = parse_rq_time(beat if isinstance(beat, bytes) else None)
            if last is None or (now - last).total_seconds() > dead_after:
                found.append((job_id, execution, owner or "?"))
        return found

    def _owners(self, parsed: list[tuple[str, str]]) -> list[str | None]:
        """The worker of each started entry (job id, execution id): the one of this queue's
        registered workers (or this one) whose tag begins the execution id, else the one its
        execution hash names (one round trip for all of those); None where neither says."""
        tags = {execution_tag(name): name for name in [self.worker_name, *self._queue_workers()]}
        owners: list[str | None] = [tags.get(execution[:TAG_DIGITS]) for _, execution in parsed]
        untagged = [i for i, owner in enumerate(owners) if owner is None]
        if untagged:
            with self.connection.pipeline(transaction=False) as pipe:
                for i in untagged:
                    pipe.hget(layout.execution_key(*parsed[i]), "worker_name")
                for i, name in zip(untagged, pipe.execute(raise_on_error=False), strict=True):
                    owners[i] = keys.as_text(name) if isinstance(name, bytes) else None
        return owners

    def _last_heartbeats(self, names: list[str]) -> dict[str, Any]:
        """Each named worker's ``last_heartbeat`` field as Redis returns it (None for a worker hash
        that is gone, an exception for one of another type), in one round trip."""
        with self.connection.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hget(layout.worker_key(name), "last_heartbeat")
            return dict(zip(names, pipe.execute(raise_on_error=False), strict=True))

    def _queue_workers(self) -> list[str]:
        """Names of the workers in this queue's RQ registration set (at most ``MAX_QUEUE_WORKERS``)."""
        prefix = layout.worker_key("")
        members = queue_worker_keys(self.connection, self.queue, MAX_QUEUE_WORKERS)
        return [member[len(prefix) :] for member in members if member.startswith(prefix)]

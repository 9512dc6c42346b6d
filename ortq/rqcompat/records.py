"""What makes an ortq worker an RQ worker to every RQ tool: its worker hash and registration sets
(``rq info``, ``Worker.all``, rq-dashboard), its heartbeats (of the worker and of the jobs it
runs), its state, and its death. The same writes as RQ's ``register_birth``, ``heartbeat``,
``maintain_heartbeats`` and ``register_death``, through plain commands (these keys are the
worker's own: no producer may write them under docs/security.md's ACL rules)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from ortq import keys
from ortq.errors import ConfigurationError
from ortq.rqcompat import layout
from ortq.rqcompat.abandoned import queue_worker_keys
from ortq.rqcompat.book import StartedJob
from ortq.rqcompat.layout import utcformat, utcnow

log = logging.getLogger("ortq.worker")


@dataclass(frozen=True)
class BeatPositions:
    """Where a heartbeat's replies are among its pipeline's results (``queue_heartbeat``)."""

    worker: int  # the worker hash's HSET of last_heartbeat (then its HEXISTS of birth)
    job_hashes: tuple[int, ...]  # each running job's HSET of last_heartbeat, in order
    sets: int  # the first of the two SADDs to RQ's sets of workers


class WorkerRecords:
    """RQ's records of one worker on one queue; with ``executions`` (Settings.rq_executions), its
    jobs' execution records are among them."""

    def __init__(
        self, name: str, queue_name: str, ttl: int = layout.DEFAULT_WORKER_TTL, executions: bool = True
    ) -> None:
        self.name = name
        self.executions = executions
        self.queue = layout.QueueKeys.of(queue_name)
        self.key = layout.worker_key(name)
        self.executions_key = layout.worker_executions_key(name)
        #: Seconds the worker hash lives past each heartbeat (RQ's worker_ttl + 60).
        self.ttl = ttl + 60
        self._birth = utcnow()
        self.ip_address = "unknown"

    def _birth_fields(self) -> dict[Any, Any]:  # redis-py's hset wants its own key union
        fields: dict[Any, Any] = layout.worker_birth_fields(self._birth, [self.queue.name])
        fields["ip_address"] = self.ip_address
        return fields

    def register_birth(self, connection: redis.Redis) -> None:
        """RQ's ``register_birth``; refuses a name an active worker already has."""
        kind = keys.as_text(connection.type(self.key))
        if kind == "hash" and not connection.hexists(self.key, "death"):
            raise ConfigurationError(f"there is an active worker named {self.name!r} already (RQ's {self.key})")
        self.ip_address = _own_address(connection, self.name)
        self._birth = utcnow()
        with connection.pipeline() as pipe:
            pipe.delete(self.key)
            pipe.hset(self.key, mapping=self._birth_fields())
            pipe.expire(self.key, self.ttl)
            pipe.execute()
        self.register(connection)

    def register(self, connection: redis.Redis) -> None:
        """RQ's ``worker_registration.register``: the worker in RQ's sets of workers. A set that is
        no set (written by someone else) would hide every worker from RQ's tools: it is replaced."""
        sets = (layout.workers_key(), self.queue.workers)
        with connection.pipeline(transaction=False) as pipe:
            for key in sets:
                pipe.sadd(key, self.key)
            results = pipe.execute(raise_on_error=False)
        for key, result in zip(sets, results, strict=True):
            if isinstance(result, redis.ResponseError):
                log.error("%s was no set (%s); replacing it", key, result)
                with connection.pipeline() as pipe:
                    pipe.delete(key)
                    pipe.sadd(key, self.key)
                    pipe.execute()

    def set_state(self, client: Any, state: str) -> None:
        """RQ's ``set_state``; going idle also ends RQ 2's ``current_job``."""
        client.hset(self.key, "state", state)
        if state == "idle" and not layout.RQ3:
            client.hdel(self.key, "current_job")

    def queue_heartbeat(self, pipe: Any, running: Sequence[StartedJob]) -> BeatPositions:
        """Queue on ``pipe`` RQ's heartbeat of the worker and of each running job (its started
        registry entry, its ``last_heartbeat``; with ``executions``, its execution records are
        written beside by ``Book.record_executions``), and the worker's place in RQ's sets of
        workers (no-ops, unless someone removed it); returns where the replies ``after_heartbeat``
        reads will be."""
        moment = utcnow()
        stamp = utcformat(moment)
        worker = len(pipe)
        job_hashes = []
        pipe.hset(self.key, "last_heartbeat", stamp)
        # A hash without its birth was made by a script's HSET of state after the worker's hash had
        # gone (a Redis that restarted empty, an expiry): RQ's tools would show it without a state.
        pipe.hexists(self.key, "birth")
        pipe.expire(self.key, self.ttl)
        if layout.RQ3 and self.executions:
            pipe.expire(self.executions_key, self.ttl)
        for job in running:
            composite = f"{job.job_id}:{job.execution_id}"
            deadline = int(moment.timestamp()) + job.ttl
            pipe.zadd(self.queue.started, {composite: deadline}, xx=True)
            job_hashes.append(len(pipe))
            pipe.hset(layout.job_key(job.job_id), "last_heartbeat", stamp)
        sets = len(pipe)
        pipe.sadd(layout.workers_key(), self.key)
        pipe.sadd(self.queue.workers, self.key)
        return BeatPositions(worker, tuple(job_hashes), sets)

    def after_heartbeat(
        self,
        connection: redis.Redis,
        results: Sequence[Any],
        at: BeatPositions,
        running: Sequence[StartedJob],
        state: str | None = None,
    ) -> None:
        """What RQ's ``maintain_heartbeats`` does after its pipeline: an HSET that created a hash
        means the hash had expired or been deleted. A job's hash made that way is deleted again;
        the worker's own is written whole again, with its TTL and ``state`` (the worker's now),
        also where a script had made it again with only its state."""
        stale_jobs = [job.job_id for job, i in zip(running, at.job_hashes, strict=True) if results[i] == 1]
        # An error: the worker's key holds something else (written by someone else): it is replaced.
        created, born = results[at.worker], results[at.worker + 1]
        recreated = created == 1 or born == 0 or isinstance(created, Exception)
        if any(isinstance(r, Exception) for r in results[at.sets : at.sets + 2]):
            self.register(connection)  # replaces a set of the wrong type
        if not stale_jobs and not recreated:
            return
        with connection.pipeline() as pipe:
            for job_id in stale_jobs:
                pipe.delete(layout.job_key(job_id))
            if recreated:
                pipe.delete(self.key)
                pipe.hset(self.key, mapping=self._birth_fields())
                pipe.hset(self.key, "last_heartbeat", utcformat(utcnow()))
                if state is not None:
                    pipe.hset(self.key, "state", state)
                pipe.expire(self.key, self.ttl)
            pipe.execute()
        if recreated:
            self.register(connection)

    def register_death(self, connection: redis.Redis) -> None:
        """RQ's ``register_death``: out of the registration sets, a ``death`` time, gone in 60 s."""
        with connection.pipeline(transaction=False) as pipe:
            pipe.srem(layout.workers_key(), self.key)
            pipe.srem(self.queue.workers, self.key)
            pipe.hset(self.key, "death", utcformat(utcnow()))
            pipe.expire(self.key, 60)
            if layout.RQ3:  # also after a life with rq_executions on under the same name
                pipe.delete(self.executions_key)
            pipe.execute(raise_on_error=False)  # a registration set of the wrong type changes nothing here


def _own_address(connection: redis.Redis, name: str) -> str:
    """The worker's address as Redis sees it, as RQ records it (``CLIENT SETNAME`` then ``CLIENT
    INFO``); ``unknown`` where the ACL denies either, as RQ falls back."""
    try:
        connection.client_setname(name)
        return str(connection.client_info()["addr"])
    except (redis.ResponseError, KeyError):
        return "unknown"


def prune_workers(connection: redis.Redis, queue_name: str, limit: int = 200) -> int:
    """Remove from RQ's registration sets the workers of this queue whose hash is gone (killed
    workers that could not unregister), as RQ's ``clean_worker_registry``; at most ``limit`` names
    looked at per call. Returns how many were removed."""
    queue = layout.QueueKeys.of(queue_name)
    members = queue_worker_keys(connection, queue, limit)
    if not members:
        return 0
    with connection.pipeline(transaction=False) as pipe:
        for member in members:
            pipe.exists(member)
        alive = pipe.execute()
    gone = [m for m, exists in zip(members, alive, strict=True) if not exists]
    if gone:
        with connection.pipeline() as pipe:
            pipe.srem(queue.workers, *gone)
            pipe.srem(layout.workers_key(), *gone)
            pipe.execute()
    return len(gone)

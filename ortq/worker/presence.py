"""What a worker shows of itself in Redis while it lives: RQ's worker records (ortq.rqcompat) and
ortq's own (``ortq:worker:<name>``, ``ortq:workers``, the model's signature), with its state and the
jobs it holds, refreshed by each heartbeat and removed when it stops.

The worker's threads say what they hold (its ``ledger``: ortq.worker.ownership) and what the worker
is doing (``set_state``); the heartbeat thread publishes it (``heartbeat``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import redis

from ortq import keys, redisfaults, redisfunctions
from ortq.control import worker_records
from ortq.errors import WireFormatError
from ortq.rqcompat import layout
from ortq.rqcompat.book import StartedJob
from ortq.rqcompat.records import WorkerRecords
from ortq.settings import Settings
from ortq.signature import ModelSignature
from ortq.worker.identity import WorkerIdentity
from ortq.worker.ownership import Ledger

log = logging.getLogger("ortq.worker")

#: The job hash field by which a job's stop is requested (written by redisfunctions.STOP_FUNCTION).
STOP_FIELD = redisfunctions.STOP_FIELD

#: What a heartbeat read of the stop marks gives: each marked held job's id and its mark.
StopMarks = dict[str, bytes | None]


class Presence:
    """One worker's records, and the state and started jobs they show."""

    def __init__(
        self, name: str, queue_name: str, identity: WorkerIdentity, signature: ModelSignature, settings: Settings
    ) -> None:
        self.name = name
        self.queue_name = queue_name
        self.identity = identity
        self.signature = signature
        self.settings = settings
        self.records = WorkerRecords(name, queue_name, executions=settings.rq_executions)
        self.state = "started"
        record = {
            "model": identity.model,
            "protocol": keys.PROTOCOL,
            "version": identity.version,
            "digest": signature.digest,
            "max_frame_bytes": settings.max_frame_bytes,  # what a producer may send this worker
            **signature.to_json(),
        }
        self._signature_json = json.dumps(record)
        #: The jobs the worker holds (started, not yet answered, handed on or released).
        self.ledger = Ledger()
        #: Held by the feeder from sending a start script until its jobs are held, and by the
        #: replier (when free: it never waits for a start) from finding that an answer leaves the
        #: worker idle until it has written "idle": so "idle" never lands after a start's "busy"
        #: (start.lua writes that one).
        self.starting = threading.Lock()
        #: Held jobs whose stop mark was found to be no stop token (said once a job).
        self._refused_marks: set[str] = set()

    # ------------------------------------------------------------------ the worker threads' side

    def hold(self, jobs: Sequence[StartedJob]) -> None:
        """The worker has started ``jobs``: heartbeats keep their records fresh until they leave."""
        self.ledger.hold(jobs)
        self.state = "busy"  # start.lua wrote it

    def set_state(self, connection: redis.Redis, state: str, force: bool = False) -> None:
        """RQ's worker state, written when it changes (``force``: when scripts may have changed it)."""
        if state == self.state and not force:
            return
        self.state = state
        try:
            self.records.set_state(connection, state)
        except redis.ResponseError as exc:  # the worker's hash replaced by something else: the next
            log.error("setting the worker's state failed: %s", exc)  # heartbeat writes it again

    # ------------------------------------------------------------------ the heartbeat thread's side

    def record(self) -> dict[str, Any]:
        """ortq's record of this worker (``ortq:worker:<name>``). ``held_job``: one job it held at
        this heartbeat, for ``ortq info`` where RQ's records do not say (Settings.rq_executions off)."""
        ident = self.identity
        held = self.ledger.first()
        return {
            "name": self.name,
            "model": ident.model,
            "model_path": ident.model_path,
            "provider": ident.provider,
            "device_id": ident.device_id,
            "fell_back_to_cpu": ident.fell_back_to_cpu,
            "host": ident.host,
            "pid": ident.pid,
            "queue": self.queue_name,
            "state": self.state,
            "held_job": held.job_id if held is not None else None,
            "version": ident.version,
            "signature": self.signature.to_json(),
            "signature_digest": self.signature.digest,
            **ident.extra,
        }

    def heartbeat(self, connection: redis.Redis) -> StopMarks:
        """RQ's heartbeat of the worker and of the jobs it holds, and ortq's records; one round
        trip (two when a held job is marked). A record of the wrong type (written by someone else)
        is written again. Returns the held jobs whose hash has a stop mark of a stop token's length
        (``ortq_stop``: ortq.worker.stops checks it against the job's own token), with their marks."""
        running = self.ledger.jobs()
        with connection.pipeline(transaction=False) as pipe:
            asked = len(pipe)
            _queue_stop_reads(pipe, running)
            positions = self.records.queue_heartbeat(pipe, running)
            pipe.set(keys.worker_key(self.name), json.dumps(self.record()), ex=self.records.ttl)
            registered = len(pipe)
            pipe.sadd(keys.WORKERS_SET, self.name)
            self._queue_signatures(pipe, current=False)
            pipe.type(keys.signature_key(self.identity.model))
            results = pipe.execute(raise_on_error=False)
        self.records.after_heartbeat(connection, results, positions, running, self.state)
        replies = results[asked : asked + len(running)]
        stops = self._marks(connection, running, replies)
        if results[-1] not in (b"string", "string"):  # another type there: the NX write cannot replace it
            log.error("%s held no string; replacing it", keys.signature_key(self.identity.model))
            connection.set(keys.signature_key(self.identity.model), self._signature_json, ex=self.settings.request_ttl)
        _repair_set(connection, keys.WORKERS_SET, [self.name], results[registered])
        _repair_set(connection, keys.SIGNATURES_SET, self._signature_names, results[-2])  # _queue_signatures' last
        return stops

    def requested_stops(self, connection: redis.Redis, held_for: float) -> StopMarks:
        """The held jobs, held ``held_for`` seconds or more, that are marked to stop, with their
        marks (one HSTRLEN a job in one round trip, one more for the marked; none when no job was
        held that long)."""
        since = layout.utcnow() - timedelta(seconds=held_for)
        running = [job for job in self.ledger.jobs() if job.started_at <= since]
        if not running:
            return {}
        with connection.pipeline(transaction=False) as pipe:
            _queue_stop_reads(pipe, running)
            lengths = pipe.execute(raise_on_error=False)
        return self._marks(connection, running, lengths)

    def _marks(self, connection: redis.Redis, jobs: Sequence[StartedJob], lengths: Sequence[object]) -> StopMarks:
        """The marks of ``jobs`` whose mark has a stop token's length (``lengths``: the replies to
        :func:`_queue_stop_reads`), read in one round trip. A mark of another length is no job's
        token: said once a job, and never read (its value may be hundreds of MB)."""
        marked = []
        for job, length in zip(jobs, lengths, strict=True):
            if not isinstance(length, int) or length == 0:
                continue  # no mark (an error in place of one, a job key of another type: none either)
            if length == redisfunctions.STOP_TOKEN_LENGTH:
                marked.append(job.job_id)
            elif job.job_id not in self._refused_marks:
                self._refused_marks.add(job.job_id)
                log.warning(
                    "job %s has a stop mark (%s) of %d bytes, no stop token: ignored, the job runs (only its "
                    "producer's token stops it)",
                    job.job_id,
                    STOP_FIELD,
                    length,
                )
        self._refused_marks &= {job.job_id for job in jobs}  # those of jobs that left are forgotten
        if not marked:
            return {}
        with connection.pipeline(transaction=False) as pipe:
            for job_id in marked:
                pipe.hget(keys.job_key(job_id), STOP_FIELD)
            values = pipe.execute(raise_on_error=False)
        return {job_id: value for job_id, value in zip(marked, values, strict=True) if isinstance(value, bytes)}

    # ------------------------------------------------------------------ both ends

    def _queue_signatures(self, pipe: redis.client.Pipeline, current: bool) -> None:
        """The signature records: this version's, and the model's current one. That one is the
        version of the worker that started last (``current``: this one is starting); a heartbeat
        only writes it where it is gone (NX) and keeps it alive, whichever version wrote it."""
        model, ttl = self.identity.model, self.settings.request_ttl
        pipe.set(keys.signature_key(model, self.identity.version), self._signature_json, ex=ttl)
        pipe.set(keys.signature_key(model), self._signature_json, ex=ttl, nx=not current)
        pipe.expire(keys.signature_key(model), ttl)
        pipe.sadd(keys.SIGNATURES_SET, *self._signature_names)  # last: its reply is checked

    @property
    def _signature_names(self) -> list[str]:
        """This worker's members of keys.SIGNATURES_SET: its model's current record and its version's."""
        return [self.identity.model, f"{self.identity.model}@{self.identity.version}"]

    def register(self, connection: redis.Redis) -> None:
        """RQ's birth of the worker, and the model's current signature made this worker's (ortq's
        other records follow with the first heartbeat)."""
        self.records.register_birth(connection)
        with connection.pipeline(transaction=False) as pipe:
            self._queue_signatures(pipe, current=True)
            *written, added = pipe.execute(raise_on_error=False)
        for reply in written:  # SET and EXPIRE take a key of any type: an error here is a refusal
            if isinstance(reply, Exception):
                raise reply
        _repair_set(connection, keys.SIGNATURES_SET, self._signature_names, added)
        try:
            pruned = prune_signatures(connection)
        except redis.RedisError as exc:  # housekeeping: the next worker to start tries again
            log.warning("could not prune %s (%s)", keys.SIGNATURES_SET, exc)
        else:
            if pruned:
                log.info("%d member(s) of %s named no signature record: removed", pruned, keys.SIGNATURES_SET)

    def unregister(self, connection: redis.Redis) -> None:
        """RQ's death of the worker, and ortq's records gone; left to expire if Redis refuses."""
        try:
            self.records.register_death(connection)
            with connection.pipeline(transaction=False) as pipe:
                pipe.delete(keys.worker_key(self.name))
                pipe.srem(keys.WORKERS_SET, self.name)
                pipe.execute()
        except redis.RedisError as exc:
            log.warning("could not unregister (%s); the records expire by themselves", exc)
            return
        try:
            self._hand_on_current(connection)
        except redis.RedisError as exc:  # housekeeping: the next worker to start writes it again
            log.warning("could not hand the model's current signature record on (%s)", exc)

    def _hand_on_current(self, connection: redis.Redis) -> None:
        """The model's current signature record is a live worker's: where it names this worker's
        version and no other live worker serves that version, it becomes the record of a version a
        live worker serves (a producer that pins to the current version would otherwise pin to one
        nobody serves). With no live worker of the model left it stays: a job enqueued meanwhile
        waits for the next worker. (A worker killed outright does not get here: its version stays
        current until another worker starts.)"""
        model, mine = self.identity.model, self.identity.version
        current = connection.getrange(keys.signature_key(model), 0, CURRENT_RECORD_BYTES)
        if not isinstance(current, bytes) or len(current) > CURRENT_RECORD_BYTES:
            return
        try:
            if ModelSignature.loads(current).version != mine:
                return
        except WireFormatError:
            return  # not a record this worker wrote: its next writer replaces it
        served = {
            r["version"]
            for _, r in worker_records(connection, by_get=True)
            if r is not None and r.get("model") == model and isinstance(r.get("version"), str)
        }
        if mine in served or not served:
            return
        other = min(served)
        record = connection.getrange(keys.signature_key(model, other), 0, CURRENT_RECORD_BYTES)
        if isinstance(record, bytes) and 0 < len(record) <= CURRENT_RECORD_BYTES:
            connection.set(keys.signature_key(model), record, ex=self.settings.request_ttl)
            log.info("model %r's current version is now %s, one a live worker serves", model, other)


#: The most of a signature record read when handing the current one on (a record is ~1 KB a tensor).
CURRENT_RECORD_BYTES = 64 * 1024


#: Members of keys.SIGNATURES_SET that a starting worker checks at most, chosen at random: a bound
#: on one start's work whatever the set holds (anyone with write access could fill it).
PRUNE_AT_MOST = 1000


def prune_signatures(connection: redis.Redis) -> int:
    """Remove from keys.SIGNATURES_SET the members whose signature record is gone: the record of a
    version no worker serves any more expires, and the set would otherwise keep one member for every
    version ever served. Safe beside live workers: each writes its record before its member and
    adds both again at every heartbeat. Returns how many members were removed."""
    if keys.as_text(connection.type(keys.SIGNATURES_SET)) != "set":
        return 0
    members = cast(list[bytes], connection.srandmember(keys.SIGNATURES_SET, PRUNE_AT_MOST) or [])
    prefix = keys.signature_key("").encode()
    with connection.pipeline(transaction=False) as pipe:
        for member in members:
            pipe.exists(prefix + member)
        found = pipe.execute()
    gone = [member for member, count in zip(members, found, strict=True) if count == 0]
    return int(connection.srem(keys.SIGNATURES_SET, *gone)) if gone else 0


def _queue_stop_reads(pipe: redis.client.Pipeline, jobs: Sequence[StartedJob]) -> None:
    """Whether each job is marked to stop: the length of its STOP_FIELD, not its value (a value
    anyone with write access made hundreds of MB is never sent; an empty one asks nothing)."""
    for job in jobs:
        pipe.hstrlen(keys.job_key(job.job_id), STOP_FIELD)


def _repair_set(connection: redis.Redis, key: str, members: list[str], reply: object) -> None:
    """Where ``reply`` (an SADD's to ``key``) says ``key`` holds another type (written by someone
    else), replace it with a set of ``members``; any other error it says is raised."""
    if not isinstance(reply, Exception):
        return
    if not redisfaults.is_wrong_type(reply):
        raise reply
    log.error("%s was no set (%s); replacing it", key, reply)
    with connection.pipeline() as pipe:
        pipe.delete(key)
        pipe.sadd(key, *members)
        pipe.execute()

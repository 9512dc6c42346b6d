"""The Redis commands that enqueue and cancel ortq jobs, exactly as docs/wire-format.md lists
them, and what their replies mean, with no I/O of their own (the steps of ``submitting`` and
``cancelling`` queue them; ``Producer`` and ``AsyncProducer`` send them); job handles, and what
a response means for one (``responses`` reads it).

A producer writes RQ's job hash and queue entry itself (rather than through
``rq.Queue.enqueue``), so that what ortq sends is small, fixed and documented, and so that
the request frame goes in the same MULTI/EXEC as the job that points to it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar
from uuid import uuid4

import redis

from ortq import keys, redisfaults, redisfunctions, wire
from ortq.errors import (
    ConfigurationError,
    CorruptRecord,
    InferenceFailed,
    JobExists,
    JobNotFound,
    OrtqError,
    VersionMismatch,
)
from ortq.rqcompat import layout
from ortq.serializer import MsgpackSerializer
from ortq.settings import frame_argument

#: The longest ttl, job_timeout or retry interval a job hash holds: a year, the most a worker takes
#: from one (``ortq.rqjob.MAX_SECONDS``; a test keeps the two equal).
MAX_SECONDS = 365 * 24 * 3600

P = TypeVar("P")
H = TypeVar("H")


class JobHandle(Generic[P]):
    """What every job handle holds: its producer, its id and model, and the random bytes its
    request carried, from which its response's proof is made (None: not checked, for a handle on a
    job submitted elsewhere)."""

    def __init__(
        self,
        producer: P,
        job_id: str,
        model: str,
        nonce: bytes | None = None,
        signature: str | None = None,
        version: str | None = None,
    ) -> None:
        self.producer = producer
        self.id = job_id
        self.model = model
        self.nonce = nonce
        #: The proof its response must carry (wire.proof_of), or None when it is not checked.
        self.proof = None if nonce is None else wire.proof_of(model, nonce)
        #: The digest of the signature its inputs were checked against (None: not checked): only a
        #: version of the model with that signature may answer it.
        self.signature = signature
        #: The version it is pinned to (None: whichever version takes it).
        self.version = version

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, model={self.model!r})"


#: Job priorities. High-priority jobs go ahead of every normal one in the model's one RQ queue
#: (so RQ's registries and views stay whole), first come first served among themselves.
PRIORITIES = ("normal", "high")


@dataclass(frozen=True)
class JobOptions:
    """Per-job settings that travel in RQ's job hash."""

    request_ttl: int
    result_ttl: int
    failure_ttl: int
    ttl: int | None = None  # seconds the job may wait in the queue before it is dropped
    job_timeout: int | None = None  # seconds a run may take (RQ's "timeout" field)
    retries: int = 0  # how many times a run that fails (other than for bad input) is tried again
    retry_backoff: int = 0  # seconds before the first retry, doubling for each next one; 0: at once
    priority: str = "normal"  # one of PRIORITIES
    version: str | None = None  # the model version it is pinned to (None: any)
    reply: str = ""  # the name of the reply stream its producer reads (keys.new_reply_name)

    @property
    def wait_ttl(self) -> int:
        """Seconds the job and its request frame wait for a worker at most."""
        return self.request_ttl if self.ttl is None else min(self.request_ttl, self.ttl)


class SubmitOptions(TypedDict, total=False):
    """The per-job options of ``submit`` (see Producer.submit), which ``infer`` passes on."""

    ttl: float | None
    job_timeout: float | None
    retries: int
    retry_backoff: float
    priority: str
    version: str | None


def new_nonce() -> bytes:
    """The random bytes a request carries (wire ``options.nonce``), which the producer alone knows
    once the request is in Redis: its response's proof is made from them (wire.proof_of)."""
    return os.urandom(16)


def new_nonces(count: int) -> list[bytes]:
    """``count`` nonces (:func:`new_nonce`), from one read of the system's randomness."""
    raw = os.urandom(16 * count)
    return [raw[at : at + 16] for at in range(0, len(raw), 16)]


#: What makes 128 random bits a version-4 UUID (RFC 4122 variant), as ``uuid.UUID(version=4)`` sets them.
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET = (4 << 76) | (0x8000 << 48)


def new_job_ids(count: int) -> list[str]:
    """``count`` new job ids: random version-4 UUIDs, written as ``str(uuid.uuid4())`` writes them (in
    about half its time: a submit_many makes one a job)."""
    ids = []
    for _ in range(count):
        h = f"{int.from_bytes(os.urandom(16)) & _UUID4_CLEAR | _UUID4_SET:032x}"
        ids.append(f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    return ids


def job_hash(model: str, options: JobOptions, now: str) -> dict[str, Any]:
    """The RQ job hash fields ortq writes for a queued job."""
    fields: dict[str, Any] = {
        "status": "queued",
        "origin": keys.queue_name(model),
        "data": MsgpackSerializer.dumps([keys.JOB_FUNC, None, [model], {}]),
        "description": f"{keys.JOB_FUNC}({model!r})",
        "created_at": now,
        "enqueued_at": now,
        "result_ttl": options.result_ttl,
        "failure_ttl": options.failure_ttl,
    }
    if options.reply:
        fields["ortq_reply"] = options.reply
    if options.ttl is not None:
        fields["ttl"] = options.ttl
    if options.priority != "normal":
        fields["ortq_priority"] = options.priority
    if options.version is not None:
        fields["ortq_version"] = options.version
    if options.job_timeout is not None:
        fields["timeout"] = options.job_timeout
    if options.retries:
        # RQ's own retry fields: the worker requeues (or schedules) the job as RQ would.
        fields["retries_left"] = options.retries
        if options.retry_backoff:
            intervals = [min(options.retry_backoff * 2**i, MAX_SECONDS) for i in range(options.retries)]
            fields["retry_intervals"] = json.dumps(intervals)
    return fields


def add_enqueue(
    pipe: Any, model: str, frame: bytes, options: JobOptions, job_id: str | None = None, by_eval: bool = False
) -> str:
    """Queue the commands that enqueue one job on ``pipe`` (a MULTI); returns the job id
    (:func:`add_enqueues` of one job)."""
    job_id = job_id or str(uuid4())
    add_enqueues(pipe, model, [frame], options, [job_id], by_eval)
    return job_id


#: The most ids one RPUSH of a batch carries: a larger batch's go in several RPUSHes, in order, so
#: that no command's argument list grows with the batch.
PUSH_CHUNK = 1000


def add_enqueues(
    pipe: Any, model: str, frames: list[bytes], options: JobOptions, ids: list[str], by_eval: bool = False
) -> None:
    """Queue the commands that enqueue the jobs ``ids`` (one a frame of ``frames``) on ``pipe`` (a
    MULTI), as docs/wire-format.md lists them: for each job its request frame's SET, its hash's HSET
    and EXPIRE (and, high-priority, the FCALL that puts it on its queue); then one SADD of RQ's queue
    registry and, normal-priority, one RPUSH of all the ids in order (:data:`PUSH_CHUNK` a command).
    :func:`enqueue_errors` reads the replies of that layout.

    The job hash always expires (``wait_ttl + failure_ttl``) until a worker starts the job, so
    that a job nobody takes (a queue deleted, a model never served) leaves nothing behind; a
    worker that finds it past its ttl still has failure_ttl to fail it with a reason.
    ``by_eval``: a high-priority job goes in by EVAL instead of FCALL (a Redis without functions).
    The jobs of one MULTI go in at one moment, and their hashes have one ``created_at``.
    """
    wait = options.wait_ttl
    lives = wait + options.failure_ttl
    queue = keys.queue_key(model)
    fields = [part for pair in job_hash(model, options, layout.utcformat(layout.utcnow())).items() for part in pair]
    high = options.priority == "high"
    send = pipe.execute_command  # SET, HSET, EXPIRE as redis-py's set(ex=), hset(mapping=), expire() send them
    for frame, job_id in zip(frames, ids, strict=True):
        job = keys.job_key(job_id)
        send("SET", keys.request_key(model, job_id), frame_argument(frame), "EX", wait)
        send("HSET", job, *fields)
        send("EXPIRE", job, lives)
        if high and by_eval:
            add_enqueue_high_by_eval(pipe, model, job_id, options)
        elif high:
            pipe.fcall(redisfunctions.FUNCTION, 2, queue, keys.last_high_key(model), job_id, wait)
    send("SADD", keys.RQ_QUEUES_SET, queue)
    if not high:
        for at in range(0, len(ids), PUSH_CHUNK):
            send("RPUSH", queue, *ids[at : at + PUSH_CHUNK])


#: Commands add_enqueues queues per job (high priority: one more, its FCALL or EVAL), before the
#: batch's SADD (which may fail without harm: the jobs are queued without it) and RPUSHes.
COMMANDS_PER_JOB = 3


def enqueue_errors(results: list[Any], count: int, options: JobOptions) -> list[tuple[int, Exception]]:
    """(job index, error) for every job whose enqueue commands failed in the EXEC replies of
    :func:`add_enqueues` of ``count`` jobs, by job: a failed RPUSH fails every job it carried."""
    per_job = COMMANDS_PER_JOB + (options.priority == "high")
    own = count * per_job
    failed = [(i // per_job, reply) for i, reply in enumerate(results[:own]) if isinstance(reply, Exception)]
    for chunk, reply in enumerate(results[own + 1 :]):
        if isinstance(reply, Exception):
            failed += [(i, reply) for i in range(chunk * PUSH_CHUNK, min(count, (chunk + 1) * PUSH_CHUNK))]
    failed.sort(key=lambda found: found[0])  # stable: a job's own commands' errors before its RPUSH's
    return failed


#: What a BrokerUnavailable of an enqueue adds: EXEC may have run before the connection dropped.
MAYBE_ENQUEUED = "if the connection dropped during the write they may have been enqueued"


def split_failures(
    results: list[Any], ids: list[str], options: JobOptions
) -> tuple[list[str], list[tuple[str, Exception]]]:
    """From the EXEC replies of an enqueue of ``ids`` (:func:`add_enqueues`): the jobs whose high-priority
    FCALL alone failed, for want of ortq's Redis function (enqueue them by EVAL instead, in this order),
    and (id, error) for every other job that failed (delete what went in of them, then raise
    :func:`enqueue_failure`)."""
    errors: dict[str, list[Exception]] = {}
    for index, exc in enqueue_errors(results, len(ids), options):
        errors.setdefault(ids[index], []).append(exc)
    by_eval = [job_id for job_id, found in errors.items() if all(is_missing_function(e) for e in found)]
    broken = [
        (job_id, next(e for e in found if not is_missing_function(e)))
        for job_id, found in errors.items()
        if job_id not in by_eval
    ]
    return by_eval, broken


def enqueue_failure(model: str, broken: list[tuple[str, Exception]], total: int) -> OrtqError:
    """The error for an enqueue some of whose jobs Redis refused (what went in of them was deleted)."""
    exc = broken[0][1]
    doing = f"could not enqueue {len(broken)} of {total} job(s) for {model!r} (nothing of them was left in Redis)"
    if isinstance(exc, redis.RedisError) and not redisfaults.is_wrong_type(exc):
        return redisfaults.failure(exc, doing)
    return CorruptRecord(f"{doing}: {exc}; a key of this model's queue holds something ortq did not write")


def is_refused_fcall(exc: Exception, options: JobOptions) -> bool:
    """Redis refused a high-priority MULTI as a whole because it has no FCALL at all (before 7.0):
    it discards the transaction (EXECABORT) when an unknown command is queued, so nothing of it
    went in, and the same MULTI is sent again with EVAL in the FCALL's place."""
    return options.priority == "high" and isinstance(exc, redis.ResponseError) and is_missing_function(exc)


def is_missing_function(exc: Exception) -> bool:
    """FCALL of ortq's function failed because this Redis lacks it (no worker loaded it yet,
    or Redis < 7 has no functions at all)."""
    text = str(exc).lower()
    return "function not found" in text or "unknown command" in text


def add_enqueue_high_by_eval(pipe: Any, model: str, job_id: str, options: JobOptions) -> None:
    """The fallback of the FCALL: the same code by EVAL (needs the ACL's +eval)."""
    pipe.eval(
        redisfunctions.script_source(), 2, keys.queue_key(model), keys.last_high_key(model), job_id, options.wait_ttl
    )


def add_enqueue_unique(
    pipe: Any, model: str, frame: bytes, options: JobOptions, job_id: str, by_eval: bool = False, now: str | None = None
) -> None:
    """Queue the enqueue of one job under the id its producer chose, unless a job of that id exists
    (redisfunctions.UNIQUE_FUNCTION, enqueue_unique.lua): its reply is 1 (enqueued), 0 (this model's job
    of that id exists) or -1 (another model's, or no job hash). ``by_eval``: by EVAL, not FCALL.
    ``now``: the job's ``created_at`` (RQ's format; default: now), by which a submit knows its own
    job after a lost reply (ortq.producer.submitting)."""
    wait = options.wait_ttl
    fields = job_hash(model, options, now or layout.utcformat(layout.utcnow()))
    names = [keys.job_key(job_id), keys.queue_key(model), keys.last_high_key(model)]
    args = [job_id, frame_argument(frame), wait, wait + options.failure_ttl, options.priority, keys.queue_name(model)]
    args += [keys.request_key(model, job_id), keys.RQ_QUEUES_SET]
    args += [part for pair in fields.items() for part in pair]
    if by_eval:
        pipe.eval(redisfunctions.unique_script_source(), len(names), *names, *args)
    else:
        pipe.fcall(redisfunctions.UNIQUE_FUNCTION, len(names), *names, *args)


def check_job_ids(job_ids: Iterable[object], count: int) -> list[str]:
    """The ids a producer chose for ``count`` jobs: each as RQ's ids are (letters, digits, ``_``,
    ``-``; at most 128), none twice; ConfigurationError otherwise."""
    ids = list(job_ids)
    if len(ids) != count:
        raise ConfigurationError(f"job_ids: {len(ids)} ids for {count} jobs")
    for job_id in ids:
        if not isinstance(job_id, str) or len(job_id) > 128 or not layout.JOB_ID.fullmatch(job_id):
            raise ConfigurationError(
                f"job id {str(job_id)[:80]!r}: use 1-128 characters from A-Z a-z 0-9 _ - (RQ's job ids)"
            )
    if len(set(ids)) != len(ids):
        raise ConfigurationError("job_ids: an id is given twice")
    return [str(job_id) for job_id in ids]


def unique_outcome(model: str, ids: list[str], results: list[Any], unique: bool) -> tuple[list[bool], str | None]:
    """From the replies of :func:`add_enqueue_unique` for ``ids``: whether each was enqueued (False:
    its model's job of that id exists, returned as it is when ``unique``), and why the submit is
    refused (None: it is not): an id of another model's job, or one that exists without ``unique``."""
    for job_id, reply in zip(ids, results, strict=True):
        if isinstance(reply, Exception):
            if isinstance(reply, redis.RedisError) and not redisfaults.is_wrong_type(reply):
                raise redisfaults.failure(reply, f"could not enqueue job {job_id} for {model!r}")
            raise CorruptRecord(f"could not enqueue job {job_id} for {model!r}: {reply}")
    fresh = [reply == 1 for reply in results]
    foreign = [job_id for job_id, reply in zip(ids, results, strict=True) if reply == -1]
    taken = [job_id for job_id, reply in zip(ids, results, strict=True) if reply == 0]
    if foreign:
        return fresh, f"job id(s) {', '.join(foreign[:5])} belong to another model's job (or hold no job hash)"
    if taken and not unique:
        return fresh, (
            f"a job of id(s) {', '.join(taken[:5])} exists for {model!r} (queued, running, or answered): nothing "
            "was overwritten; submit with unique=True to get the existing job instead"
        )
    return fresh, None


def add_request_stop(pipe: Any, job_id: str, model: str, proof: bytes, by_eval: bool = False) -> None:
    """Queue the request to stop a started job (redisfunctions.STOP_FUNCTION, request_stop.lua), its
    mark the job's stop token made from its ``proof``: its reply is 1 when the job was started (its
    worker stops it within about half a second), else 0."""
    args = [keys.queue_name(model), redisfunctions.stop_token(proof)]
    if by_eval:
        pipe.eval(redisfunctions.stop_script_source(), 1, keys.job_key(job_id), *args)
    else:
        pipe.fcall(redisfunctions.STOP_FUNCTION, 1, keys.job_key(job_id), *args)


def chosen_handles(
    make: Callable[..., H],
    model: str,
    ids: list[str],
    nonces: list[bytes],
    results: list[Any],
    unique: bool,
    signature: str | None,
    version: str | None,
) -> list[H]:
    """The handles of a submit under chosen ids, from the replies of its :func:`add_enqueue_unique`
    calls (``make``: the producer's handle class, bound to it); JobExists when it is refused. An
    existing job's handle checks no proof: its nonce is its first submitter's."""
    fresh, refused = unique_outcome(model, ids, results, unique)
    jobs = [
        make(job_id, model, nonce, signature, version) if new else make(job_id, model)
        for job_id, nonce, new in zip(ids, nonces, fresh, strict=True)
    ]
    if refused is not None:
        raise JobExists(refused, [job for job, new in zip(jobs, fresh, strict=True) if new])
    return jobs


def add_cancel(pipe: Any, job_id: str, model: str) -> None:
    """What cancelling a job that was taken off its queue writes (after a successful LREM), as
    RQ's ``Job.cancel``: status canceled, RQ's canceled registry; and its request frame deleted."""
    pipe.delete(keys.request_key(model, job_id))
    pipe.hset(keys.job_key(job_id), "status", "canceled")
    pipe.zadd(layout.QueueKeys.of(keys.queue_name(model)).canceled, {job_id: int(layout.utcnow().timestamp())})


def status_of(raw: bytes | str | None, job_id: str) -> str:
    """A job's RQ status, from its hash's ``status`` field (HGET); JobNotFound when there is none."""
    if raw is None:
        raise JobNotFound(f"no job {job_id} in Redis (never enqueued, or its record expired)")
    return keys.as_text(raw)


def outputs_of(response: wire.Response, job: JobHandle[Any]) -> dict[str, Any]:
    """A response's outputs; InferenceFailed when the worker failed the job, VersionMismatch when
    a version of the model it may not be answered by did (:func:`check_served`)."""
    check_served(response, job)
    if response.error is not None:
        raise InferenceFailed(job.id, response.error.type, response.error.message)
    return response.outputs


def check_served(response: wire.Response, job: JobHandle[Any]) -> wire.Response:
    """``response``, unless it came from a version of the model that may not answer ``job``: another
    than the one it is pinned to, or one whose signature is not the one its inputs were checked
    against (VersionMismatch). An answer naming no version (the worker's fixed words for a request
    it could not read, or a worker before model versions) passes unless the job is pinned."""
    served, signature = response.version, response.signature
    if job.version is not None and served != job.version:
        by = "a worker that names no version" if served is None else f"version {served!r}"
        pinned = f"job {job.id} is pinned to version {job.version!r} of {job.model!r}"
        raise VersionMismatch(f"{pinned} but was answered by {by}")
    if job.signature is not None and signature is not None and signature != job.signature:
        raise VersionMismatch(
            f"job {job.id} was checked against signature {job.signature} of {job.model!r} but answered by version "
            f"{served!r}, whose signature is {signature} (the model changed under a rollout); submit it again"
        )
    return response

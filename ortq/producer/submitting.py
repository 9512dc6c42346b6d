"""A submit, as I/O-free steps (``steps``): check the model and every job's inputs, then the
queue's room, then enqueue them all in one round trip (docs/wire-format.md), falling back to EVAL
where Redis lacks ortq's functions, and leaving nothing half-enqueued."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import redis

from ortq import keys, redisfaults, replication
from ortq.errors import BrokerUnavailable, ConfigurationError
from ortq.producer import checks, enqueue, lookups
from ortq.producer.enqueue import JobOptions
from ortq.producer.replybook import ReplyBook
from ortq.producer.steps import Command, Pause, Round, Steps, function_calls
from ortq.rqcompat import layout
from ortq.settings import Settings

H = TypeVar("H")
T = TypeVar("T")

log = logging.getLogger("ortq.producer")


def submit_many(
    settings: Settings,
    check: lookups.ModelCheck,
    make: Callable[..., H],
    model: str,
    many_inputs: Iterable[Mapping[str, Any]],
    options: JobOptions,
    job_ids: Iterable[str] | None,
    unique: bool,
    book: ReplyBook | None = None,
) -> Steps[list[H]]:
    """Validate every job (model, inputs, ids, queue room), then enqueue them all; returns their
    handles (``make``: the producer's handle class, bound to it). ``options``: checked already
    (checks.job_options), before anything else. ``book``: the producer's reply book of this Redis,
    told of the jobs before they are sent (their answers may come before the enqueue returns).

    With ``settings.submit_retry_seconds``, a submit that found Redis unavailable is made again,
    whole, until that many seconds have passed, when making it again cannot enqueue a job twice:
    its ids chosen and ``unique`` (a job already there is that job: the unique enqueue never
    writes twice), or a failure before the write began (``BrokerUnavailable.maybe_enqueued``)."""
    checks.unique_needs_ids(unique, job_ids)  # before any round trip: nothing is sent
    many, chosen = list(many_inputs), None if job_ids is None else list(job_ids)

    def attempt() -> Steps[list[H]]:
        return _submit_once(settings, check, make, model, many, options, chosen, unique, book)

    return (yield from _retried(settings, unique, attempt))


def infer_options(settings: Settings) -> dict[str, Any]:
    """``infer``'s own submit options: where submits are tried again (``submit_retry_seconds``), an
    id of its own and ``unique=True``, so that a retried submit cannot enqueue its job twice."""
    return {"job_id": enqueue.new_job_ids(1)[0], "unique": True} if settings.submit_retry_seconds else {}


def _retried(settings: Settings, unique: bool, attempt: Callable[[], Steps[T]]) -> Steps[T]:
    """``attempt()``'s steps, made again while they raise BrokerUnavailable and may be (see
    :func:`submit_many`), backing off from 0.1 s to 1 s, for ``submit_retry_seconds`` at most."""
    deadline = time.monotonic() + settings.submit_retry_seconds
    pause = 0.1
    while True:
        try:
            return (yield from attempt())
        except BrokerUnavailable as exc:
            may_again = unique or not exc.maybe_enqueued  # no job can go in twice
            if not may_again or time.monotonic() + pause > deadline:
                if exc.maybe_enqueued and settings.submit_retry_seconds and not unique:
                    exc.args = (f"{exc} (not tried again: a submit with job_id and unique=True would be)",)
                raise
            log.warning("%s; trying the submit again in %.1f s (submit_retry_seconds)", exc, pause)
        yield Pause(pause)
        pause = min(pause * 2, 1.0)


def _submit_once(settings: Settings, check: lookups.ModelCheck, make: Callable[..., H], model: str,
                 many: list[Mapping[str, Any]], options: JobOptions, job_ids: list[str] | None, unique: bool,
                 book: ReplyBook | None) -> Steps[list[H]]:  # fmt: skip
    """One try of :func:`submit_many`, its arguments checked and listed."""
    signature = yield from lookups.checked_model(check, model, options.version)
    nonces = enqueue.new_nonces(len(many))
    # The smaller of the producer's limit and the one the model's workers publish: a larger frame
    # would be refused by the worker, after a round trip and a job's records.
    size = settings.max_frame_bytes
    if signature is not None and signature.max_frame_bytes is not None:
        size = min(size, signature.max_frame_bytes)
    frames = [checks.encode_job(inputs, signature, nonce, size) for inputs, nonce in zip(many, nonces, strict=True)]
    chosen = None if job_ids is None else enqueue.check_job_ids(job_ids, len(frames))
    if not frames:
        return []
    if settings.max_queue_length:
        # Checked before the MULTI: several producers at once can overshoot by their batches.
        try:
            queued = yield Command("llen", keys.queue_key(model))
        except redis.RedisError as exc:
            wrong = f"the queue of {model!r} ({keys.queue_key(model)}) is no list"
            raise redisfaults.failure(exc, f"could not enqueue for {model!r}", wrong) from exc
        checks.check_room(model, queued, len(frames), settings.max_queue_length)
    digest = None if signature is None else signature.digest
    try:
        if chosen is not None:
            results = yield from _enqueue_unique(model, frames, options, chosen, book)
            yield from _confirmed(settings)
            return enqueue.chosen_handles(make, model, chosen, nonces, results, unique, digest, options.version)
        ids = yield from _enqueue(model, frames, options, book)
        yield from _confirmed(settings)
    except replication.ConfirmRefused as exc:  # after the enqueue went through: not "could not enqueue"
        raise ConfigurationError(f"{len(frames)} job(s) for {model!r} were enqueued but not confirmed: {exc}") from exc
    except redis.RedisError as exc:
        error = redisfaults.failure(exc, f"could not enqueue {len(frames)} job(s) for {model!r}")
        if isinstance(error, BrokerUnavailable):
            error = BrokerUnavailable(f"{error}; {enqueue.MAYBE_ENQUEUED}")
            error.maybe_enqueued = True
        raise error from exc
    return [make(i, model, nonce, digest, options.version) for i, nonce in zip(ids, nonces, strict=True)]


def _enqueue(model: str, frames: list[bytes], options: JobOptions, book: ReplyBook | None) -> Steps[list[str]]:
    """One MULTI of the jobs; a high-priority insert that found no Redis function is done by EVAL
    instead; any other job Redis refused is removed again (its request and hash) and reported,
    so that nothing is left half-enqueued. Returns the jobs' ids."""
    ids = _new_ids(frames, model, book)
    try:
        results = yield from _multi(model, frames, options, ids, False)
    except redis.ResponseError as exc:
        if not enqueue.is_refused_fcall(exc, options):
            raise
        ids = _new_ids(frames, model, book)
        results = yield from _multi(model, frames, options, ids, True)
    if results is None:  # it ran, and its replies were lost: a MULTI goes in whole
        return ids
    by_eval, broken = enqueue.split_failures(results, ids, options)
    if by_eval:
        again = yield Round(lambda pipe: _enqueues_high_by_eval(pipe, model, by_eval, options), transaction=False)
        broken += [(job_id, r) for job_id, r in zip(by_eval, again, strict=True) if isinstance(r, Exception)]
    if broken:
        yield Round(lambda pipe: _deletes(pipe, model, [job_id for job_id, _ in broken]), transaction=True)
        raise enqueue.enqueue_failure(model, broken, len(ids))
    return ids


def _multi(
    model: str, frames: list[bytes], options: JobOptions, ids: list[str], by_eval: bool
) -> Steps[list[Any] | None]:
    """The enqueue MULTI of ``ids``: its EXEC replies, or None when it ran but they were lost.

    It is sent once (steps.Round ``once``: never again by redis-py's retries). After a connection
    error or a timeout, the jobs' records are read back: any of them there means that EXEC ran (a
    MULTI goes in whole or not at all), and it is not sent again (its jobs would go in twice, and a
    job started meanwhile would be set back to ``queued`` and run twice). None there after a broken
    connection means that it did not run, and it is sent once more; after a timeout it may still
    run (Redis was slow, not gone), so the timeout is raised. What is raised is the caller's to
    report (BrokerUnavailable: maybe enqueued)."""

    def queue(pipe: Any) -> None:
        enqueue.add_enqueues(pipe, model, frames, options, ids, by_eval)

    sends = 2
    while True:
        sends -= 1
        try:
            replies: list[Any] = yield Round(queue, transaction=True, once=True)
            return replies
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if (yield from _went_in(model, ids)):
                return None
            if not sends or isinstance(exc, redis.TimeoutError):
                raise exc


def _went_in(model: str, ids: list[str]) -> Steps[bool]:
    """Whether any of the jobs ``ids`` is in Redis: its job hash (it lives on after its answer)."""
    replies = yield Round(lambda pipe: _probes(pipe, ids), transaction=False)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return any(origin is not None for origin in replies)


def _probes(pipe: Any, ids: list[str]) -> None:
    for job_id in ids:
        pipe.hget(keys.job_key(job_id), "origin")


def _confirmed(settings: Settings) -> Steps[None]:
    """With ``wait_replicas``, wait until that many replicas have the jobs (ortq/replication.py);
    NotReplicated (a redis.ConnectionError: BrokerUnavailable, maybe enqueued) when they do not."""
    confirm = replication.Confirm.of(settings)
    if confirm.replicas:
        confirm.check((yield Round(confirm.queue, transaction=False)))


def _enqueue_unique(
    model: str, frames: list[bytes], options: JobOptions, ids: list[str], book: ReplyBook | None
) -> Steps[list[Any]]:
    """:func:`_enqueue_unique_calls`, the book told of the jobs first, and then of those that were
    there already (answered where their first submitter reads)."""
    if book is not None:
        book.expect(model, ids)
    results = yield from _enqueue_unique_calls(model, frames, options, ids)
    if book is not None:
        book.forget(job_id for job_id, result in zip(ids, results, strict=True) if result != 1)
    return results


def _enqueue_unique_calls(model: str, frames: list[bytes], options: JobOptions, ids: list[str]) -> Steps[list[Any]]:
    """Each job under the id chosen for it unless a job of that id exists (never overwritten): by
    FCALL, or EVAL where this Redis lacks the function; the replies of ``enqueue_unique.lua``.

    Sent once (steps.Round ``once``): sent again after a lost reply, a call that had run would
    answer 0, and the submit would take its own job for another's. After a connection error or a
    timeout each job is read back instead (:func:`_unique_outcomes`); only those not there at all
    are sent again (the function never overwrites: whatever ran meanwhile stays one job)."""
    now = layout.utcformat(layout.utcnow())

    def add(pipe: Any, i: int, by_eval: bool) -> None:
        enqueue.add_enqueue_unique(pipe, model, frames[i], options, ids[i], by_eval, now)

    try:
        replies: list[Any] = yield from function_calls(len(ids), add, once=True)
        return replies
    except (redis.ConnectionError, redis.TimeoutError):
        outcomes = yield from _unique_outcomes(model, ids, now)
    missing = [i for i, outcome in enumerate(outcomes) if outcome is None]
    if missing:
        again = yield from function_calls(
            len(missing), lambda pipe, j, by_eval: add(pipe, missing[j], by_eval), once=True
        )
        for i, reply in zip(missing, again, strict=True):
            outcomes[i] = reply
    return outcomes


def _unique_outcomes(model: str, ids: list[str], now: str) -> Steps[list[Any]]:
    """What ``enqueue_unique.lua`` answered for each of ``ids``, read back after its reply was lost:
    1 where the job is there with this submit's ``created_at`` (``now``), 0 where a job of that id
    and model is there otherwise, -1 where another model's is (or another type of key), None where
    nothing is."""
    queue = keys.queue_name(model)

    def probes(pipe: Any) -> None:
        for job_id in ids:
            pipe.hget(keys.job_key(job_id), "origin")
            pipe.hget(keys.job_key(job_id), "created_at")

    replies = yield Round(probes, transaction=False)
    outcomes: list[Any] = []
    for origin, created in zip(replies[0::2], replies[1::2], strict=True):
        for answer in (origin, created):
            if isinstance(answer, Exception) and not redisfaults.is_wrong_type(answer):
                raise answer
        if isinstance(origin, Exception):
            outcomes.append(-1)  # no hash there
        elif origin is None:
            outcomes.append(None)
        elif keys.as_text(origin) != queue:
            outcomes.append(-1)
        else:
            outcomes.append(1 if created is not None and keys.as_text(created) == now else 0)
    return outcomes


def _new_ids(frames: list[bytes], model: str, book: ReplyBook | None) -> list[str]:
    ids = enqueue.new_job_ids(len(frames))
    if book is not None:
        book.expect(model, ids)
    return ids


def _enqueues_high_by_eval(pipe: Any, model: str, ids: list[str], options: JobOptions) -> None:
    for job_id in ids:
        enqueue.add_enqueue_high_by_eval(pipe, model, job_id, options)


def _deletes(pipe: Any, model: str, ids: list[str]) -> None:
    for job_id in ids:
        pipe.delete(keys.request_key(model, job_id), keys.job_key(job_id))

"""Cancelling a job, as I/O-free steps (``steps``): take it off its queue if no worker has started
it, else ask the worker running it to stop it (ortq.worker.stops) with the job's stop token, which
only the producer that holds the job's nonce (its proof) can make."""

from __future__ import annotations

import redis

from ortq import keys, redisfaults
from ortq.errors import ConfigurationError
from ortq.producer import enqueue
from ortq.producer.steps import Command, Round, Steps, function_calls


def cancel(job_id: str, model: str, proof: bytes | None = None) -> Steps[bool]:
    """Whether the job was taken off its queue (or off the list of jobs parked for the version it
    is pinned to) or asked to stop (False: it ended, or is unknown, or it is started and ``proof``
    is None: a handle without the job's nonce cannot stop it)."""
    try:
        taken_off = yield from _taken_off(job_id, keys.queue_key(model))
        if not taken_off and (parked := (yield from _parked_list(job_id, model))) is not None:
            taken_off = yield from _taken_off(job_id, parked)
        if not taken_off:
            return False if proof is None else (yield from request_stop(job_id, model, proof))
        # A job hash that is no hash: the job is off the queue anyway (its reply is not looked at).
        records = Round(lambda pipe: enqueue.add_cancel(pipe, job_id, model), transaction=True)
        try:
            yield records
        except (redis.ConnectionError, redis.TimeoutError):
            # The job is off its queue: unless it is marked canceled it waits nowhere, answered
            # never. The writes are the same whether the first ran or not: sent once more.
            yield records
    except redis.RedisError as exc:
        wrong = f"the queue of {model!r} ({keys.queue_key(model)}) or its list of jobs parked for a version is no list"
        raise redisfaults.failure(exc, f"could not cancel job {job_id}", wrong) from exc
    return True


def _parked_list(job_id: str, model: str) -> Steps[str | None]:
    """The list a worker of another version parks the job in when it is pinned to a version
    (its hash's ``ortq_version``: start.lua), None when it names none a worker could have parked it for."""
    pin = yield Command("hget", keys.job_key(job_id), "ortq_version")
    if not isinstance(pin, bytes):  # none, or no hash (WRONGTYPE: nothing parked under its name)
        return None
    try:
        return keys.parked_key(model, keys.check_version_name(keys.as_text(pin)))
    except (ConfigurationError, UnicodeDecodeError):  # a pin no worker parks for (it answers InvalidJob)
        return None


def _taken_off(job_id: str, key: str) -> Steps[bool]:
    """LREM of the job from its queue (or parked list) ``key``, sent once (steps.Round ``once``):
    sent again after a lost reply, an LREM that had run answers 0, and the job, off its queue,
    would be neither cancelled nor ever run. After a connection error or a timeout it is sent once
    more (LREM takes off what is left, so nothing runs twice) and, answering 0, the job's status
    says what the first did: a job still ``queued`` is in no list now, so it was taken off (or a
    worker has just moved it to start it: cancelled, it is not started)."""
    remove = Round(lambda pipe: pipe.lrem(key, 0, job_id), transaction=False, once=True)
    try:
        [removed] = yield remove
    except (redis.ConnectionError, redis.TimeoutError):
        [removed] = yield remove
        if not removed:
            status = yield Command("hget", keys.job_key(job_id), "status")
            return status is not None and keys.as_text(status) == "queued"
    if isinstance(removed, Exception):
        raise removed
    return bool(removed)


def request_stop(job_id: str, model: str, proof: bytes) -> Steps[bool]:
    """Mark a started job for its worker to stop, with the stop token of its ``proof``
    (redisfunctions.stop_token); whether it was started (and so marked)."""
    [reply] = yield from function_calls(
        1, lambda pipe, _, by_eval: enqueue.add_request_stop(pipe, job_id, model, proof, by_eval)
    )
    if isinstance(reply, Exception):
        raise reply
    return bool(reply)

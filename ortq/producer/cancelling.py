"""Cancelling a job, as I/O-free steps (``steps``): take it off its queue if no worker has started
it, else ask the worker running it to stop it (ortq.worker.stops)."""

from __future__ import annotations

import redis

from ortq import keys, redisfaults
from ortq.producer import enqueue
from ortq.producer.steps import Command, Round, Steps, function_calls


def cancel(job_id: str, model: str) -> Steps[bool]:
    """Whether the job was taken off its queue or asked to stop (False: it ended, or is unknown)."""
    try:
        if not (yield Command("lrem", keys.queue_key(model), 0, job_id)):
            return (yield from request_stop(job_id, model))
        # A job hash that is no hash: the job is off the queue anyway (its reply is not looked at).
        yield Round(lambda pipe: enqueue.add_cancel(pipe, job_id, model), transaction=True)
    except redis.RedisError as exc:
        wrong = f"the queue of {model!r} ({keys.queue_key(model)}) is no list"
        raise redisfaults.failure(exc, f"could not cancel job {job_id}", wrong) from exc
    return True


def request_stop(job_id: str, model: str) -> Steps[bool]:
    """Mark a started job for its worker to stop; whether it was started (and so marked)."""
    [reply] = yield from function_calls(
        1, lambda pipe, _, by_eval: enqueue.add_request_stop(pipe, job_id, model, by_eval)
    )
    if isinstance(reply, Exception):
        raise reply
    return bool(reply)

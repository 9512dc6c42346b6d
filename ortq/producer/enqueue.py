"""The Redis commands that enqueue one ortq job, exactly as docs/wire-format.md lists them.

A producer writes RQ's job hash and queue entry itself (rather than through
``rq.Queue.enqueue``), so that what ortq sends is small, fixed and documented, and so that
the request frame goes in the same MULTI/EXEC as the job that points to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import uuid4

from rq.utils import utcformat

from ortq import keys
from ortq.serializer import MsgpackSerializer

#: Job priorities. High-priority jobs go ahead of every normal one in the model's one RQ queue
#: (so RQ's registries and views stay whole), first come first served among themselves.
PRIORITIES = ("normal", "high")

# Insert a high-priority job into the queue after the last high-priority job still waiting, or at
# its head when none is. One list keeps the worker's dequeue a single atomic BLMOVE; a list per
# priority would need either a non-atomic multi-list pop or polling.
# KEYS: queue, last-high key   ARGV: job id, last-high ttl
ENQUEUE_HIGH = """
local last = redis.call('GET', KEYS[2])
local placed = -1
if last then placed = redis.call('LINSERT', KEYS[1], 'AFTER', last, ARGV[1]) end
if placed == -1 then redis.call('LPUSH', KEYS[1], ARGV[1]) end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
return 1
"""


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
    if options.ttl is not None:
        fields["ttl"] = options.ttl
    if options.priority != "normal":
        fields["ortq_priority"] = options.priority
    if options.job_timeout is not None:
        fields["timeout"] = options.job_timeout
    if options.retries:
        # RQ's own retry fields: its failure handling requeues (or schedules) the job.
        fields["retries_left"] = options.retries
        if options.retry_backoff:
            fields["retry_intervals"] = json.dumps([options.retry_backoff * 2**i for i in range(options.retries)])
    return fields


def add_enqueue(pipe: Any, model: str, frame: bytes, options: JobOptions, job_id: str | None = None) -> str:
    """Queue the commands that enqueue one job on ``pipe``; returns the job id."""
    job_id = job_id or str(uuid4())
    request_ttl = options.request_ttl if options.ttl is None else min(options.request_ttl, options.ttl)
    pipe.set(keys.request_key(job_id), frame, ex=request_ttl)
    pipe.hset(keys.job_key(job_id), mapping=job_hash(model, options, utcformat(datetime.now(UTC))))
    if options.ttl is not None:
        # The job's record outlives its ttl by failure_ttl, so that the worker that finds it too
        # late can fail it with a reason (RequestExpired) instead of it silently vanishing.
        pipe.expire(keys.job_key(job_id), options.ttl + options.failure_ttl)
    pipe.sadd(keys.RQ_QUEUES_SET, keys.queue_key(model))
    if options.priority == "high":
        pipe.eval(ENQUEUE_HIGH, 2, keys.queue_key(model), keys.last_high_key(model), job_id, request_ttl)
    else:
        pipe.rpush(keys.queue_key(model), job_id)
    return job_id

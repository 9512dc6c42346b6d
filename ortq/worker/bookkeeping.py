"""RQ's per-job state changes, done server-side: one script to start a job, one to finish it.

RQ's own worker spends ~20 round trips and ~40 commands on each job (execution record,
registries, worker and job hashes, result stream), each packed and parsed in Python. A GPU
model often runs faster than that. Here the same writes happen inside two Lua scripts, one
``EVALSHA`` each, so a job costs three round trips in all: the dequeue, ``start``, ``finish``.

What the scripts write is exactly what RQ 2.12's ``prepare_execution`` +
``prepare_job_execution`` and ``handle_job_success`` write (tests/test_rq_views.py reads it
back through RQ's own APIs: registries, ``Job.fetch``, ``latest_result``, executions). That is
why ``rq`` is pinned to one minor series. Failures go through RQ's ``handle_job_failure``
unchanged, so failed registries and retries stay RQ's.
"""

from __future__ import annotations

import time
from base64 import b64encode
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import uuid4

import redis

from ortq import keys
from ortq.serializer import MsgpackSerializer

# KEYS: job, request, execution, executions, wip registry, worker, intermediate queue
# ARGV: job id, execution id, worker name, now (epoch s), now (RQ's ISO format), default heartbeat ttl
_START = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('LREM', KEYS[7], 1, ARGV[1])
  return false
end
local timeout = tonumber(redis.call('HGET', KEYS[1], 'timeout') or '')
local ttl = tonumber(ARGV[6])
if timeout and timeout > 0 then ttl = math.floor(timeout) + 60 end
local now = tonumber(ARGV[4])
redis.call('HSET', KEYS[3], 'id', ARGV[2], 'created_at', ARGV[4], 'last_heartbeat', ARGV[4], 'worker_name', ARGV[3])
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('ZADD', KEYS[4], math.floor(now) + ttl + 60, ARGV[2])
redis.call('EXPIRE', KEYS[4], ttl + 60)
redis.call('ZADD', KEYS[5], math.floor(now) + ttl, ARGV[1] .. ':' .. ARGV[2])
redis.call('HSET', KEYS[6], 'state', 'busy', 'current_job', ARGV[1], 'current_job_working_time', '0',
           'last_heartbeat', ARGV[5])
redis.call('EXPIRE', KEYS[6], ttl)
redis.call('HSET', KEYS[1], 'last_heartbeat', ARGV[5], 'status', 'started', 'started_at', ARGV[5],
           'worker_name', ARGV[3])
redis.call('LREM', KEYS[7], 1, ARGV[1])
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2]) or false}
"""

# KEYS: reply, job, request, worker, results stream, finished registry, execution, wip registry, executions
# ARGV: response frame, ttl, job id, execution id, worker name, working seconds, ended (ISO),
#       finished score, return value (base64 msgpack), execution started (epoch s), ended (epoch s)
_FINISH = """
redis.call('DEL', KEYS[1])
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[2], 'status', 'finished', 'ended_at', ARGV[7])
redis.call('DEL', KEYS[3])
redis.call('HINCRBY', KEYS[4], 'successful_job_count', 1)
redis.call('HINCRBYFLOAT', KEYS[4], 'total_working_time', ARGV[6])
redis.call('XADD', KEYS[5], 'MAXLEN', '~', '10', '*', 'type', '1', 'worker_name', ARGV[5],
           'return_value', ARGV[9], 'execution_id', ARGV[4],
           'execution_started_at', ARGV[10], 'execution_ended_at', ARGV[11])
redis.call('EXPIRE', KEYS[5], ARGV[2])
redis.call('ZADD', KEYS[6], ARGV[8], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('HDEL', KEYS[4], 'current_job')
redis.call('HSET', KEYS[4], 'state', 'idle')
redis.call('DEL', KEYS[7])
redis.call('ZREM', KEYS[8], ARGV[3] .. ':' .. ARGV[4])
redis.call('ZREM', KEYS[9], ARGV[4])
return 1
"""


def rq_isoformat(moment: datetime) -> str:
    """RQ's ``utcformat``."""
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class StartedJob:
    """What ``start`` hands back: the job hash as RQ stores it, the request frame, the execution."""

    job_hash: dict[bytes, bytes]
    frame: bytes | None
    execution_id: str
    started_at: datetime


class Bookkeeping:
    """The two scripts, bound to one connection and one worker."""

    def __init__(self, connection: redis.Redis, worker_name: str, queue_name: str, default_ttl: int) -> None:
        self.worker_name = worker_name
        self.queue_name = queue_name
        self.default_ttl = default_ttl
        self._start = connection.register_script(_START)
        self._finish = connection.register_script(_FINISH)

    def start(self, job_id: str) -> StartedJob | None:
        """Mark a dequeued job started and fetch it with its request frame; None if its hash is gone."""
        execution_id = uuid4().hex
        moment = datetime.now(UTC)
        reply = self._start(
            keys=[
                keys.job_key(job_id),
                keys.request_key(job_id),
                f"rq:execution:{job_id}:{execution_id}",
                f"rq:executions:{job_id}",
                f"rq:wip:{self.queue_name}",
                f"rq:worker:{self.worker_name}",
                f"rq:queue:{self.queue_name}:intermediate",
            ],
            args=[job_id, execution_id, self.worker_name, moment.timestamp(), rq_isoformat(moment), self.default_ttl],
        )
        if reply is None:
            return None
        flat, frame = reply
        job_hash = dict(zip(flat[::2], flat[1::2], strict=True))
        return StartedJob(job_hash=job_hash, frame=frame, execution_id=execution_id, started_at=moment)

    def finish(self, job_id: str, started: StartedJob, frame: bytes, ttl: int, return_value: Any) -> datetime:
        """Reply, then write what RQ writes for a finished job; returns the end time."""
        ended = datetime.now(UTC)
        packed = b64encode(MsgpackSerializer.dumps(return_value)).decode()
        self._finish(
            keys=[
                keys.reply_key(job_id),
                keys.job_key(job_id),
                keys.request_key(job_id),
                f"rq:worker:{self.worker_name}",
                f"rq:results:{job_id}",
                f"rq:finished:{self.queue_name}",
                f"rq:execution:{job_id}:{started.execution_id}",
                f"rq:wip:{self.queue_name}",
                f"rq:executions:{job_id}",
            ],
            args=[
                frame,
                ttl,
                job_id,
                started.execution_id,
                self.worker_name,
                (ended - started.started_at).total_seconds(),
                rq_isoformat(ended),
                int(time.time()) + ttl,
                packed,
                started.started_at.timestamp(),
                ended.timestamp(),
            ],
        )
        return ended

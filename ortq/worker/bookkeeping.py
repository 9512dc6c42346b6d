"""RQ's per-job state changes, done server-side: scripts that start jobs, finish them, fail them
(fenced), take them back from dead workers, and rescue them from a lost dequeue reply.

RQ's own worker spends ~20 round trips and ~40 commands on each job (execution record,
registries, worker and job hashes, result stream), each packed and parsed in Python. A GPU
model often runs faster than that. Here the same writes happen inside Lua scripts, one
``EVALSHA`` each, so a successful job costs three round trips in all: the dequeue, ``start`` (with the
GET of its request frame), ``finish``; a batch of jobs costs one more, for their frames.

What the scripts write is exactly what RQ 2.12's ``prepare_execution`` +
``prepare_job_execution`` and ``handle_job_success`` write (tests/test_rq_views.py reads it
back through RQ's own APIs: registries, ``Job.fetch``, ``latest_result``, executions). That is
why ``rq`` is pinned to one minor series. Failures go through RQ's ``handle_job_failure``
unchanged (after the fenced ``fail`` script), so failed registries and retries stay RQ's.
"""

from __future__ import annotations

import logging
from base64 import b64encode
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast
from uuid import uuid4

import redis
from rq.utils import utcformat

from ortq import keys
from ortq.rqjob import parse_rq_time
from ortq.serializer import MsgpackSerializer

log = logging.getLogger("ortq.worker")

# The scripts build per-job key names from the ids they are given (RQ's and ortq's fixed
# prefixes, see ortq/keys.py): a batch's keys are not known before the script pops its jobs.
# That ties ortq to a single Redis (no Cluster), as RQ's multi-key transactions already do.

# Start the job ARGV[1] (already moved to the intermediate list by BLMOVE) and pop and start up
# to ARGV[2] more from the queue, in order.
# KEYS: queue, intermediate queue, wip registry, worker
# ARGV: first job id, how many more, worker name, now (epoch s), now (ISO), default heartbeat ttl,
#       then one fresh execution id per job that may start
_START = """
local started, dropped = {}, {}
local now = tonumber(ARGV[4])
local function start(id, execution)
  -- RQ's own rule for job ids; anything else (bytes that are not text, ':' or '.') is no job of
  -- ortq's and would break key names: it is taken off the list and reported, not started.
  if not string.match(id, '^[%w_%-]+$') then
    redis.call('LREM', KEYS[2], 1, id)
    table.insert(dropped, id)
    return
  end
  local job = 'rq:job:' .. id
  if redis.call('EXISTS', job) == 0 then
    redis.call('LREM', KEYS[2], 1, id)
    return
  end
  local timeout = tonumber(redis.call('HGET', job, 'timeout') or '')
  local ttl = tonumber(ARGV[6])
  -- At most a year: a forged "timeout" of 1e20 or inf must not make EXPIRE fail mid-script.
  if timeout and timeout > 0 then ttl = math.floor(math.min(timeout, 31536000)) + 60 end
  local ekey = 'rq:execution:' .. id .. ':' .. execution
  redis.call('HSET', ekey, 'id', execution, 'created_at', ARGV[4], 'last_heartbeat', ARGV[4], 'worker_name', ARGV[3])
  redis.call('EXPIRE', ekey, ttl)
  redis.call('ZADD', 'rq:executions:' .. id, math.floor(now) + ttl + 60, execution)
  redis.call('EXPIRE', 'rq:executions:' .. id, ttl + 60)
  redis.call('ZADD', KEYS[3], math.floor(now) + ttl, id .. ':' .. execution)
  redis.call('HSET', KEYS[4], 'state', 'busy', 'current_job', id, 'current_job_working_time', '0',
             'last_heartbeat', ARGV[5])
  redis.call('EXPIRE', KEYS[4], ttl)
  redis.call('HSET', job, 'last_heartbeat', ARGV[5], 'status', 'started', 'started_at', ARGV[5], 'worker_name', ARGV[3])
  redis.call('LREM', KEYS[2], 1, id)
  table.insert(started, {id, execution, redis.call('HGETALL', job)})
end
start(ARGV[1], ARGV[7])
for i = 1, tonumber(ARGV[2]) do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not id then break end
  start(id, ARGV[7 + i])
end
return {started, dropped}
"""

# Reply to and finish several jobs: first every reply (the producers are blocked on them),
# then what RQ writes for a finished job.
# KEYS: finished registry, wip registry, worker
# ARGV: worker name, job count, then 9 values per job: id, execution id, response frame, ttl,
#       working seconds, ended (ISO), return value (base64 msgpack), started (epoch s), ended (epoch s)
# Answer a job: its one response frame in its reply list (the producer blocks on it), replacing
# anything there, since a job is answered once. Prepended to the scripts that answer jobs.
_ANSWER = """
local function answer(id, frame, ttl)
  local reply = 'ortq:reply:' .. id
  redis.call('DEL', reply)
  redis.call('RPUSH', reply, frame)
  redis.call('EXPIRE', reply, ttl)
end
"""

_FINISH = """
local n = tonumber(ARGV[2])
-- Fencing: a job whose started-registry entry is gone was recovered from this worker (taken
-- for dead) and requeued; its answer now belongs to the next execution, so it is not written.
local live = {}
for j = 0, n - 1 do
  local b = 3 + 9 * j
  if redis.call('ZSCORE', KEYS[2], ARGV[b] .. ':' .. ARGV[b + 1]) then table.insert(live, b) end
end
for _, b in ipairs(live) do
  answer(ARGV[b], ARGV[b + 2], ARGV[b + 3])
  redis.call('HSET', 'rq:job:' .. ARGV[b], 'status', 'finished', 'ended_at', ARGV[b + 5])
end
local working, finished, wip = 0, {}, {}
for _, b in ipairs(live) do
  local id, execution, ttl = ARGV[b], ARGV[b + 1], tonumber(ARGV[b + 3])
  redis.call('DEL', 'ortq:req:' .. id)
  working = working + tonumber(ARGV[b + 4])
  local results = 'rq:results:' .. id
  redis.call('XADD', results, 'MAXLEN', '~', '10', '*', 'type', '1', 'worker_name', ARGV[1],
             'return_value', ARGV[b + 6], 'execution_id', execution,
             'execution_started_at', ARGV[b + 7], 'execution_ended_at', ARGV[b + 8])
  redis.call('EXPIRE', results, ttl)
  table.insert(finished, math.floor(tonumber(ARGV[b + 8])) + ttl)
  table.insert(finished, id)
  table.insert(wip, id .. ':' .. execution)
  redis.call('EXPIRE', 'rq:job:' .. id, ttl)
  redis.call('DEL', 'rq:execution:' .. id .. ':' .. execution)
  redis.call('ZREM', 'rq:executions:' .. id, execution)
end
if #live > 0 then
  -- What RQ writes per job, written once for the batch.
  redis.call('ZADD', KEYS[1], unpack(finished))
  redis.call('ZREM', KEYS[2], unpack(wip))
  redis.call('HINCRBY', KEYS[3], 'successful_job_count', #live)
  redis.call('HINCRBYFLOAT', KEYS[3], 'total_working_time', tostring(working))
end
redis.call('HDEL', KEYS[3], 'current_job')
redis.call('HSET', KEYS[3], 'state', 'idle')
return #live
"""

# Take back a job whose worker died while running it (its started-registry entry is still there
# but the worker's heartbeat stopped): requeue it at the front, or fail it once it has been
# taken back ARGV[4] times. Atomic, so of several surviving workers exactly one recovers it.
# KEYS: wip registry, queue, failed registry
# ARGV: job id, execution id, reason, max recoveries, failure ttl, now (epoch s), error frame
_RECOVER = """
local composite = ARGV[1] .. ':' .. ARGV[2]
if redis.call('ZREM', KEYS[1], composite) == 0 then return false end
local job = 'rq:job:' .. ARGV[1]
redis.call('DEL', 'rq:execution:' .. composite)
redis.call('ZREM', 'rq:executions:' .. ARGV[1], ARGV[2])
if redis.call('EXISTS', job) == 0 then return 'gone' end
-- Not HINCRBY: a forged non-integer count must not make the script fail (it counts as 0).
local times = (tonumber(redis.call('HGET', job, 'ortq_recoveries') or '') or 0) + 1
redis.call('HSET', job, 'ortq_recoveries', times)
if times > tonumber(ARGV[4]) then
  redis.call('HSET', job, 'status', 'failed', 'exc_info', ARGV[3])
  redis.call('ZADD', KEYS[3], math.floor(tonumber(ARGV[6])) + tonumber(ARGV[5]), ARGV[1])
  answer(ARGV[1], ARGV[7], ARGV[5])
  redis.call('DEL', 'ortq:req:' .. ARGV[1])
  return 'failed'
end
redis.call('HSET', job, 'status', 'queued')
redis.call('LPUSH', KEYS[2], ARGV[1])
return 'requeued'
"""


# Fail a job: push its error reply (unless ARGV[2] is empty: it will be retried) and mark it
# failed, but only while this execution still owns it. Fencing, as in _FINISH: a job recovered
# from this worker (taken for dead) belongs to its next execution. RQ's failure bookkeeping
# (failed registry, retry) follows in Python only when this returns 1.
# KEYS: wip registry   ARGV: job id, error frame or '', execution id, reply ttl
_FAIL = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1] .. ':' .. ARGV[3]) then return 0 end
if ARGV[2] ~= '' then
  answer(ARGV[1], ARGV[2], ARGV[4])
  redis.call('HSET', 'rq:job:' .. ARGV[1], 'status', 'failed')
  redis.call('DEL', 'ortq:req:' .. ARGV[1])
end
return 1
"""

# Put back jobs stuck in the intermediate list: a BLMOVE whose reply was lost (Redis restarted,
# the connection dropped) leaves its job there, still "queued", with no worker to start it.
# A job seen there on two scans at least ARGV[2] seconds apart goes back to the queue's head.
# KEYS: intermediate list, queue, first-seen hash   ARGV: now (epoch s), grace seconds
_RESCUE = """
local now, grace = tonumber(ARGV[1]), tonumber(ARGV[2])
local ids = redis.call('LRANGE', KEYS[1], 0, -1)
local present, rescued = {}, {}
for _, id in ipairs(ids) do
  present[id] = true
  local status = redis.call('HGET', 'rq:job:' .. id, 'status')
  if status ~= 'queued' then
    -- its hash expired, or it was started (the start script takes it out of the list itself)
    if not status then redis.call('LREM', KEYS[1], 0, id) end
  else
    local seen = tonumber(redis.call('HGET', KEYS[3], id) or '')
    if not seen then
      redis.call('HSET', KEYS[3], id, ARGV[1])
    elseif now - seen >= grace then
      redis.call('LREM', KEYS[1], 0, id)
      redis.call('LPUSH', KEYS[2], id)
      redis.call('HDEL', KEYS[3], id)
      table.insert(rescued, id)
    end
  end
end
for _, id in ipairs(redis.call('HKEYS', KEYS[3])) do
  if not present[id] then redis.call('HDEL', KEYS[3], id) end
end
redis.call('EXPIRE', KEYS[3], 3600)
return rescued
"""


@dataclass(frozen=True)
class StartedJob:
    """One job ``start`` handed back: its id, its hash as RQ stores it, its request frame."""

    job_id: str
    execution_id: str
    job_hash: dict[bytes, bytes]
    frame: bytes | None
    started_at: datetime


@dataclass(frozen=True)
class FinishedJob:
    """What ``finish`` needs of one successful job."""

    started: StartedJob
    frame: bytes
    ttl: int
    return_value: Any


class Bookkeeping:
    """The scripts, bound to one connection, one worker and one queue."""

    def __init__(self, connection: redis.Redis, worker_name: str, queue_name: str, default_ttl: int) -> None:
        self.worker_name = worker_name
        self.queue_name = queue_name
        self.default_ttl = default_ttl
        self._connection = connection
        self._start = connection.register_script(_START)
        self._finish = connection.register_script(_ANSWER + _FINISH)
        self._recover = connection.register_script(_ANSWER + _RECOVER)
        self._fail = connection.register_script(_ANSWER + _FAIL)
        self._rescue = connection.register_script(_RESCUE)
        self._start_keys = [
            f"rq:queue:{queue_name}",
            f"rq:queue:{queue_name}:intermediate",
            f"rq:wip:{queue_name}",
            f"rq:worker:{worker_name}",
        ]
        self._finish_keys = [f"rq:finished:{queue_name}", f"rq:wip:{queue_name}", f"rq:worker:{worker_name}"]

    def start(self, first_id: bytes, more: int = 0) -> list[StartedJob]:
        """Mark ``first_id`` (already in the intermediate list) and up to ``more`` queued jobs
        started, and fetch them with their request frames, in one round trip. Jobs whose hash
        expired while they waited are skipped, as RQ skips them; entries that are not job ids
        are dropped (and logged)."""
        moment = datetime.now(UTC)
        executions = [uuid4().hex for _ in range(1 + more)]
        args: list[Any] = [first_id, more, self.worker_name, moment.timestamp(), utcformat(moment), self.default_ttl]
        # Frames are read with GET/MGET, not inside the script: a script's reply copies every
        # string through Lua, several times slower for frames of hundreds of KB. The first job's
        # frame goes in the same round trip as the script; the others' (batching) in one more.
        first_text = first_id.decode(errors="replace")  # not text: dropped by the script, GET finds nothing
        with self._connection.pipeline(transaction=False) as pipe:
            self._start(keys=self._start_keys, args=[*args, *executions], client=pipe)
            pipe.get(keys.request_key(first_text))
            (reply, dropped), first_frame = pipe.execute()
        for entry in dropped:
            log.error("dropped queue entry %r of %s: not a job id ([A-Za-z0-9_-]+)", entry[:80], self.queue_name)
        ids = [keys.as_text(r[0]) for r in reply]
        frames: list[bytes | None] = [first_frame] if ids[:1] == [first_text] else []
        if len(ids) > len(frames):
            frames += cast(list[bytes | None], self._connection.mget([keys.request_key(i) for i in ids[len(frames) :]]))
        started = []
        for (raw_id, execution, flat), frame in zip(reply, frames, strict=True):
            job_hash = dict(zip(flat[::2], flat[1::2], strict=True))
            started.append(StartedJob(keys.as_text(raw_id), keys.as_text(execution), job_hash, frame, moment))
        return started

    def finish(self, jobs: list[FinishedJob]) -> None:
        """Reply to every job, then write what RQ writes for each finished job; one round trip."""
        ended = datetime.now(UTC)
        args: list[Any] = [self.worker_name, len(jobs)]
        for job in jobs:
            started = job.started
            args += [
                started.job_id,
                started.execution_id,
                job.frame,
                job.ttl,
                (ended - started.started_at).total_seconds(),
                utcformat(ended),
                b64encode(MsgpackSerializer.dumps(job.return_value)).decode(),
                started.started_at.timestamp(),
                ended.timestamp(),
            ]
        self._finish(keys=self._finish_keys, args=args)

    def heartbeat_ttl(self, timeout: int | None) -> int:
        """The start script's rule: a job's timeout + 60 s, else the worker's default."""
        return timeout + 60 if timeout is not None and timeout > 0 else self.default_ttl

    def refresh_started(self, pipe: Any, jobs: list[tuple[StartedJob, int | None]]) -> None:
        """Queue on ``pipe`` what keeps running jobs (with their timeouts) fresh in RQ's records:
        the started-registry score, the execution's TTL, the job's ``last_heartbeat``."""
        moment = datetime.now(UTC)
        for started, timeout in jobs:
            ttl = self.heartbeat_ttl(timeout)
            composite = f"{started.job_id}:{started.execution_id}"
            pipe.zadd(self._start_keys[2], {composite: int(moment.timestamp()) + ttl}, xx=True)
            pipe.expire(f"rq:execution:{composite}", ttl)
            pipe.hset(keys.job_key(started.job_id), "last_heartbeat", utcformat(moment))

    def fail(self, started: StartedJob, error: bytes | None, ttl: int) -> bool:
        """Reply ``error`` to a failed job (None: it will be retried, no reply) and mark it failed,
        if this execution still owns it; False when it was recovered by another worker."""
        owned = self._fail(keys=[self._start_keys[2]], args=[started.job_id, error or b"", started.execution_id, ttl])
        return bool(owned)

    def rescue_intermediate(self, grace: float) -> list[str]:
        """Requeue jobs stuck in the intermediate list for ``grace`` seconds (see _RESCUE)."""
        intermediate = self._start_keys[1]
        rescued = self._rescue(
            keys=[intermediate, self._start_keys[0], keys.PREFIX + "first-seen:" + self.queue_name],
            args=[datetime.now(UTC).timestamp(), grace],
        )
        return [keys.as_text(r) for r in rescued]

    def abandoned(self, dead_after: float, own: bool = True) -> list[tuple[str, str, str]]:
        """(job id, execution id, worker name) of this queue's started jobs whose worker has sent
        no heartbeat for ``dead_after`` seconds (or whose records are gone), and those of this
        worker itself: it asks only while idle, so a started job of its own is one whose start
        reply was lost (a Redis restart or dropped connection) and that nothing will run. With
        ``own`` False (asked during a run) this worker's entries are left alone."""
        wip = f"rq:wip:{self.queue_name}"
        entries = [keys.as_text(e) for e in cast(list[bytes], self._connection.zrange(wip, 0, -1))]
        if not entries:
            return []
        with self._connection.pipeline(transaction=False) as pipe:
            for entry in entries:
                pipe.hget(f"rq:execution:{entry}", "worker_name")
            owners = [None if w is None else keys.as_text(w) for w in pipe.execute()]
        names = sorted({w for w in owners if w and w != self.worker_name})
        with self._connection.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hget(f"rq:worker:{name}", "last_heartbeat")
            beats = dict(zip(names, pipe.execute(), strict=True))
        now = datetime.now(UTC)
        found = []
        for entry, owner in zip(entries, owners, strict=True):
            if owner == self.worker_name and not own:
                continue
            last = None if owner == self.worker_name else parse_rq_time(beats.get(owner) if owner else None)
            if last is None or (now - last).total_seconds() > dead_after:
                job_id, _, execution_id = entry.rpartition(":")
                found.append((job_id, execution_id, owner or "?"))
        return found

    def recover(
        self,
        job_id: str,
        execution_id: str,
        max_recoveries: int,
        failure_ttl: int,
        error: bytes,
        reason: str = "WorkerLost",
    ) -> str | None:
        """Requeue (or, past ``max_recoveries``, fail with ``reason``) an abandoned job; None if
        another worker recovered it first. ``max_recoveries`` -1 fails it at once."""
        result = self._recover(
            keys=[f"rq:wip:{self.queue_name}", f"rq:queue:{self.queue_name}", f"rq:failed:{self.queue_name}"],
            args=[
                job_id,
                execution_id,
                reason,
                max_recoveries,
                failure_ttl,
                datetime.now(UTC).timestamp(),
                error,
            ],
        )
        return None if result is None else keys.as_text(result)

-- Fail one started job, if this execution still owns it (fencing, as in finish.lua): its error
-- reply first, then what RQ's handle_job_failure writes (job status, failed registry, result
-- stream, TTLs, the end of the execution, the worker's counters). With a retry left, instead of
-- an answer the job goes back to its queue (at once) or into the scheduled registry (later), as
-- RQ's Job.retry puts it, with its request frame kept.
-- ARGV: 5 queue name, 6 worker name, 7 the worker's state afterwards ('' to leave it), 8 id,
--       9 execution id, 10 error frame, 11 failure ttl (s), 12 exc_string (base64 zlib, as RQ's result
--       stream holds it), 13 now (epoch s), 14 now (ISO), 15 started (epoch s), 16 working seconds,
--       17 retry: '' (none), 'now' or 'at', 18 retry time (epoch s), 19 retries left afterwards,
--       20 seconds a retried job's hash lives while it waits again, 21 the status it ends with
--       ('failed', or 'stopped' for a job stopped on request, which RQ also keeps in its failed
--       registry).
-- Returns 1 when failed (or retried) here, 2 when this worker had failed it already (a second send
-- whose first ran, its reply lost: the job's record says so), 0 when another worker had taken the
-- job back.
local queue, worker, id, execution = ARGV[5], ARGV[6], ARGV[8], ARGV[9]
if not owns(queue, id, execution) then
  local job = job_key(id)
  if kind(job) == 'hash' then
    local record = redis.call('HMGET', job, 'status', 'worker_name')
    if record[2] == worker and (record[1] == 'failed' or record[1] == 'stopped') then return 2 end
  end
  return 0
end
local ttl, now, retry = tonumber(ARGV[11]), tonumber(ARGV[13]), ARGV[17]
local job = job_key(id)
local is_hash = kind(job) == 'hash'
if retry == '' then
  answer(queue, id, ARGV[10], ttl)
  redis.call('DEL', request_key(queue, id))
  if is_hash then
    redis.call('HSET', job, 'status', ARGV[21] == 'stopped' and 'stopped' or 'failed', 'ended_at', ARGV[14])
    redis.call('EXPIRE', job, ttl)
  end
  local failed = PREFIX .. ':failed:' .. queue
  own(failed, 'zset')
  redis.call('ZADD', failed, math.floor(now) + ttl, id)
  local results = PREFIX .. ':results:' .. id
  own(results, 'stream')
  redis.call('XADD', results, 'MAXLEN', '~', '10', '*', 'type', '2', 'worker_name', worker,
             'exc_string', ARGV[12], 'execution_id', execution,
             'execution_started_at', ARGV[15], 'execution_ended_at', ARGV[13])
  redis.call('EXPIRE', results, ttl)
elseif is_hash then
  redis.call('HSET', job, 'retries_left', ARGV[19], 'ended_at', ARGV[14])
  redis.call('EXPIRE', job, seconds(ARGV[20], YEAR))
  if retry == 'at' then
    redis.call('HSET', job, 'status', 'scheduled')
    local scheduled = PREFIX .. ':scheduled:' .. queue
    own(scheduled, 'zset')
    redis.call('ZADD', scheduled, ARGV[18], id)
  else
    redis.call('HSET', job, 'status', 'queued', 'enqueued_at', ARGV[14])
    local list = queue_key(queue)
    own(list, 'list')
    redis.call('RPUSH', list, id)
  end
end
end_execution(queue, id, execution, worker)
worker_done(worker, 'failed_job_count', 1, tonumber(ARGV[16]), ARGV[7])
return 1

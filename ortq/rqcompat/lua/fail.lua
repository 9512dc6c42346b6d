-- Fail one started job, if this execution still owns it (fencing, as in finish.lua): its error
-- reply first (in the reply stream its job hash names), then what RQ's handle_job_failure writes (job status, failed registry, result
-- stream, TTLs, the end of the execution, the worker's counters). With a retry left, instead of
-- an answer the job goes back to its queue (at once) or into the scheduled registry (later), as
-- RQ's Job.retry puts it, with its request frame kept.
-- Arguments: contract.SCRIPT_ARGS['fail']: the error frame, the failure ttl (s), exc_string (base64
-- zlib, as RQ's result stream holds it), now (epoch s and ISO), started (epoch s), working seconds,
-- retry ('' none, 'now' or 'at'), its time (epoch s), the retries left afterwards, the seconds a
-- retried job's hash lives while it waits again, and the status it ends with ('failed', or
-- 'stopped' for a job stopped on request, which RQ also keeps in its failed registry).
-- Returns 1 when failed (or retried) here, 2 when this worker had failed it already (a second send
-- whose first ran, its reply lost: the job's record says so), 0 when another worker had taken the
-- job back.
local queue, worker, id, execution = A.queue, A.worker, A.id, A.execution
if not owns(queue, id, execution) then
  local job = job_key(id)
  if kind(job) == 'hash' then
    local record = redis.call('HMGET', job, 'status', 'worker_name')
    if record[2] == worker and (record[1] == 'failed' or record[1] == 'stopped') then return 2 end
  end
  return 0
end
local ttl, now, retry = tonumber(A.ttl), tonumber(A.now), A.retry
local job = job_key(id)
local is_hash = kind(job) == 'hash'
if retry == '' then
  answer(queue, id, A.error, now)
  redis.call('DEL', request_key(queue, id))
  if is_hash then
    redis.call('HSET', job, 'status', A.status == 'stopped' and 'stopped' or 'failed', 'ended_at', A.now_iso)
    redis.call('EXPIRE', job, ttl)
  end
  local failed = PREFIX .. ':failed:' .. queue
  own(failed, 'zset')
  redis.call('ZADD', failed, math.floor(now) + ttl, id)
  local results = PREFIX .. ':results:' .. id
  own(results, 'stream')
  redis.call('XADD', results, 'MAXLEN', '~', '10', '*', 'type', '2', 'worker_name', worker,
             'exc_string', A.exc_string, 'execution_id', execution,
             'execution_started_at', A.started_at, 'execution_ended_at', A.now)
  redis.call('EXPIRE', results, ttl)
elseif is_hash then
  redis.call('HSET', job, 'retries_left', A.retries_left, 'ended_at', A.now_iso)
  redis.call('EXPIRE', job, seconds(A.retry_ttl, YEAR))
  if retry == 'at' then
    redis.call('HSET', job, 'status', 'scheduled')
    local scheduled = PREFIX .. ':scheduled:' .. queue
    own(scheduled, 'zset')
    redis.call('ZADD', scheduled, A.retry_at, id)
  else
    redis.call('HSET', job, 'status', 'queued', 'enqueued_at', A.now_iso)
    local list = queue_key(queue)
    own(list, 'list')
    redis.call('RPUSH', list, id)
  end
end
end_execution(queue, id, execution, worker)
worker_done(worker, 'failed_job_count', 1, tonumber(A.working), A.state)
return 1

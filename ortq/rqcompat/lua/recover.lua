-- Take back a job whose worker died while running it (its started entry is there, its worker's
-- heartbeat stopped): requeue it at the head of its queue, or fail it once it has been taken back
-- ARGV[9] times. Atomic, so of several surviving workers exactly one takes it back.
-- ARGV: 5 queue name, 6 job id, 7 execution id, 8 the dead worker's name, 9 max recoveries,
--       10 failure ttl (s), 11 now (epoch s), 12 now (ISO), 13 error frame, 14 exc_string (base64 zlib)
-- Returns 'requeued', 'failed', 'gone' (its record expired), or false when it was not (or no
-- longer) started.
local queue, id, execution = ARGV[5], ARGV[6], ARGV[7]
if not owns(queue, id, execution) then return false end
end_execution(queue, id, execution, ARGV[8])
local job = job_key(id)
if kind(job) ~= 'hash' then
  redis.call('DEL', request_key(queue, id))
  return 'gone'
end
local times = number(redis.call('HGET', job, 'ortq_recoveries'), 0) + 1
redis.call('HSET', job, 'ortq_recoveries', times)
if times > tonumber(ARGV[9]) then
  local ttl, now = tonumber(ARGV[10]), tonumber(ARGV[11])
  redis.call('HSET', job, 'status', 'failed', 'ended_at', ARGV[12])
  redis.call('EXPIRE', job, ttl)
  local failed = PREFIX .. ':failed:' .. queue
  own(failed, 'zset')
  redis.call('ZADD', failed, math.floor(now) + ttl, id)
  local results = PREFIX .. ':results:' .. id
  own(results, 'stream')
  redis.call('XADD', results, 'MAXLEN', '~', '10', '*', 'type', '2', 'worker_name', ARGV[8],
             'exc_string', ARGV[14], 'execution_id', execution, 'execution_ended_at', ARGV[11])
  redis.call('EXPIRE', results, ttl)
  answer(queue, id, ARGV[13], now)
  redis.call('DEL', request_key(queue, id))
  return 'failed'
end
redis.call('HSET', job, 'status', 'queued')
local list = queue_key(queue)
own(list, 'list')
redis.call('LPUSH', list, id)
return 'requeued'

-- Answer a queue entry that start.lua would not start because its job key is no hash, or because
-- its job hash pins a version by a name no ortq producer writes, so that whoever waits on it learns
-- why instead of timing out (start.lua checked that the entry is a job id and that it is in
-- neither the finished nor the failed registry: a job is answered once; its hash says so too,
-- ortq_answer). Nothing is started. A job hash is marked failed, in RQ's failed registry (it was
-- taken off its queue and will not run), and answered in the reply stream it names; any other job
-- key is left to expire (no reply stream is named there: no answer).
-- ARGV: 5 queue name, 6 job id, 7 error frame, 8 failure ttl (s), 9 now (epoch s), 10 now (RQ's ISO)
local queue, id, ttl = ARGV[5], ARGV[6], tonumber(ARGV[8])
local job = job_key(id)
if hget(job, 'ortq_answer') then return 0 end
answer(queue, id, ARGV[7], tonumber(ARGV[9]))
redis.call('DEL', request_key(queue, id))
local t = kind(job)
if t == 'hash' then
  redis.call('HSET', job, 'status', 'failed', 'ended_at', ARGV[10])
  local failed = PREFIX .. ':failed:' .. queue
  own(failed, 'zset')
  redis.call('ZADD', failed, math.floor(tonumber(ARGV[9])) + ttl, id)
end
if t ~= 'none' then redis.call('EXPIRE', job, ttl) end
return 1

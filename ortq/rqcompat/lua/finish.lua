-- Reply to and finish several jobs: first every reply (producers wait on them), then what RQ's
-- handle_job_success writes for each (job status, result stream, finished registry, TTLs, the end
-- of the execution), then the worker's counters once for the batch.
-- ARGV: 5 queue name, 6 worker name, 7 the worker's state afterwards ('' to leave it), 8 job count,
--       then 9 values per job: id, execution id, response frame, ttl (s), working seconds,
--       ended (RQ's ISO), return value (base64 msgpack), started (epoch s), ended (epoch s).
-- Returns the number of jobs answered (a job taken back meanwhile is not: fencing).
local queue, worker, n = ARGV[5], ARGV[6], tonumber(ARGV[8])
local live = {}
for j = 0, n - 1 do
  local b = 9 + 9 * j
  if owns(queue, ARGV[b], ARGV[b + 1]) then table.insert(live, b) end
end
for _, b in ipairs(live) do
  answer(ARGV[b], ARGV[b + 2], ARGV[b + 3])
end
local working, finished, wip, index = 0, {}, {}, {}
for _, b in ipairs(live) do
  local id, execution, ttl = ARGV[b], ARGV[b + 1], tonumber(ARGV[b + 3])
  local job = job_key(id)
  local set = redis.pcall('HSET', job, 'status', 'finished', 'ended_at', ARGV[b + 5])
  if type(set) ~= 'table' then redis.call('EXPIRE', job, ttl) end  -- an error: no job hash to keep
  redis.call('DEL', ORTQ .. 'req:' .. id)
  working = working + tonumber(ARGV[b + 4])
  local results = PREFIX .. ':results:' .. id
  write('XADD', results, 'MAXLEN', '~', '10', '*', 'type', '1', 'worker_name', worker,
        'return_value', ARGV[b + 6], 'execution_id', execution,
        'execution_started_at', ARGV[b + 7], 'execution_ended_at', ARGV[b + 8])
  redis.call('EXPIRE', results, ttl)
  table.insert(finished, math.floor(tonumber(ARGV[b + 8])) + ttl)
  table.insert(finished, id)
  table.insert(wip, id .. ':' .. execution)
  table.insert(index, id .. ':' .. execution)
  redis.call('DEL', PREFIX .. ':execution:' .. id .. ':' .. execution)
  remove('ZREM', PREFIX .. ':executions:' .. id, execution)
end
if #live > 0 then
  -- What RQ writes per job, written once for the batch.
  write('ZADD', PREFIX .. ':finished:' .. queue, unpack(finished))
  remove('ZREM', wip_key(queue), unpack(wip))
  if RQ3 then remove('SREM', worker_key(worker) .. ':executions', unpack(index)) end
end
worker_done(worker, 'successful_job_count', #live, working, ARGV[7])
return #live

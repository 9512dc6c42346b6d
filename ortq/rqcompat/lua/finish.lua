-- Reply to and finish several jobs: first every reply (producers wait on them), then what RQ's
-- handle_job_success writes for each (job status, result stream, finished registry, TTLs, the end
-- of the execution), then the worker's counters once for the batch.
-- ARGV: 5 queue name, 6 worker name, 7 the worker's state afterwards ('' to leave it), 8 job count,
--       9 ended (RQ's ISO), 10 ended (epoch s), 11 the jobs, msgpack: per job an array of id,
--       execution id, ttl (s), working seconds, return value (base64 msgpack), started (epoch s);
--       then 12... each job's response frame. (One msgpack argument for a job's small values
--       instead of six: the worker's Redis client packs each argument on its own, in Python.)
-- Returns the number of jobs answered (a job taken back meanwhile is not: fencing).
local queue, worker, n = ARGV[5], ARGV[6], tonumber(ARGV[8])
local ended_iso, ended_at = ARGV[9], ARGV[10]
local jobs = cmsgpack.unpack(ARGV[11])
local live = {}
for j = 1, n do
  local job = jobs[j]
  if owns(queue, job[1], job[2]) then table.insert(live, j) end
end
for _, j in ipairs(live) do
  answer(jobs[j][1], ARGV[11 + j], jobs[j][3])
end
local working, finished, wip, index = 0, {}, {}, {}
local ended_whole = math.floor(tonumber(ended_at))
for _, j in ipairs(live) do
  local id, execution, ttl, spent, value, started_at = unpack(jobs[j])
  local job = job_key(id)
  local set = redis.pcall('HSET', job, 'status', 'finished', 'ended_at', ended_iso)
  if type(set) ~= 'table' then redis.call('EXPIRE', job, ttl) end  -- an error: no job hash to keep
  redis.call('DEL', ORTQ .. 'req:' .. id)
  working = working + tonumber(spent)
  local results = PREFIX .. ':results:' .. id
  write('XADD', results, 'MAXLEN', '~', '10', '*', 'type', '1', 'worker_name', worker,
        'return_value', value, 'execution_id', execution,
        'execution_started_at', started_at, 'execution_ended_at', ended_at)
  redis.call('EXPIRE', results, ttl)
  table.insert(finished, ended_whole + ttl)
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

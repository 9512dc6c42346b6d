-- RQ's execution records of the jobs a worker holds, written at its heartbeats rather than at each
-- job's start: a job that ends before the worker's next heartbeat never has them (RQ's views of
-- executions would have shown it for those few milliseconds at most), and costs Redis none of
-- their writes. For each job whose started entry is still this execution's (finish and fail
-- remove it together with these records: a job that ended meanwhile gets none again), as RQ's
-- Execution.create and heartbeat write them: the execution hash, the job's executions and (RQ 3)
-- the worker's index of its executions, each with a fresh TTL. Written whole at every heartbeat
-- (a key of another type there is replaced: an execution id is fresh and random, no one else's).
-- ARGV: 5 queue name, 6 worker name, 7 now (epoch s), 8 the jobs, msgpack: per job an array of id,
--       execution id, started (epoch s), heartbeat ttl (s).
-- Returns the number of jobs whose records were written.
if not EXECUTIONS then return 0 end  -- Settings.rq_executions off: none at all
local queue, worker, now = ARGV[5], ARGV[6], tonumber(ARGV[7])
local index = worker_key(worker) .. ':executions'
local written, created_ttl = 0, nil
if RQ3 then own(index, 'set') end
for _, job in ipairs(cmsgpack.unpack(ARGV[8])) do
  local id, execution, started, ttl = job[1], job[2], job[3], seconds(job[4], 60)
  if owns(queue, id, execution) then
    local composite = id .. ':' .. execution
    local ekey = PREFIX .. ':execution:' .. composite
    own(ekey, 'hash')
    local hset = {'HSET', ekey, 'id', execution, 'created_at', started, 'last_heartbeat', ARGV[7], 'worker_name', worker}
    if RQ3 then  -- RQ 3's execution names its job, and the worker indexes it
      hset[#hset + 1], hset[#hset + 2] = 'job_id', id
      redis.call('SADD', index, composite)
    end
    if redis.call(unpack(hset)) > 0 then created_ttl = ttl end
    redis.call('EXPIRE', ekey, ttl)
    local executions = PREFIX .. ':executions:' .. id
    write('ZADD', executions, math.floor(now) + ttl + 60, execution)
    redis.call('EXPIRE', executions, ttl + 60)
    written = written + 1
  end
end
-- The worker's index lives as RQ's prepare_job_execution leaves it where an execution was created
-- (the last such job's ttl), else as its heartbeat does (the worker's ttl, set beside this call).
-- (NX: where the index was made here, with no TTL yet).
if RQ3 and created_ttl then
  redis.call('EXPIRE', index, created_ttl)
elseif RQ3 and written > 0 then
  redis.call('EXPIRE', index, WORKER_TTL, 'NX')
end
return written

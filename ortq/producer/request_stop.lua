-- Ask the worker that runs a job to stop it (ortq.worker.stops): mark its hash while it is started.
-- keys: 1 the job hash   args: 1 the job's queue name (its origin), 2 now (epoch s)
-- Returns 1 when marked, 0 when the job is not started (or is no job of that queue: nothing written).
local job = keys[1]
if redis.call('TYPE', job)['ok'] ~= 'hash' then return 0 end
-- HGET, not HMGET: only commands producers are granted (docs/security.md).
if redis.call('HGET', job, 'origin') ~= args[1] or redis.call('HGET', job, 'status') ~= 'started' then return 0 end
redis.call('HSET', job, 'ortq_stop', args[2])
return 1

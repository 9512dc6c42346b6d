-- Ask the worker that runs a job to stop it (ortq.worker.stops): mark its hash while it is started.
-- keys: 1 the job hash   args: 1 the job's queue name (its origin), 2 the job's stop token (64
-- lowercase hex digits: SHA-256 of "stop", a newline and the job's proof, which only its producer can
-- make; its worker stops the job only for that token, whoever wrote the field)
-- Returns 1 when marked, 0 when the job is not started (or is no job of that queue: nothing written);
-- an error reply, writing nothing, when args[2] is no stop token.
local job, token = keys[1], args[2]
if #token ~= 64 or string.find(token, '[^0-9a-f]') then
  return redis.error_reply('ERR the stop mark must be the job\'s stop token: 64 lowercase hex digits')
end
if redis.call('TYPE', job)['ok'] ~= 'hash' then return 0 end
-- HGET, not HMGET: only commands producers are granted (docs/security.md).
if redis.call('HGET', job, 'origin') ~= args[1] or redis.call('HGET', job, 'status') ~= 'started' then return 0 end
redis.call('HSET', job, 'ortq_stop', token)
return 1

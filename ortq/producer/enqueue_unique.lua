-- Enqueue a job under an id its producer chose, unless a job of that id exists: never overwrite one.
-- keys: 1 the job hash, 2 the queue, 3 the model's last-high key
-- args: 1 job id, 2 request frame, 3 seconds it waits (<wait>), 4 seconds its hash lives until a
--       worker starts it, 5 'high' or 'normal', 6 the queue's name (the job's origin), 7 its request
--       key, 8 RQ's queue set, 9... the job hash's fields and values.
-- The request key and the queue set are arguments, not keys: Redis's ACL gives a function's
-- declared keys full access, and producers may only write request keys and the set
-- (docs/security.md); each command below is still checked against those rights.
-- Returns 1: enqueued; 0: a job of this id and this queue exists (queued, running, or answered: its
-- hash is there, and lives as long as its answer); -1: the id is another queue's job's, or its key
-- is no hash.
local job, queue, last_key = keys[1], keys[2], keys[3]
local id, frame, wait, hash_ttl, priority, origin = args[1], args[2], args[3], args[4], args[5], args[6]
local request, queues = args[7], args[8]
local job_type = redis.call('TYPE', job)['ok']
if job_type == 'hash' then
  if redis.call('HGET', job, 'origin') == origin then return 0 end
  return -1
elseif job_type ~= 'none' then
  return -1
end
local queue_type = redis.call('TYPE', queue)['ok']
if queue_type ~= 'list' and queue_type ~= 'none' then
  return redis.error_reply('WRONGTYPE the queue key ' .. queue .. ' holds a ' .. queue_type .. ', not a list')
end
-- The hash's fields checked before anything is written: an HSET refused after the frame's SET
-- would leave the frame behind (no field, an odd count, more values than unpack takes).
local values = #args - 8
if values < 2 or values % 2 ~= 0 or values > 7900 then
  return redis.error_reply('ERR the job hash needs 1 to 3950 field-value pairs, got ' .. values .. ' values')
end
redis.call('HSET', job, unpack(args, 9))
redis.call('EXPIRE', job, hash_ttl)
redis.call('SET', request, frame, 'EX', wait)
redis.call('SADD', queues, queue)
if priority == 'high' then
  enqueue_high({queue, last_key}, {id, wait})
else
  redis.call('RPUSH', queue, id)
end
return 1

-- Insert a high-priority job into its model's queue after the newest high-priority job still
-- waiting, or at the head when there is none: high-priority jobs run before every normal one and
-- first come first served among themselves, and the worker keeps one atomic BLMOVE on one list.
-- keys: 1 the queue, 2 the model's last-high key   args: 1 job id, 2 seconds the last-high key lives
-- A last-high key of the wrong type (not written by ortq) is ignored and overwritten (SET replaces
-- any type); a queue key of the wrong type is an error reply, as an RPUSH would give (the producer
-- then removes the rest of the job again, and workers replace that key), never a Lua error.
local queue, last_key = keys[1], keys[2]
local id, ttl = args[1], args[2]
local queue_type = redis.call('TYPE', queue)['ok']
if queue_type ~= 'list' and queue_type ~= 'none' then
  return redis.error_reply('WRONGTYPE the queue key ' .. queue .. ' holds a ' .. queue_type .. ', not a list')
end
local last = false
if redis.call('TYPE', last_key)['ok'] == 'string' and redis.call('STRLEN', last_key) <= 128 then
  last = redis.call('GET', last_key)
end
local placed = -1
if last then placed = redis.call('LINSERT', queue, 'AFTER', last, id) end
-- -1: the last high-priority job is no longer waiting; 0: the queue is empty (no list at all)
if placed <= 0 then redis.call('LPUSH', queue, id) end
redis.call('SET', last_key, id, 'EX', ttl)
return 1

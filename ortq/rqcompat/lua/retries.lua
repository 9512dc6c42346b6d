-- Move retries whose backoff has passed from RQ's scheduled registry back to the head of their
-- queue (what RQ's separate scheduler process would do), at most ARGV[7] per call. Atomic: of
-- several workers calling it, each job is moved once. Entries that are no scheduled job of ortq's
-- are removed.
-- ARGV: 5 queue name, 6 now (epoch s), 7 limit, 8 now (ISO)
local queue = ARGV[5]
local scheduled = PREFIX .. ':scheduled:' .. queue
local t = kind(scheduled)
if t ~= 'zset' then
  if t ~= 'none' then redis.call('DEL', scheduled) end
  return 0
end
local due = redis.call('ZRANGEBYSCORE', scheduled, '-inf', ARGV[6], 'LIMIT', 0, tonumber(ARGV[7]))
local list = queue_key(queue)
local moved = 0
for i = #due, 1, -1 do
  local id = due[i]
  redis.call('ZREM', scheduled, id)
  if #id <= 128 and string.match(id, '^[%w_%-]+$') and hget(job_key(id), 'status') == 'scheduled' then
    redis.call('HSET', job_key(id), 'status', 'queued', 'enqueued_at', ARGV[8])
    own(list, 'list')
    redis.call('LPUSH', list, id)
    moved = moved + 1
  end
end
return moved

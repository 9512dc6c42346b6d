-- Put back jobs stuck in the intermediate list: a BLMOVE whose reply was lost (Redis restarted,
-- the connection dropped) leaves its job there, still "queued", with no worker to start it. A job
-- seen at the head of the list on two calls at least ARGV[7] seconds apart goes back to the head of
-- its queue; entries that are no queued job (started, ended, expired, never a job) are removed.
-- Bounded: one call looks at the first ARGV[8] entries only and rebuilds just that part of the
-- list (LTRIM + LPUSH), so a list of any length costs each call the same; the next call reaches
-- the entries behind. The first-seen times live in a hash that is dropped when it grows past twice
-- that bound (forgetting them only delays a rescue).
-- ARGV: 5 queue name, 6 now (epoch s), 7 grace (s), 8 entries per call
-- Returns {rescued ids, entries removed, 1 if the head was full (call again soon) else 0}.
local queue, now, grace, limit = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local intermediate = queue_key(queue) .. ':intermediate'
local t = kind(intermediate)
if t ~= 'list' then
  if t ~= 'none' then redis.call('DEL', intermediate) end
  return {{}, 0, 0}
end
local seen_key = ORTQ .. 'first-seen:' .. queue
own(seen_key, 'hash')
if redis.call('HLEN', seen_key) > 2 * limit then redis.call('DEL', seen_key) end
local head = redis.call('LRANGE', intermediate, 0, limit - 1)
local keep, rescued = {}, {}
for _, id in ipairs(head) do
  local status = false
  if #id <= 128 and string.match(id, '^[%w_%-]+$') then status = hget(job_key(id), 'status') end
  -- A queued job here is either one whose start is on its way (start.lua removes it in the same
  -- call that marks it started) or one whose BLMOVE reply was lost: only time tells them apart.
  if status == 'queued' then
    local seen = number(redis.call('HGET', seen_key, id), nil)
    if not seen then
      redis.call('HSET', seen_key, id, ARGV[6])
      table.insert(keep, id)
    elseif now - seen >= grace then
      redis.call('HDEL', seen_key, id)
      table.insert(rescued, id)
    else
      table.insert(keep, id)
    end
  end
end
redis.call('LTRIM', intermediate, #head, -1)
for i = #keep, 1, -1 do redis.call('LPUSH', intermediate, keep[i]) end
if #rescued > 0 then
  local list = queue_key(queue)
  own(list, 'list')
  for i = #rescued, 1, -1 do redis.call('LPUSH', list, rescued[i]) end
end
redis.call('EXPIRE', seen_key, 3600)
local full = 0
if #head == limit then full = 1 end
return {rescued, #head - #keep - #rescued, full}

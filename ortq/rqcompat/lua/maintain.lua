-- RQ's registry maintenance for one queue, as RQ's clean_registries does it for the registries
-- ortq uses: finished, failed and canceled entries whose time has passed are removed. A queue key
-- or registry of the wrong type (not written by RQ or ortq) is removed, so that the worker's next
-- BLMOVE and scripts do not fail on it.
-- Bounded: at most ARGV[7] expired entries are removed from each registry per call (ZRANGEBYSCORE
-- with a LIMIT, then ZREM of those: O(log N + ARGV[7]), and no command beyond the worker's ACL rule
-- of docs/security.md), so that a registry filled with millions of expired entries (a producer may
-- ZADD to its model's canceled one) costs each call the same few milliseconds; the caller calls
-- again while the reply says there is more.
-- ARGV: 5 queue name, 6 now (epoch s), 7 entries removed at most per registry
-- Returns {names of the keys removed for their type, 1 when a registry may have more expired entries}.
local queue, limit = ARGV[5], tonumber(ARGV[7])
local removed, more = {}, 0
local function expect(key, want)
  local t = kind(key)
  if t ~= want and t ~= 'none' then
    redis.call('DEL', key)
    table.insert(removed, key)
    return false
  end
  return t == want
end
expect(queue_key(queue), 'list')
expect(queue_key(queue) .. ':intermediate', 'list')
expect(wip_key(queue), 'zset')
expect(PREFIX .. ':scheduled:' .. queue, 'zset')
for _, name in ipairs({'finished', 'failed', 'canceled'}) do
  local key = PREFIX .. ':' .. name .. ':' .. queue
  if expect(key, 'zset') then
    local due = redis.call('ZRANGEBYSCORE', key, '-inf', ARGV[6], 'LIMIT', 0, limit)
    if #due > 0 then each_chunk(redis.call, {'ZREM', key}, due) end
    if #due == limit then more = 1 end
  end
end
return {removed, more}

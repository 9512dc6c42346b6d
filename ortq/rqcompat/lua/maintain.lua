-- RQ's registry maintenance for one queue, as RQ's clean_registries does it for the registries
-- ortq uses: finished, failed and canceled entries whose time has passed are removed. A queue key
-- or registry of the wrong type (not written by RQ or ortq) is removed, so that the worker's next
-- BLMOVE and scripts do not fail on it. Work is linear in the entries removed.
-- ARGV: 5 queue name, 6 now (epoch s)
-- Returns the names of the keys removed for their type.
local queue = ARGV[5]
local removed = {}
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
  if expect(key, 'zset') then redis.call('ZREMRANGEBYSCORE', key, 0, ARGV[6]) end
end
return removed

-- Answer a queue entry that start.lua would not start because its record is no job (an id
-- outside RQ's rule, a job key that is not a hash), so that whoever waits on it learns why
-- instead of timing out. Nothing is started and no registry is touched; the record is left to
-- expire. The caller passes entries of at most 512 bytes; an empty error frame (an entry that is
-- not printable text, which no producer can wait on) only sets the expiry.
-- ARGV: 5 entry, 6 error frame or '', 7 failure ttl (s)
local id, ttl = ARGV[5], tonumber(ARGV[7])
if ARGV[6] ~= '' then
  answer(id, ARGV[6], ttl)
  redis.call('DEL', ORTQ .. 'req:' .. id)
end
local job = job_key(id)
if kind(job) == 'hash' then redis.call('HSET', job, 'status', 'failed') end
if kind(job) ~= 'none' then redis.call('EXPIRE', job, ttl) end
return 1

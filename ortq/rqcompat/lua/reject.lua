-- Answer a queue entry that start.lua would not start because its job key is no hash, so that
-- whoever waits on it learns why instead of timing out (start.lua checked that the entry is a job
-- id and that no reply exists: a job is answered once). Nothing is started and no registry is
-- touched; the job key is left to expire. An entry that is no job id gets nothing: no reply
-- stream is made for a name no producer could have enqueued.
-- ARGV: 5 queue name, 6 job id, 7 error frame, 8 failure ttl (s)
local queue, id, ttl = ARGV[5], ARGV[6], tonumber(ARGV[8])
if kind(reply_key(queue, id)) == 'stream' then return 0 end
answer(queue, id, ARGV[7], ttl)
redis.call('DEL', request_key(queue, id))
local job = job_key(id)
if kind(job) ~= 'none' then redis.call('EXPIRE', job, ttl) end
return 1

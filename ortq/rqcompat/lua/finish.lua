-- Reply to and finish several jobs: every reply (producers wait on them), then what RQ's
-- handle_job_success writes for each (job status, result stream, finished registry, TTLs, the end
-- of the execution), then the worker's counters once for the batch. Whatever RQ writes to one key
-- for every job (registries, deletions) is one call for the batch.
-- ARGV: 5 queue name, 6 worker name, 7 the worker's state afterwards ('' to leave it), 8 job count,
--       9 ended (RQ's ISO), 10 ended (epoch s), 11 the jobs, msgpack: per job an array of id,
--       execution id, ttl (s), working seconds, return value (base64 msgpack; '' writes no result
--       stream entry), started (epoch s), staged (1: its response frame waits in its stage stream,
--       written beside this call, and is renamed to its reply: a large frame never enters Lua,
--       whose strings Redis 7 hashes byte by byte); then 12... each job's response frame ('' when
--       staged). (One msgpack argument for a job's small values instead of seven: the worker's
--       Redis client packs each argument on its own, in Python.)
-- Returns the number of jobs answered (a job taken back meanwhile is not: fencing).
local queue, worker, n = ARGV[5], ARGV[6], tonumber(ARGV[8])
local ended_iso, ended_at = ARGV[9], ARGV[10]
local jobs = cmsgpack.unpack(ARGV[11])
local composites = {}
for j = 1, n do composites[j] = jobs[j][1] .. ':' .. jobs[j][2] end
-- Fencing: a job whose started entry is gone was taken back (its worker was thought dead) and
-- belongs to its next execution. A started registry of another type owns nothing.
local scores = {}
if n > 0 then scores = unless_acl(each_chunk(redis.pcall, {'ZMSCORE', wip_key(queue)}, composites), 'ZMSCORE') end
local function stage_key(j) return ORTQ .. 'stage:' .. composites[j] end
local live, gone, ekeys = {}, {}, {}
if type(scores) == 'table' and not scores.err then
  for j = 1, n do
    -- A staged answer that is gone (deleted by someone) leaves its job started, untouched: its
    -- worker takes it back as its own orphan and runs it again.
    local staged = jobs[j][7] == 1
    if scores[j] and type(scores[j]) ~= 'table' and (not staged or kind(stage_key(j)) == 'stream') then
      table.insert(live, j)
      local id = jobs[j][1]
      -- the reply key emptied (see answer; a staged answer's RENAME replaces it) and the request
      -- deleted: one DEL; the execution hashes: one DEL of their own, below
      if not staged then table.insert(gone, reply_key(queue, id)) end
      table.insert(gone, request_key(queue, id))
      if EXECUTIONS then table.insert(ekeys, PREFIX .. ':execution:' .. composites[j]) end
    end
  end
end
local answered = {}
for _, j in ipairs(live) do
  answered[j] = true
  -- Staged answers first, before anything is written: a RENAME the ACL refuses (a worker rule
  -- from before +rename) then ends the call having changed nothing.
  if jobs[j][7] == 1 then redis.call('RENAME', stage_key(j), reply_key(queue, jobs[j][1])) end
end
for j = 1, n do  -- the stages of answers this call does not post (taken back meanwhile)
  if jobs[j][7] == 1 and not answered[j] then table.insert(gone, stage_key(j)) end
end
if #gone > 0 then each_chunk(redis.call, {'DEL'}, gone) end
-- RQ's execution records exist only for jobs a heartbeat saw running (executions.lua): a batch
-- that had none (most of short jobs') leaves the jobs' executions and the worker's index alone.
local recorded = 0
if #ekeys > 0 then recorded = each_chunk(redis.call, {'DEL'}, ekeys) end
local working, finished, index = 0, {}, {}
local ended_whole = math.floor(tonumber(ended_at))
for _, j in ipairs(live) do
  local id, execution, ttl, spent, value, started_at, staged = unpack(jobs[j])
  if staged == 1 then  -- renamed above: the whole stream, its one entry, no byte copied
    redis.call('EXPIRE', reply_key(queue, id), ttl)
  else
    post(queue, id, ARGV[11 + j], ttl)
  end
  local job = job_key(id)
  local set = redis.pcall('HSET', job, 'status', 'finished', 'ended_at', ended_iso)
  if type(set) ~= 'table' then redis.call('EXPIRE', job, ttl) end  -- an error: no job hash to keep
  working = working + tonumber(spent)
  if value ~= '' then
    local results = PREFIX .. ':results:' .. id
    write('XADD', results, 'MAXLEN', '~', '10', '*', 'type', '1', 'worker_name', worker,
          'return_value', value, 'execution_id', execution,
          'execution_started_at', started_at, 'execution_ended_at', ended_at)
    redis.call('EXPIRE', results, ttl)
  end
  table.insert(finished, ended_whole + ttl)
  table.insert(finished, id)
  table.insert(index, composites[j])
  if recorded > 0 then remove('ZREM', PREFIX .. ':executions:' .. id, execution) end
end
if #live > 0 then
  -- What RQ writes per job, written once for the batch.
  each_chunk(write, {'ZADD', PREFIX .. ':finished:' .. queue}, finished)
  each_chunk(remove, {'ZREM', wip_key(queue)}, index)
  if RQ3 and recorded > 0 then each_chunk(remove, {'SREM', worker_key(worker) .. ':executions'}, index) end
end
worker_done(worker, 'successful_job_count', #live, working, ARGV[7])
return #live

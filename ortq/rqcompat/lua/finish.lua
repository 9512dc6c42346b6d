-- Answer and finish several jobs: every answer (producers wait on them: an entry in the reply
-- stream each job's hash names, read by start.lua and handed in here), then what RQ's
-- handle_job_success writes for each (job status, result stream, finished registry, TTLs, the end
-- of the execution), then the worker's counters once for the batch. Whatever RQ writes to one key
-- for every job (registries, deletions) is one call for the batch.
-- Arguments: contract.SCRIPT_ARGS['finish'], then contract.FINISH_JOB's values per job, read from
-- ARGV where they are (no table per job, no msgpack to decode). A staged job (frame '') has its
-- response frame in its stage stream, written beside this call, and renamed to its large reply key
-- (its entry in the reply stream has an empty frame): a large frame never enters Lua, whose
-- strings Redis 7 hashes byte by byte.
-- Returns the number of jobs answered (a job taken back meanwhile is not: fencing).
local queue, worker, n = A.queue, A.worker, tonumber(A.count)
local ended_iso, ended_at = A.ended_iso, A.ended_at
local moments = A.moments_at - 1  -- ARGV[moments + 2m - 1], ARGV[moments + 2m]: moment m's pair
local base = A.moments_at + 2 * tonumber(A.moment_count) - 1  -- job j's values: ARGV[base + FINISH_JOB * (j - 1) + i]
local model = model_of(queue)
local reply_prefix, request_prefix, stage_prefix = K.reply .. model .. ':', K.request .. model .. ':', K.stage
local job_prefix, results_prefix = PREFIX .. ':job:', PREFIX .. ':results:'
local composites = {}
for j = 1, n do
  local at = base + FINISH_JOB * (j - 1)
  composites[j] = ARGV[at + 1] .. ':' .. ARGV[at + 2]
end
-- Fencing: a job whose started entry is gone was taken back (its worker was thought dead) and
-- belongs to its next execution. A started registry of another type owns nothing.
local scores = {}
if n > 0 then scores = unless_acl(each_chunk(redis.pcall, {'ZMSCORE', wip_key(queue)}, composites), 'ZMSCORE') end
local live, nl, gone, ng, ekeys = {}, 0, {}, 0, {}
local staged_any = false
if type(scores) == 'table' and not scores.err then
  for j = 1, n do
    local at = base + FINISH_JOB * (j - 1)
    -- A staged answer that is gone (deleted by someone) leaves its job started, untouched: its
    -- worker takes it back as its own orphan and runs it again.
    local staged = ARGV[at + 6] == ''
    if staged then staged_any = true end
    local score = scores[j]
    if score and type(score) ~= 'table' and (not staged or kind(stage_prefix .. composites[j]) == 'stream') then
      nl = nl + 1
      live[nl] = j
      local id = ARGV[at + 1]
      -- the requests deleted: one DEL; the execution hashes: one DEL of their own, below
      gone[ng + 1] = request_prefix .. id
      ng = ng + 1
      if EXECUTIONS then ekeys[#ekeys + 1] = PREFIX .. ':execution:' .. composites[j] end
    end
  end
end
if staged_any then
  local answered = {}
  for i = 1, nl do
    local j = live[i]
    local at = base + FINISH_JOB * (j - 1)
    answered[j] = true
    -- Staged answers first, before anything is written: a RENAME the ACL refuses (a worker rule
    -- from before +rename) then ends the call having changed nothing.
    if ARGV[at + 6] == '' then
      local large = reply_prefix .. ARGV[at + 1]
      redis.call('RENAME', stage_prefix .. composites[j], large)
      redis.call('EXPIRE', large, ARGV[at + 8] ~= '0' and ARGV[at + 8] or ARGV[at + 3])
    end
  end
  for j = 1, n do  -- the stages of answers this call does not post (taken back meanwhile)
    if ARGV[base + FINISH_JOB * (j - 1) + 6] == '' and not answered[j] then
      ng = ng + 1
      gone[ng] = stage_prefix .. composites[j]
    end
  end
end
if ng > 0 then each_chunk(redis.call, {'DEL'}, gone) end
-- RQ's execution records exist only for jobs a heartbeat saw running (executions.lua): a batch
-- that had none (most of short jobs') leaves the jobs' executions and the worker's index alone.
local recorded = 0
if #ekeys > 0 then recorded = each_chunk(redis.call, {'DEL'}, ekeys) end
local working, finished, index = 0, {}, {}
-- The reply streams answered in (most batches: one, their producer's), each expired once below.
local streams, keeps, minids = {}, {}, {}
local ended_whole = math.floor(tonumber(ended_at))
for i = 1, nl do
  local j = live[i]
  local at = base + FINISH_JOB * (j - 1)
  local id, execution, ttl, m, value, frame = ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4], ARGV[at + 5], ARGV[at + 6]
  local name, keep = ARGV[at + 7], ARGV[at + 8]
  local job = job_prefix .. id
  local set
  if name ~= '' then
    local stream = streams[name]
    if not stream then
      stream = reply_prefix .. name
      streams[name], keeps[stream], minids[stream] = stream, keep, oldest_kept(tonumber(ended_at), keep)
    end
    -- a staged answer was renamed above (the whole stream, its one entry, no byte copied): its
    -- entry here has an empty frame
    local entry = post(stream, minids[stream], id, frame)
    set = redis.pcall('HSET', job, 'status', 'finished', 'ended_at', ended_iso, 'ortq_answer', entry)
  else  -- its hash names no reply stream: answered nowhere
    set = redis.pcall('HSET', job, 'status', 'finished', 'ended_at', ended_iso)
  end
  if type(set) ~= 'table' then
    redis.call('EXPIRE', job, ttl)
  else  -- an error: no job hash to keep, unless it is the ACL's
    unless_acl(set, 'HSET')
  end
  local pair = moments + 2 * tonumber(m)
  working = working + tonumber(ARGV[pair - 1])
  if value ~= '' then
    local results = results_prefix .. id
    write('XADD', results, 'MAXLEN', '~', '10', '*', 'type', '1', 'worker_name', worker, 'return_value', value,
          'execution_id', execution, 'execution_started_at', ARGV[pair], 'execution_ended_at', ended_at)
    redis.call('EXPIRE', results, ttl)
  end
  finished[2 * i - 1] = ended_whole + tonumber(ttl)
  finished[2 * i] = id
  index[i] = composites[j]
  if recorded > 0 then remove('ZREM', PREFIX .. ':executions:' .. id, execution) end
end
for stream, keep in pairs(keeps) do redis.call('EXPIRE', stream, keep) end
if nl > 0 then
  -- What RQ writes per job, written once for the batch.
  each_chunk(write, {'ZADD', PREFIX .. ':finished:' .. queue}, finished)
  each_chunk(remove, {'ZREM', wip_key(queue)}, index)
  if RQ3 and recorded > 0 then each_chunk(remove, {'SREM', worker_key(worker) .. ':executions'}, index) end
end
worker_done(worker, 'successful_job_count', nl, working, A.state)
return nl

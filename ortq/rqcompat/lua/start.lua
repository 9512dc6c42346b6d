-- Start the job ARGV[11] (already moved to the intermediate list by BLMOVE) and pop and start up
-- to ARGV[10] more from the queue, in order: RQ's "started" records for each (execution, started
-- registry, worker hash, job hash), as RQ's prepare_execution + prepare_job_execution write them.
-- ARGV: 5 queue name, 6 worker name, 7 now (epoch s), 8 now (RQ's ISO), 9 heartbeat TTL of a job
--       without a timeout (s), 10 how many more, 11 first id, 12... one fresh execution id per job.
-- Returns {started, skipped}: started = {id, execution, {field values}, oversized field or '',
-- heartbeat ttl, request frame size (-1: no request key, -2: not a string)} per job;
-- skipped = {entry (cut to 200 bytes), reason} per queue entry not started.
-- Work per call is linear in the jobs it takes; the intermediate list is searched from its tail,
-- where BLMOVE and LMOVE put each id.
local queue_name, worker = ARGV[5], ARGV[6]
local now, now_iso, default_ttl = tonumber(ARGV[7]), ARGV[8], tonumber(ARGV[9])
local queue = queue_key(queue_name)
local intermediate = queue .. ':intermediate'
local wip = wip_key(queue_name)
local wkey = worker_key(worker)
-- The job hash fields ortq reads (never HGETALL: a forged hash may have millions of fields).
local FIELDS = {'status', 'data', 'enqueued_at', 'created_at', 'timeout', 'ttl', 'result_ttl', 'failure_ttl',
                'retries_left', 'retry_intervals', 'success_callback_name', 'failure_callback_name',
                'stopped_callback_name', 'ortq_recoveries', 'origin'}
local MAX_FIELD = 65536
-- RQ's statuses of a job that is running, has ended, or waits somewhere other than the queue.
local ELSEWHERE = {started = true, finished = true, failed = true, stopped = true, canceled = true,
                   scheduled = true, deferred = true, rate_limited = true, ready_to_enqueue = true}
local started, skipped = {}, {}

local function skip(id, why)
  table.insert(skipped, {string.sub(id, 1, 200), why})
end

local function start(id, execution)
  if kind(intermediate) == 'list' then redis.call('LREM', intermediate, -1, id) end
  if #id > 128 or not string.match(id, '^[%w_%-]+$') then return skip(id, 'id') end
  local job = job_key(id)
  local t = kind(job)
  if t == 'none' then return skip(id, 'gone') end  -- expired while it waited: RQ skips it too
  if t ~= 'hash' then return skip(id, 'type:' .. t) end
  local status = redis.call('HGET', job, 'status')
  -- A job that RQ's status says runs, ran or waits elsewhere is not started: this is a second queue
  -- entry of it (pushed twice), and starting it again would answer it twice. Any other status
  -- (queued, none, or no status of RQ's at all) starts, and the job is answered.
  if status and ELSEWHERE[status] then return skip(id, 'status:' .. status) end
  local values, oversized = {}, ''
  for i, field in ipairs(FIELDS) do
    if redis.call('HSTRLEN', job, field) > MAX_FIELD then
      values[i] = false
      oversized = field
    else
      values[i] = redis.call('HGET', job, field)
    end
  end
  -- RQ's SimpleWorker.get_heartbeat_ttl: the job's timeout + 60 s, else its default
  local timeout = number(values[5], 0)
  local ttl = default_ttl
  if timeout > 0 then ttl = math.ceil(math.min(timeout, YEAR)) + 60 end
  local composite = id .. ':' .. execution
  local ekey = PREFIX .. ':execution:' .. composite
  redis.call('DEL', ekey)
  if RQ3 then
    redis.call('HSET', ekey, 'id', execution, 'job_id', id, 'created_at', ARGV[7], 'last_heartbeat', ARGV[7],
               'worker_name', worker)
  else
    redis.call('HSET', ekey, 'id', execution, 'created_at', ARGV[7], 'last_heartbeat', ARGV[7], 'worker_name', worker)
  end
  redis.call('EXPIRE', ekey, ttl)
  local executions = PREFIX .. ':executions:' .. id
  own(executions, 'zset')
  redis.call('ZADD', executions, math.floor(now) + ttl + 60, execution)
  redis.call('EXPIRE', executions, ttl + 60)
  own(wip, 'zset')
  redis.call('ZADD', wip, math.floor(now) + ttl, composite)
  if RQ3 then
    local index = wkey .. ':executions'
    own(index, 'set')
    redis.call('SADD', index, composite)
    -- Execution.create gives it ttl + 60, then the worker heartbeat of prepare_job_execution ttl
    redis.call('EXPIRE', index, ttl)
  end
  if kind(wkey) == 'hash' then
    redis.call('HSET', wkey, 'state', 'busy', 'last_heartbeat', now_iso)
    if not RQ3 then redis.call('HSET', wkey, 'current_job', id, 'current_job_working_time', '0') end
    redis.call('EXPIRE', wkey, ttl)
  end
  redis.call('HSET', job, 'last_heartbeat', now_iso, 'status', 'started', 'started_at', now_iso, 'worker_name', worker)
  redis.call('PERSIST', job)
  local request = ORTQ .. 'req:' .. id
  local request_type, size = kind(request), -1
  if request_type == 'string' then size = redis.call('STRLEN', request) elseif request_type ~= 'none' then size = -2 end
  table.insert(started, {id, execution, values, oversized, ttl, size})
end

start(ARGV[11], ARGV[12])
local more = tonumber(ARGV[10])
if more > 0 and kind(queue) == 'list' then
  own(intermediate, 'list')
  for i = 1, more do
    local id = redis.call('LMOVE', queue, intermediate, 'LEFT', 'RIGHT')
    if not id then break end
    start(id, ARGV[12 + i])
  end
end
return {started, skipped}

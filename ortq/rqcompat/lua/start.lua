-- Start the job ARGV[12] (already moved to the intermediate list by BLMOVE) and pop and start up
-- to ARGV[10] more from the queue, in order: RQ's "started" records for each (started registry,
-- worker hash, job hash), as RQ's prepare_execution + prepare_job_execution write them; RQ's
-- execution records (Settings.rq_executions) follow at the worker's next heartbeat (executions.lua).
-- With ARGV[12] empty, pop up to ARGV[10] jobs from the queue and start them, no BLMOVE before: a
-- worker whose last start left a backlog takes the next batch in one round trip.
-- ARGV: 5 queue name, 6 worker name, 7 now (epoch s), 8 now (RQ's ISO), 9 heartbeat TTL of a job
--       without a timeout (s), 10 how many more, 11 largest frame returned inline (bytes), 12 first
--       id, 13 the fresh execution ids of every job this call may start, 32 hex digits each, joined,
--       14 the version of the model the worker serves ('': none), 15 seconds a parked list lives.
-- Returns {started, skipped, left}: started = {id, execution, {field values} (or {enqueued_at} when
-- every other value is the previous started job's: a producer's jobs differ in that one), oversized field or '',
-- heartbeat ttl, request frame size (-1: no request key, -2: not a string), the frame itself when
-- no larger than ARGV[11] and not ARGV[12]'s (read beside the call), else false} per job;
-- skipped = {entry (cut to 200 bytes), reason} per queue entry not started; left = the queue's
-- length after the call (its backlog).
-- Not started (skipped, and left as they are): an entry that is no job id; a job whose reply exists
-- ('answered': a job is answered once, and an id pushed again, whatever its record now says, is a
-- replay); a job whose record is gone or no hash; one whose status says it runs, ran or waits
-- elsewhere; one whose `origin` is another queue (pushed onto this model's queue by someone else:
-- it is its own model's workers' to run); a job pinned to another version of the model than ARGV[14]
-- ('parked': its id goes to ortq:parked:<model>@<its version>, which workers of that version take
-- from, before the queue, at every start).
-- Work per call is linear in the jobs it takes; the intermediate list is searched from its tail,
-- where BLMOVE put the first id.
local queue_name, worker = ARGV[5], ARGV[6]
local now, now_iso, default_ttl, inline = tonumber(ARGV[7]), ARGV[8], tonumber(ARGV[9]), tonumber(ARGV[11])
local queue = queue_key(queue_name)
local intermediate = queue .. ':intermediate'
local wip = wip_key(queue_name)
local wkey = worker_key(worker)
-- The job hash fields ortq reads, in book.JOB_FIELDS' order; never HGETALL (a forged hash may have
-- millions of fields), and each field's size checked first (one may be hundreds of MB).
local FIELDS = {'status', 'data', 'enqueued_at', 'timeout', 'ttl', 'result_ttl', 'failure_ttl', 'retries_left',
                'retry_intervals', 'success_callback_name', 'failure_callback_name', 'stopped_callback_name',
                'origin', 'ortq_version'}
local ORIGIN, PIN = 13, 14
local version, parked_ttl = ARGV[14], tonumber(ARGV[15])
local parked_prefix = ORTQ .. 'parked:' .. model_of(queue_name) .. '@'
local mine = nil
if version ~= '' then mine = parked_prefix .. version end
local MAX_FIELD = 65536
-- RQ's statuses of a job that is running, has ended, or waits somewhere other than the queue.
local ELSEWHERE = {started = true, finished = true, failed = true, stopped = true, canceled = true,
                   scheduled = true, deferred = true, rate_limited = true, ready_to_enqueue = true}
local started, skipped = {}, {}
-- The registries every job of this call is added to: checked once here, and written once for all
-- of them at the end (one call each, not one a job).
own(wip, 'zset')
local longest, wip_entries = 0, {}

local function skip(id, why)
  table.insert(skipped, {string.sub(id, 1, 200), why})
end

-- Leave a job pinned to another version for that version's workers (a key of another type there is
-- no one's: it is replaced).
local function park(id, pin)
  if #pin > 64 or not string.match(pin, '^[%w][%w_%.%-]*$') then return skip(id, 'pin') end
  local key = parked_prefix .. pin
  local t = kind(key)
  if t ~= 'list' and t ~= 'none' then redis.call('DEL', key) end
  redis.call('RPUSH', key, id)
  redis.call('EXPIRE', key, parked_ttl)
  return skip(id, 'parked')
end

local first = ARGV[12]
local reply_prefix, request_prefix = reply_key(queue_name, ''), request_key(queue_name, '')
local large = false  -- whether the last job's request frame was over ARGV[11]

-- The field values of the job started last (not oversized), and whether `values` equal them in
-- all but enqueued_at (FIELDS[3]). Lua's strings are interned: each comparison is one pointer's.
local previous = nil
local function as_previous(values)
  if previous == nil then return false end
  for i = 1, #FIELDS do
    if i ~= 3 and values[i] ~= previous[i] then return false end
  end
  return true
end

local function start(id, execution)
  if #id > 128 or not string.match(id, '^[%w_%-]+$') then return skip(id, 'id') end
  -- Answered already: its reply stream is there (a key of another type is none of ortq's: the
  -- answer replaces it).
  if kind(reply_prefix .. id) == 'stream' then return skip(id, 'answered') end
  local job = PREFIX .. ':job:' .. id
  -- The job's encoding stands for its TYPE on the common path (one call fewer a job): none for no
  -- key, and a compact one (listpack or ziplist: what an ortq job's hash is) reports its exact
  -- size, so one check covers every field; the HMGET then says whether it is a hash. Any other
  -- encoding has its TYPE read, and a hash of it each field ortq reads checked on its own.
  local encoding = redis.call('OBJECT', 'ENCODING', job)
  if not encoding then return skip(id, 'gone') end  -- expired while it waited: RQ skips it too
  local oversized = ''
  local compact = (encoding == 'listpack' or encoding == 'ziplist')
  if not (compact and redis.call('MEMORY', 'USAGE', job) <= MAX_FIELD) then
    local t = kind(job)
    if t ~= 'hash' then return skip(id, 'type:' .. t) end
    for _, field in ipairs(FIELDS) do
      if redis.call('HSTRLEN', job, field) > MAX_FIELD then oversized = field end
    end
  end
  local values, status, origin = {}, false, false
  if oversized == '' then
    values = unless_acl(redis.pcall('HMGET', job, unpack(FIELDS)), 'HMGET')
    if values.err then return skip(id, 'type:' .. kind(job)) end  -- a compact zset or list
    status, origin = values[1], values[ORIGIN]
  else
    if oversized ~= 'status' then status = redis.call('HGET', job, 'status') end
    if oversized ~= 'origin' then origin = redis.call('HGET', job, 'origin') end
  end
  -- A job that RQ's status says runs, ran or waits elsewhere is not started: this is a second queue
  -- entry of it (pushed twice), and starting it again would answer it twice. Any other status
  -- (queued, none, or no status of RQ's at all) starts, and the job is answered.
  if status and ELSEWHERE[status] then return skip(id, 'status:' .. status) end
  if origin ~= queue_name then return skip(id, 'origin') end
  local pin = values[PIN]
  if pin and mine and pin ~= version then return park(id, pin) end
  -- RQ's SimpleWorker.get_heartbeat_ttl: the job's timeout + 60 s, else its default
  local timeout = number(values[4], 0)
  local ttl = default_ttl
  if timeout > 0 then ttl = math.ceil(math.min(timeout, YEAR)) + 60 end
  longest = math.max(longest, ttl)
  -- RQ's execution records (Settings.rq_executions) are not written here but at the worker's
  -- heartbeats, for the jobs it still holds then (executions.lua).
  table.insert(wip_entries, math.floor(now) + ttl)
  table.insert(wip_entries, id .. ':' .. execution)
  redis.call('HSET', job, 'last_heartbeat', now_iso, 'status', 'started', 'started_at', now_iso, 'worker_name', worker)
  redis.call('PERSIST', job)
  local request = request_prefix .. id
  -- A small frame comes back here, saving a round trip; ARGV[12]'s (first) is read beside this call,
  -- and large ones by GETRANGE (a script's reply copies every byte). A frame is read at once with
  -- one GETRANGE of ARGV[11] bytes and one more (more: it is large, and only its size is returned),
  -- unless the last job's was large: then its size is read first, as for the first job.
  local frame, size = false, nil
  if (first == '' or #started > 0) and inline > 0 and not large then
    local got = unless_acl(redis.pcall('GETRANGE', request, 0, inline), 'GETRANGE')
    if type(got) == 'table' then size = -2 elseif #got <= inline then size, frame = #got, got end
  end
  if size == nil then
    size = unless_acl(redis.pcall('STRLEN', request), 'STRLEN')
    if type(size) == 'table' then size = -2 end
  end
  if size == 0 and redis.call('EXISTS', request) == 0 then size, frame = -1, false end
  large = size > inline
  local sent = values
  if oversized == '' then
    if as_previous(values) then sent = {values[3]} end
    previous = values
  end
  table.insert(started, {id, execution, sent, oversized, ttl, size, frame})
end

-- The first job was moved to the intermediate list by BLMOVE: off it again (from its tail, where
-- BLMOVE put it). The others are popped here, in the same atomic call: no list in between.
local function execution_id(i) return string.sub(ARGV[13], 32 * i + 1, 32 * i + 32) end
local popped = 0
if first ~= '' then
  if kind(intermediate) == 'list' then redis.call('LREM', intermediate, -1, first) end
  start(first, execution_id(0))
  popped = 1
end
local more, left = tonumber(ARGV[10]), 0
-- Jobs parked for this worker's version waited longest: they go first.
if mine and kind(mine) == 'list' then
  if more > 0 then
    local parked = redis.call('LPOP', mine, more) or {}
    for i, id in ipairs(parked) do start(id, execution_id(popped + i - 1)) end
    popped, more = popped + #parked, more - #parked
  end
  left = redis.call('LLEN', mine)
end
if kind(queue) == 'list' then
  if more > 0 then
    for i, id in ipairs(redis.call('LPOP', queue, more) or {}) do start(id, execution_id(popped + i - 1)) end
  end
  left = left + redis.call('LLEN', queue)
end
if #wip_entries > 0 then each_chunk(redis.call, {'ZADD', wip}, wip_entries) end
if #started > 0 and kind(wkey) == 'hash' then
  -- The worker hash as RQ leaves it when a job starts (for a batch: its first job).
  redis.call('HSET', wkey, 'state', 'busy', 'last_heartbeat', now_iso)
  if not RQ3 then redis.call('HSET', wkey, 'current_job', started[1][1], 'current_job_working_time', '0') end
  redis.call('EXPIRE', wkey, longest)
end
return {started, skipped, left}

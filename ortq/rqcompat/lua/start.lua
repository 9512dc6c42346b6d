-- Start the job A.first (already moved to the intermediate list by BLMOVE) and pop and start up
-- to A.more more from the queue, in order: RQ's "started" records for each (started registry,
-- worker hash, job hash), as RQ's prepare_execution + prepare_job_execution write them; RQ's
-- execution records (Settings.rq_executions) follow at the worker's next heartbeat (executions.lua).
-- With A.first empty, pop up to A.more jobs from the queue and start them, no BLMOVE before: a
-- worker whose last start left a backlog takes the next batch in one round trip.
-- Arguments and the reply's layout: contract.SCRIPT_ARGS['start'], START_HEAD and START_JOB. The
-- reply is one flat array (no table per job: building nested replies was a large part of this
-- script's time), entries cut to 200 bytes in the skipped pairs.
-- Not started (skipped, and left as they are): an entry that is no job id; a job in this queue's
-- finished or failed registry ('answered': a job is answered once, and an id pushed again,
-- whatever its record now says, is a replay; workers alone write those registries, one ZMSCORE
-- each for all the jobs of a call); a job whose record is gone or no hash; one whose status says it runs, ran or waits
-- elsewhere; one whose `origin` is another queue (pushed onto this model's queue by someone else:
-- it is its own model's workers' to run); a job pinned to another version of the model than A.version
-- ('parked': its id goes to ortq:parked:<model>@<its version>, which workers of that version take
-- from, before the queue, at every start).
-- Work per call is linear in the jobs it takes; the intermediate list is searched from its tail,
-- where BLMOVE put the first id.
local queue_name, worker, first = A.queue, A.worker, A.first
local now, now_iso, default_ttl, inline = tonumber(A.now), A.now_iso, tonumber(A.default_ttl), tonumber(A.inline)
local executions = A.executions
local queue = queue_key(queue_name)
local wip = wip_key(queue_name)
local wkey = worker_key(worker)
local model = model_of(queue_name)
local version, parked_ttl = A.version, tonumber(A.parked_ttl)
local parked_prefix = K.parked .. model .. '@'
local mine = nil
if version ~= '' then mine = parked_prefix .. version end
local job_prefix = PREFIX .. ':job:'
local request_prefix = K.request .. model .. ':'
local F_STATUS, F_ENQUEUED, F_TIMEOUT, F_ORIGIN, F_PIN = F.status, F.enqueued_at, F.timeout, F.origin, F.ortq_version
local NFIELDS = #FIELDS
-- Never HGETALL (a forged hash may have millions of fields), and each field's size bounded first
-- (one may be hundreds of MB).
local MAX_FIELD = 65536
-- RQ's statuses of a job that is running, has ended, or waits somewhere other than the queue.
local ELSEWHERE = {started = true, finished = true, failed = true, stopped = true, canceled = true,
                   scheduled = true, deferred = true, rate_limited = true, ready_to_enqueue = true}
-- The reply: START_HEAD's two values are set at the end; skipped pairs and started jobs are
-- gathered apart and joined then.
local jobs, nj, skipped, ns = {}, 0, {}, 0
local count = 0  -- jobs started
-- The registries every job of this call is added to: checked once here, and written once for all
-- of them at the end (one call each, not one a job).
own(wip, 'zset')
local longest, wip_entries, nw = 0, {}, 0

local function skip(id, why)
  skipped[ns + 1] = string.sub(id, 1, 200)
  skipped[ns + 2] = why
  ns = ns + 2
end

-- A parked list lives as long as the longest-lived request of the jobs parked in it, never longer:
-- each park raises its expiry to that job's request's (at most parked_ttl), never re-arms it to a
-- full parked_ttl, so a list that nobody takes from is gone once every job in it could no longer
-- run. Jobs at its head whose request is gone (expired, or cancelled) are dropped at each park (up
-- to PARKED_LOOKED of them): a list kept alive by a park a day holds no job that cannot run.
-- `parked_versions` (a set) names the versions that have a parked list, for readers (ortq info,
-- the exporter), which may not SCAN; it lives as long as its longest-lived list.
local PARKED_LOOKED = 16
local parked_versions = K.parked .. model

local function expire_at_least(key, seconds)
  if redis.call('TTL', key) < seconds then redis.call('EXPIRE', key, seconds) end
end

-- Seconds the job's request still lives (its wait left), within 1 and parked_ttl; one without an
-- expiry (no ortq producer writes that) counts as parked_ttl.
local function request_life(id)
  local left = redis.call('TTL', request_prefix .. id)
  if left == -1 then left = parked_ttl end
  return math.max(1, math.min(left, parked_ttl))
end

local function drop_expired_head(key)
  local gone = 0
  for _, id in ipairs(redis.call('LRANGE', key, 0, PARKED_LOOKED - 1)) do
    if #id <= 128 and redis.call('EXISTS', request_prefix .. id) == 1 then break end
    gone = gone + 1
  end
  if gone > 0 then redis.call('LPOP', key, gone) end
end

-- Name `pin` among the versions with a parked list, and forget a few whose list is gone.
local function note_parked_version(pin, life)
  own(parked_versions, 'set')
  redis.call('SADD', parked_versions, pin)
  for _, other in ipairs(redis.call('SRANDMEMBER', parked_versions, 4)) do
    if redis.call('EXISTS', parked_prefix .. other) == 0 then redis.call('SREM', parked_versions, other) end
  end
  expire_at_least(parked_versions, life)
end

-- Leave a job pinned to another version for that version's workers (a key of another type there is
-- no one's: it is replaced).
local function park(id, pin)
  if #pin > 64 or not string.match(pin, '^[%w][%w_%.%-]*$') then return skip(id, 'pin') end
  local key = parked_prefix .. pin
  own(key, 'list')
  drop_expired_head(key)
  redis.call('RPUSH', key, id)
  local life = request_life(id)
  expire_at_least(key, life)
  note_parked_version(pin, life)
  return skip(id, 'parked')
end

local large = false  -- whether the last job's request frame was over A.inline
-- The field values of the job started last (not oversized). Lua's strings are interned: each
-- comparison is one pointer's.
local previous = nil

local function start(id, k)
  if #id > 128 or string.find(id, '[^%w_%-]') or id == '' then return skip(id, 'id') end
  local job = job_prefix .. id
  -- The job's encoding stands for its TYPE on the common path (one call fewer a job): none for no
  -- key, and a compact one (listpack or ziplist: what an ortq job's hash is) reports its exact
  -- size, so one check covers every field; the HMGET then says whether it is a hash. Any other
  -- encoding has its TYPE read, and a hash of it each field ortq reads checked on its own.
  local encoding = redis.call('OBJECT', 'ENCODING', job)
  if not encoding then return skip(id, 'gone') end  -- expired while it waited: RQ skips it too
  local oversized = ''
  if not ((encoding == 'listpack' or encoding == 'ziplist') and redis.call('MEMORY', 'USAGE', job) <= MAX_FIELD) then
    local t = kind(job)
    if t ~= 'hash' then return skip(id, 'type:' .. t) end
    for _, field in ipairs(FIELDS) do
      if redis.call('HSTRLEN', job, field) > MAX_FIELD then oversized = field end
    end
  end
  local values, status, origin = nil, false, false
  if oversized == '' then
    values = redis.pcall('HMGET', job, unpack(FIELDS))
    if values.err then
      unless_acl(values, 'HMGET')
      return skip(id, 'type:' .. kind(job))  -- a compact zset or list
    end
    status, origin = values[F_STATUS], values[F_ORIGIN]
  else
    if oversized ~= 'status' then status = redis.call('HGET', job, 'status') end
    if oversized ~= 'origin' then origin = redis.call('HGET', job, 'origin') end
  end
  -- A job that RQ's status says runs, ran or waits elsewhere is not started: this is a second queue
  -- entry of it (pushed twice), and starting it again would answer it twice. Any other status
  -- (queued, none, or no status of RQ's at all) starts, and the job is answered.
  if status and ELSEWHERE[status] then return skip(id, 'status:' .. status) end
  if origin ~= queue_name then return skip(id, 'origin') end
  local ttl = default_ttl
  if values then
    local pin = values[F_PIN]
    if pin and mine and pin ~= version then return park(id, pin) end
    -- RQ's SimpleWorker.get_heartbeat_ttl: the job's timeout + 60 s, else its default
    local timeout = number(values[F_TIMEOUT], 0)
    if timeout > 0 then ttl = math.ceil(math.min(timeout, YEAR)) + 60 end
  end
  if ttl > longest then longest = ttl end
  -- RQ's execution records (Settings.rq_executions) are not written here but at the worker's
  -- heartbeats, for the jobs it still holds then (executions.lua).
  local execution = string.sub(executions, 32 * k + 1, 32 * k + 32)
  wip_entries[nw + 1] = math.floor(now) + ttl
  wip_entries[nw + 2] = id .. ':' .. execution
  nw = nw + 2
  redis.call('HSET', job, 'last_heartbeat', now_iso, 'status', 'started', 'started_at', now_iso, 'worker_name', worker)
  redis.call('PERSIST', job)
  local request = request_prefix .. id
  -- A small frame comes back here, saving a round trip; A.first's is read beside this call, and
  -- large ones by GETRANGE (a script's reply copies every byte). A frame is read at once with one
  -- GETRANGE of A.inline bytes and one more (more: it is large, and only its size is returned),
  -- unless the last job's was large: then its size is read first, as for the first job.
  local frame, size = false, nil
  if (first == '' or count > 0) and inline > 0 and not large then
    local got = redis.pcall('GETRANGE', request, 0, inline)
    if type(got) == 'table' then
      unless_acl(got, 'GETRANGE')
      size = -2
    elseif #got <= inline then
      size, frame = #got, got
    end
  end
  if size == nil then
    size = redis.pcall('STRLEN', request)
    if type(size) == 'table' then
      unless_acl(size, 'STRLEN')
      size = -2
    end
  end
  if size == 0 and redis.call('EXISTS', request) == 0 then size, frame = -1, false end
  large = size > inline
  count = count + 1
  -- START_JOB, then the field values
  jobs[nj + 1], jobs[nj + 2], jobs[nj + 3], jobs[nj + 4], jobs[nj + 5], jobs[nj + 6] = id, execution, ttl, size, frame, oversized
  nj = nj + 7
  if not values then
    jobs[nj] = 0
    return
  end
  local same = previous ~= nil
  if same then
    for i = 1, NFIELDS do
      if i ~= F_ENQUEUED and values[i] ~= previous[i] then
        same = false
        break
      end
    end
  end
  previous = values
  if same then
    jobs[nj], jobs[nj + 1] = 1, values[F_ENQUEUED]
    nj = nj + 1
  else
    jobs[nj] = NFIELDS
    for i = 1, NFIELDS do jobs[nj + i] = values[i] end
    nj = nj + NFIELDS
  end
end

-- The first job was moved to the intermediate list by BLMOVE: off it again (from its tail, where
-- BLMOVE put it). The others are popped here, in the same atomic call: no list in between.
local ids = {}
if first ~= '' then
  local intermediate = queue .. ':intermediate'
  if kind(intermediate) == 'list' then redis.call('LREM', intermediate, -1, first) end
  ids[1] = first
end
local more, left = tonumber(A.more), 0
-- Jobs parked for this worker's version waited longest: they go first.
if mine and kind(mine) == 'list' then
  if more > 0 then
    local parked = redis.call('LPOP', mine, more) or {}
    for _, id in ipairs(parked) do ids[#ids + 1] = id end
    more = more - #parked
  end
  left = redis.call('LLEN', mine)
end
if kind(queue) == 'list' then
  if more > 0 then
    for _, id in ipairs(redis.call('LPOP', queue, more) or {}) do ids[#ids + 1] = id end
  end
  left = left + redis.call('LLEN', queue)
end
-- Answered already: in the finished or failed registry (a registry of another type holds none).
local answered = {}
if #ids > 0 then
  for _, registry in ipairs({PREFIX .. ':finished:' .. queue_name, PREFIX .. ':failed:' .. queue_name}) do
    local scores = unless_acl(each_chunk(redis.pcall, {'ZMSCORE', registry}, ids), 'ZMSCORE')
    if type(scores) == 'table' and not scores.err then
      for i = 1, #ids do
        if scores[i] then answered[i] = true end
      end
    end
  end
end
for k, id in ipairs(ids) do
  if answered[k] then skip(id, 'answered') else start(id, k - 1) end
end
if nw > 0 then each_chunk(redis.call, {'ZADD', wip}, wip_entries) end
if count > 0 and kind(wkey) == 'hash' then
  -- The worker hash as RQ leaves it when a job starts (for a batch: its first job).
  redis.call('HSET', wkey, 'state', 'busy', 'last_heartbeat', now_iso)
  if not RQ3 then redis.call('HSET', wkey, 'current_job', jobs[1], 'current_job_working_time', '0') end
  redis.call('EXPIRE', wkey, longest)
end
-- START_HEAD, the skipped pairs, the started jobs
local out = {left, ns / 2}
for i = 1, ns do out[2 + i] = skipped[i] end
local at = 2 + ns
for i = 1, nj do out[at + i] = jobs[i] end
return out

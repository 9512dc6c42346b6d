-- Prepended to every ortq script. Everything a script reads may hold any type and any content,
-- written by anyone the ACL lets write it: every read checks the type first, every number read
-- is clamped before it reaches EXPIRE or arithmetic, and a key ortq is about to write that holds
-- the wrong type is removed first, so that no command in a script can fail halfway.
--
-- ARGV[1]: RQ's key prefix (`rq`, or RQ 3's RQ_KEY_PREFIX); ARGV[2]: which of RQ's records: the
-- RQ series ('2' or '3': RQ 3's), then 'e' when each job's execution records are written
-- (Settings.rq_executions), e.g. '3e'; ARGV[3]: ortq's key prefix (`ortq:`); ARGV[4]: the TTL of an
-- idle worker's hash (RQ's worker_ttl + 60). Script arguments follow from ARGV[5].
local PREFIX, ORTQ, WORKER_TTL = ARGV[1], ARGV[3], tonumber(ARGV[4])
local RQ3, EXECUTIONS = string.sub(ARGV[2], 1, 1) == '3', string.sub(ARGV[2], 2, 2) == 'e'
local YEAR = 31536000

local function kind(key)
  return redis.call('TYPE', key)['ok']
end

-- Make `key` writable as type `want`: a key of another type there is not ortq's or RQ's record.
local function own(key, want)
  local t = kind(key)
  if t ~= want and t ~= 'none' then redis.call('DEL', key) end
end

local function hget(key, field)
  if kind(key) ~= 'hash' then return false end
  return redis.call('HGET', key, field)
end

-- A finite number, or `default`.
local function number(value, default)
  local n = tonumber(value)
  if not n or n ~= n or n == math.huge or n == -math.huge then return default end
  return n
end

-- Whole seconds that EXPIRE accepts: between 1 and a year, else `default`.
local function seconds(value, default)
  local n = number(value, nil)
  if not n then return default end
  return math.floor(math.max(1, math.min(n, YEAR)))
end

-- HINCRBY / HINCRBYFLOAT that a forged non-number in the field cannot make fail.
local function add(key, field, delta)
  redis.call('HSET', key, field, tostring(number(redis.call('HGET', key, field), 0) + delta))
end

local function job_key(id) return PREFIX .. ':job:' .. id end
local function wip_key(queue) return PREFIX .. ':wip:' .. queue end
local function queue_key(queue) return PREFIX .. ':queue:' .. queue end
local function worker_key(worker) return PREFIX .. ':worker:' .. worker end
-- A job's request frame and its producer's reply stream, named by its model (the queue's name
-- less ORTQ: ortq:<model>), so that a per-model ACL rule covers them (docs/security.md).
local function model_of(queue) return string.sub(queue, #ORTQ + 1) end
local function request_key(queue, id) return K.request .. model_of(queue) .. ':' .. id end
local function reply_stream(queue, name) return K.reply .. model_of(queue) .. ':' .. name end

-- The command `head` (its name and any key: {'ZADD', key}) with `items` after it, in calls of at
-- most CHUNK items: Lua's unpack takes a few thousand values at most, and a batch may be larger.
-- `call` is redis.call, write or remove; CHUNK is even, so (score, member) pairs stay whole.
-- Returns the replies joined when they are arrays (ZMSCORE), summed when they are numbers (DEL's
-- count), else the last one.
local CHUNK = 1000
local function each_chunk(call, head, items)
  local joined, sum, last = {}, 0, nil
  for i = 1, #items, CHUNK do
    local args = {unpack(head)}
    for j = i, math.min(i + CHUNK - 1, #items) do args[#args + 1] = items[j] end
    last = call(unpack(args))
    if type(last) == 'table' and not last.err then
      for _, v in ipairs(last) do joined[#joined + 1] = v end
    elseif type(last) == 'number' then
      sum = sum + last
    end
  end
  if type(last) == 'table' and not last.err then return joined end
  if type(last) == 'number' then return sum end
  return last
end

-- The reply of a redis.pcall on a key that anyone may have filled with another type or content:
-- an error there (WRONGTYPE, an XADD id below a forged entry's) is handed back for the caller to
-- treat as no record of ours; only the ACL refusing the command is raised (the worker's
-- configuration, not the record: the worker must say so rather than take it for a forged key).
-- Redis 7.0 words that refusal "can't run this command", later versions start it with NOPERM and
-- name the command, Valkey 8 with "ACL failure in script" and names it; for 7.0 the refused
-- `command` is named here (ortq.rqcompat.acl.refused_command).
local function unless_acl(reply, command)
  if type(reply) == 'table' and reply.err then
    if string.find(reply.err, 'NOPERM', 1, true) or string.find(reply.err, 'ACL failure', 1, true) then
      error(reply)
    end
    if string.find(reply.err, "can't run this command", 1, true) then
      error({err = reply.err .. ' (' .. command .. ')'})
    end
  end
  return reply
end

-- A write to a key that anyone may have filled with another type: tried as it is, and only when
-- Redis refuses it (not the ACL: see unless_acl), the key is replaced and the write made again
-- (cheaper than a TYPE each time).
local function write(...)
  local reply = unless_acl(redis.pcall(...), (...))
  if type(reply) == 'table' and reply.err then
    redis.call('DEL', select(2, ...))
    reply = redis.call(...)
  end
  return reply
end

-- Removals from a key that may hold another type: nothing to remove there, so an error is nothing
-- (but the ACL's: see unless_acl).
local function remove(...)
  unless_acl(redis.pcall(...), (...))
end

-- The reply stream `name` of a job hash names (its `ortq_reply`: a producer's token of 1-64
-- characters, '.', the seconds its entries are kept: keys.reply_keep), and that keep; nil when
-- it names none (a producer of another protocol, or a forged field): the job cannot be answered.
local function reply_of(job)
  local name = hget(job, 'ortq_reply')
  if not name or #name > 73 then return nil end
  local token, keep = string.match(name, '^([%w_%-]+)%.([1-9]%d*)$')
  if not token or #token > 64 or #keep > 8 then return nil end
  return name, math.min(tonumber(keep), YEAR)
end

-- The oldest entry id a reply stream whose entries are kept `keep` seconds holds at `now` (epoch s).
local function oldest_kept(now, keep) return string.format('%d', (now - keep) * 1000) end

-- One answer in reply stream `key`: entries older than `minid` (oldest_kept) are trimmed as it is
-- written. A key of another type there is no ortq reply stream: it is replaced (write). Returns
-- the entry's id.
local function post(key, minid, id, frame)
  return write('XADD', key, 'MINID', '~', minid, '*', 'id', id, 'frame', frame)
end

-- Answer one job (fail, reject, recover): an entry in the reply stream its hash names, which then
-- lives `keep` seconds more, and the entry's id in the job hash (`ortq_answer`: where a producer
-- that did not read the stream finds it). A job that names no reply stream is answered nowhere.
local function answer(queue, id, frame, now)
  local job = job_key(id)
  local name, keep = reply_of(job)
  if not name then return end
  local key = reply_stream(queue, name)
  local entry = post(key, oldest_kept(now, keep), id, frame)
  redis.call('EXPIRE', key, keep)
  redis.call('HSET', job, 'ortq_answer', entry)
end

-- RQ's execution records of one run end: the execution hash, its entry in the job's executions,
-- in the started registry and (RQ 3) in the worker's index of its executions.
local function end_execution(queue, id, execution, worker)
  local composite = id .. ':' .. execution
  redis.call('DEL', PREFIX .. ':execution:' .. composite)
  remove('ZREM', PREFIX .. ':executions:' .. id, execution)
  remove('ZREM', wip_key(queue), composite)
  if RQ3 and worker ~= '' then remove('SREM', worker_key(worker) .. ':executions', composite) end
end

-- Is this execution still the job's? A job whose started entry is gone was taken back (its worker
-- was thought dead) and belongs to its next execution: fencing for every answer.
local function owns(queue, id, execution)
  local score = unless_acl(redis.pcall('ZSCORE', wip_key(queue), id .. ':' .. execution), 'ZSCORE')
  return score ~= false and type(score) ~= 'table'
end

-- The worker hash after a run, as RQ's handle_job_success / handle_job_failure leave it; with a
-- `state` ('' while the batch goes on), the worker's state, and (RQ 2) no current job. Only an existing hash is updated: a hash made here would have no TTL (the
-- heartbeat re-registers a worker whose hash expired).
local function worker_done(worker, counter, count, working, state)
  local key = worker_key(worker)
  local t = kind(key)
  if t ~= 'hash' then
    if t ~= 'none' then redis.call('DEL', key) end
    return
  end
  if count > 0 then
    add(key, counter, count)
    add(key, 'total_working_time', working)
  end
  if state ~= '' then
    redis.call('HSET', key, 'state', state)
    if not RQ3 then redis.call('HDEL', key, 'current_job') end
    if state == 'idle' then redis.call('EXPIRE', key, WORKER_TTL) end
  end
end

// A small ortq producer for Node.js, written from docs/wire-format.md alone (protocol 4):
// submit jobs with plain Redis commands, wait for their answers in its own reply streams, check
// each answer's proof.
//
//   const client = new Client('redis://127.0.0.1:6379/0');
//   const id = await client.submit('tiny', { x: { dtype: 'float32', shape: [1, 4], data: new Float32Array(4) } });
//   const outputs = await client.result(id, 30000);   // {y: {dtype, shape, data: Float32Array}}
//   await client.close();

import { createHash, randomBytes, randomUUID } from 'node:crypto';
import { encode } from '@msgpack/msgpack';
import Redis, { ReplyError } from 'ioredis';
import { DEFAULT_DTYPES, DEFAULT_MAX_FRAME_BYTES, OrtqError, decodeResponse, encodeRequest, proofOf } from './frame.mjs';

export { DTYPES, OrtqError, decodeResponse, encodeRequest, proofOf } from './frame.mjs';

/** The version of the keys and commands this client speaks; workers publish theirs in their
 * model's signature record, and the client enqueues nothing for workers of another. */
export const PROTOCOL = 4;

const MODEL_NAME = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/;
// a version name is spelled as a model name is (section 3.3)
const VERSION_NAME = MODEL_NAME;
const JOB_ID = /^[A-Za-z0-9_-]{1,128}$/;
const JOB_FUNC = 'ortq.rqjob.infer';
const ENQUEUE_HIGH = 'ortq_enqueue_high_v2';
const ENQUEUE_UNIQUE = 'ortq_enqueue_unique_v3';
const REQUEST_STOP = 'ortq_request_stop_v3';
/** The most entries one XREAD returns from each reply stream. */
const READ_COUNT = 1000;
/** How many of its latest jobs a client keeps answers for when a read brings them before anyone
 * waits for them (submit now, result later), and the most bytes of such answers kept: past either,
 * the oldest go, and a wait for one looks it up in its job hash. */
const RECENT_JOBS = 100000;
const KEPT_BYTES = 64 << 20;
/** Milliseconds between look-ups of a job's answer in its job hash: the first soon, doubling to the last. */
const LOOK_AGAIN_MS = [10, 500];
/** Milliseconds a wait pauses while Redis is unreachable before it tries again: doubling to the last. */
const OUTAGE_PAUSE_MS = [50, 1000];
/** The most seconds a reply stream keeps its entries (section 4.1: a year). */
const MAX_REPLY_KEEP = 31536000;
/** A reply stream's name (section 4.1): a producer's token, a dot, the seconds its entries are kept. */
const REPLY_NAME = /^[A-Za-z0-9_-]{1,64}\.[1-9][0-9]{0,7}$/;
/** The most ids one RPUSH of an enqueue carries (section 3.2): a larger batch's go in several, in order. */
const PUSH_CHUNK = 1000;
/** The errors a worker answers without having read the request, so with no proof, each in fixed
 * words of its own: such an error is still the job's answer. */
export const UNPROVEN_ERRORS = new Set(['RequestExpired', 'PayloadTooLarge', 'InvalidJob', 'WireFormatError', 'WorkerLost']);

/** A job's stop token (section 3.7): SHA-256 of "stop", a newline and the job's proof, in
 * lowercase hex. Its worker stops the job only for a mark that holds it. */
export function stopTokenOf(proof) {
  return createHash('sha256').update(Buffer.from('stop\n', 'utf8')).update(proof).digest('hex');
}

/** The string key holding a job's request frame. */
export function requestKey(model, jobId) {
  return `ortq:req:${model}:${jobId}`;
}

/** A producer's reply stream of `model` (section 4.1): one entry an answer, fields `id` (the job)
 * and `frame` (its response frame; empty for a large one: see largeReplyKey). */
export function replyKey(model, replyName) {
  return `ortq:reply:${model}:${replyName}`;
}

/** The stream holding a job's large response frame (its one entry's field `frame`), when its entry
 * in the reply stream has an empty frame. (A reply name has a dot, a job id never.) */
export function largeReplyKey(model, jobId) {
  return `ortq:reply:${model}:${jobId}`;
}

/** A new reply name (section 4.1): 32 random lowercase hex digits, a dot, `keep` (1 to a year). */
export function newReplyName(keep) {
  return `${randomBytes(16).toString('hex')}.${Math.max(1, Math.min(Math.floor(keep), MAX_REPLY_KEEP))}`;
}

/** The entry id just below `entryId` (`<ms>-<seq>`): an XREAD from it returns that entry first;
 * null for what is no entry id (or 0-0). */
export function entryBefore(entryId) {
  const found = /^([0-9]+)-([0-9]+)$/.exec(entryId);
  if (found === null) return null;
  const [ms, seq] = [BigInt(found[1]), BigInt(found[2])];
  if (seq > 0n) return `${ms}-${seq - 1n}`;
  if (ms === 0n) return null;
  return `${ms - 1n}-18446744073709551615`;
}

/** The EVAL fallback of FCALL ortq_enqueue_high_v2 (docs/wire-format.md section 3.5). */
export const ENQUEUE_HIGH_SCRIPT = `local keys, args = KEYS, ARGV
-- Insert a high-priority job into its model's queue after the newest high-priority job still
-- waiting, or at the head when there is none: high-priority jobs run before every normal one and
-- first come first served among themselves, and the worker keeps one atomic BLMOVE on one list.
-- keys: 1 the queue, 2 the model's last-high key   args: 1 job id, 2 seconds the last-high key lives
-- A last-high key of the wrong type (not written by ortq) is ignored and overwritten (SET replaces
-- any type); a queue key of the wrong type is an error reply, as an RPUSH would give (the producer
-- then removes the rest of the job again, and workers replace that key), never a Lua error.
local queue, last_key = keys[1], keys[2]
local id, ttl = args[1], args[2]
local queue_type = redis.call('TYPE', queue)['ok']
if queue_type ~= 'list' and queue_type ~= 'none' then
  return redis.error_reply('WRONGTYPE the queue key ' .. queue .. ' holds a ' .. queue_type .. ', not a list')
end
local last = false
if redis.call('TYPE', last_key)['ok'] == 'string' and redis.call('STRLEN', last_key) <= 128 then
  last = redis.call('GET', last_key)
end
local placed = -1
if last then placed = redis.call('LINSERT', queue, 'AFTER', last, id) end
-- -1: the last high-priority job is no longer waiting; 0: the queue is empty (no list at all)
if placed <= 0 then redis.call('LPUSH', queue, id) end
redis.call('SET', last_key, id, 'EX', ttl)
return 1
`;

/** The EVAL fallback of FCALL ortq_enqueue_unique_v3 (section 3.6): section 3.5's code as a
 * local function, then the function's own (ortq/producer/enqueue_unique.lua). */
export const ENQUEUE_UNIQUE_SCRIPT = `local function enqueue_high(keys, args)
${ENQUEUE_HIGH_SCRIPT.slice(ENQUEUE_HIGH_SCRIPT.indexOf('\n') + 1).replace(/\n$/, '').split('\n').map((line) => `  ${line}`).join('\n')}
end
local keys, args = KEYS, ARGV
-- Enqueue a job under an id its producer chose, unless a job of that id exists: never overwrite one.
-- keys: 1 the job hash, 2 the queue, 3 the model's last-high key
-- args: 1 job id, 2 request frame, 3 seconds it waits (<wait>), 4 seconds its hash lives until a
--       worker starts it, 5 'high' or 'normal', 6 the queue's name (the job's origin), 7 its request
--       key, 8 RQ's queue set, 9... the job hash's fields and values.
-- The request key and the queue set are arguments, not keys: Redis's ACL gives a function's
-- declared keys full access, and producers may only write request keys and the set
-- (docs/security.md); each command below is still checked against those rights.
-- Returns 1: enqueued; 0: a job of this id and this queue exists (queued, running, or answered: its
-- hash is there, and lives as long as its answer); -1: the id is another queue's job's, or its key
-- is no hash.
local job, queue, last_key = keys[1], keys[2], keys[3]
local id, frame, wait, hash_ttl, priority, origin = args[1], args[2], args[3], args[4], args[5], args[6]
local request, queues = args[7], args[8]
local job_type = redis.call('TYPE', job)['ok']
if job_type == 'hash' then
  if redis.call('HGET', job, 'origin') == origin then return 0 end
  return -1
elseif job_type ~= 'none' then
  return -1
end
local queue_type = redis.call('TYPE', queue)['ok']
if queue_type ~= 'list' and queue_type ~= 'none' then
  return redis.error_reply('WRONGTYPE the queue key ' .. queue .. ' holds a ' .. queue_type .. ', not a list')
end
-- The hash's fields checked before anything is written: an HSET refused after the frame's SET
-- would leave the frame behind (no field, an odd count, more values than unpack takes).
local values = #args - 8
if values < 2 or values % 2 ~= 0 or values > 7900 then
  return redis.error_reply('ERR the job hash needs 1 to 3950 field-value pairs, got ' .. values .. ' values')
end
redis.call('HSET', job, unpack(args, 9))
redis.call('EXPIRE', job, hash_ttl)
redis.call('SET', request, frame, 'EX', wait)
redis.call('SADD', queues, queue)
if priority == 'high' then
  enqueue_high({queue, last_key}, {id, wait})
else
  redis.call('RPUSH', queue, id)
end
return 1
`;

/** An OrtqError for a failed Redis call: CorruptRecord for a key of the wrong type (with
 * `wrongType` saying which), BrokerUnavailable for the rest (unreachable, refused). */
function redisFailure(err, doing, wrongType = 'a key holds something ortq did not write') {
  if (err instanceof OrtqError) return err;
  if (err instanceof ReplyError && /^WRONGTYPE/.test(err.message)) return new OrtqError('CorruptRecord', `${doing}: ${wrongType}: ${err.message}`);
  const failure = new OrtqError('BrokerUnavailable', `${doing}: ${err.message}`);
  failure.outage = !(err instanceof ReplyError); // unreachable, not refused: a wait tries again
  return failure;
}

function sleep(ms) {
  return new Promise((resolve) => {
    setTimeout(resolve, ms);
  });
}

async function redisCall(doing, promise, wrongType) {
  try {
    return await promise;
  } catch (err) {
    throw redisFailure(err, doing, wrongType);
  }
}

function positiveSeconds(name, value) {
  if (value === undefined || value === null) return null;
  if (!Number.isSafeInteger(value) || value <= 0) {
    throw new OrtqError('ConfigurationError', `${name} must be a positive whole number of seconds, got ${value}`);
  }
  return value;
}

/** {id, frame} of a reply stream entry's fields ([name, value, ...] Buffers): the job id as a
 * string, the frame a Buffer; null where missing. */
function entryFields(fields) {
  let id = null;
  let frame = null;
  for (let i = 0; i + 1 < fields.length; i += 2) {
    const name = fields[i].toString();
    if (name === 'id') id = fields[i + 1].toString();
    else if (name === 'frame') frame = fields[i + 1];
  }
  return { id, frame };
}

export function checkModelName(model) {
  if (typeof model !== 'string' || !MODEL_NAME.test(model)) {
    throw new OrtqError('ConfigurationError', `invalid model name ${JSON.stringify(model)}: use 1-64 characters from A-Z a-z 0-9 _ . -, starting with a letter or digit`);
  }
  return model;
}

/** InvalidInput unless `inputs` are exactly the signature's inputs, each with its dtype, rank and
 * fixed dims (section 5: a dim that is a string or null takes any size; an input with
 * `"any_shape": true`, which the model declares with no shape, takes any rank: its dtype alone). */
export function checkInputs(signature, inputs) {
  const wanted = new Map((signature.inputs ?? []).map((spec) => [spec.name, spec]));
  const given = Object.keys(inputs);
  const missing = [...wanted.keys()].filter((name) => !given.includes(name));
  const unknown = given.filter((name) => !wanted.has(name));
  if (missing.length || unknown.length) {
    throw new OrtqError('InvalidInput', `inputs do not match the model: missing [${missing}], unknown [${unknown}]`);
  }
  for (const [name, spec] of wanted) {
    const tensor = inputs[name];
    if (tensor === null || typeof tensor !== 'object') throw new OrtqError('InvalidInput', `input ${name} must be {dtype, shape, data}`);
    const dtype = tensor.dtype ?? DEFAULT_DTYPES.get(tensor.data?.constructor);
    const shape = tensor.shape ?? [tensor.data?.length];
    if (dtype !== spec.dtype) throw new OrtqError('InvalidInput', `input ${name} has dtype ${dtype}, the model expects ${spec.dtype}`);
    if (spec.any_shape === true) continue;
    const dims = spec.shape ?? [];
    if (shape.length !== dims.length || dims.some((d, i) => Number.isInteger(d) && d !== shape[i])) {
      throw new OrtqError('InvalidInput', `input ${name} has shape [${shape}], the model expects [${dims.map((d) => d ?? '?')}]`);
    }
  }
}

export function checkJobId(jobId) {
  if (typeof jobId !== 'string' || !JOB_ID.test(jobId)) {
    throw new OrtqError('ConfigurationError', `invalid job id ${JSON.stringify(jobId)}: it must match [A-Za-z0-9_-]{1,128}`);
  }
  return jobId;
}

export class Client {
  /**
   * @param {string} redisUrl e.g. redis://127.0.0.1:6379/0
   * @param {object} options retention (seconds) as ortq's Settings, maxQueueLength (0: no
   *   limit), socketTimeoutMs (every command's timeout; blocking reads stay 1 s under it),
   *   rqPrefix (RQ's key prefix, RQ 3's RQ_KEY_PREFIX), validate (check inputs against the
   *   model's published signature), allowUnknownModels (enqueue for a model that has none).
   *   Its answers go to its reply streams, named `replyName` (section 4.1), kept resultTtl seconds.
   */
  constructor(redisUrl, {
    requestTtl = 86400,
    resultTtl = 600,
    failureTtl = 86400,
    maxFrameBytes = DEFAULT_MAX_FRAME_BYTES,
    maxQueueLength = 0,
    socketTimeoutMs = 10000,
    rqPrefix = 'rq',
    validate = true,
    allowUnknownModels = false,
  } = {}) {
    Object.assign(this, { requestTtl, resultTtl, failureTtl, maxFrameBytes, maxQueueLength, socketTimeoutMs, rqPrefix, validate, allowUnknownModels });
    const redisOptions = {
      commandTimeout: socketTimeoutMs,
      connectTimeout: socketTimeoutMs,
      maxRetriesPerRequest: 1,
      retryStrategy: (times) => (times > 5 ? null : Math.min(times * 200, 1000)),
    };
    this.redis = new Redis(redisUrl, redisOptions);
    // Blocking reads get a connection of their own (section 4.2): a command queued behind an
    // XREAD BLOCK on one connection would wait for it. It never sends an XREAD again after a
    // reconnect: the wait reads every stream again from its start instead (#read).
    this.blocking = this.redis.duplicate({ autoResendUnfulfilledCommands: false, maxRetriesPerRequest: 0 });
    // Enqueue transactions, function calls and a cancel's LREM get a connection of their own that
    // never sends an unanswered command again after a reconnect and fails it at once when the
    // connection drops (sections 3.2, 3.6, 3.7: one whose reply was lost may have run; what it did
    // is read back: #enqueueOnce, #enqueueUnique, #takenOff).
    this.enqueuer = this.redis.duplicate({ autoResendUnfulfilledCommands: false, maxRetriesPerRequest: 0 });
    // Connection trouble surfaces as the failed command's error; without listeners ioredis would
    // also print every reconnection attempt.
    for (const connection of [this.redis, this.blocking, this.enqueuer]) connection.on('error', () => {});
    /** job id -> {model, nonce, proof} of each job this client submitted, until its result has
     * been read: `nonce` is what its request carried, `proof` (proofOf(model, nonce)) what its
     * response must carry. */
    this.jobs = new Map();
    /** This client's reply streams' name (section 4.1): every job hash it writes names it (`ortq_reply`). */
    this.replyName = newReplyName(resultTtl);
    /** reply stream key -> the id of the last entry read of it ('0-0': from its start) */
    this.cursors = new Map();
    /** job id -> model of this client's recent jobs whose answers come through its reply streams
     * and have not been handed out (oldest first, at most RECENT_JOBS) */
    this.expected = new Map();
    /** job id -> the frame read for it while nobody waited for it ('' bytes: a large answer) */
    this.kept = new Map();
    this.keptBytes = 0;
    /** The XREAD of the reply streams in flight (one at a time: every wait takes what it brings). */
    this.reading = null;
  }

  async close() {
    // The blocking connection is dropped, not quit: a QUIT would wait behind an XREAD BLOCK in flight.
    this.blocking.disconnect();
    await Promise.allSettled([this.redis.quit(), this.enqueuer.quit()]);
  }

  queueKey(model) {
    return `${this.rqPrefix}:queue:ortq:${model}`;
  }

  jobKey(jobId) {
    return `${this.rqPrefix}:job:${jobId}`;
  }

  /** Enqueue one job; returns its id. See submitMany for the options. */
  async submit(model, inputs, options = {}) {
    const { jobId, ...rest } = options;
    return (await this.submitMany(model, [inputs], { ...rest, jobIds: jobId === undefined ? undefined : [jobId] }))[0];
  }

  /**
   * Enqueue many jobs for `model` in one MULTI/EXEC; returns their ids, in order.
   * options: priority ('normal' | 'high'), ttl (s a job may wait for a worker), jobTimeout (s a
   * run may take), jobIds (your own ids, checked against the id rule: each job goes in by ortq's
   * Redis function, which never overwrites a job of that id (section 3.6); JobExists when one
   * exists, the others enqueued).
   */
  async submitMany(model, manyInputs, { priority = 'normal', ttl, jobTimeout, jobIds } = {}) {
    checkModelName(model);
    if (priority !== 'normal' && priority !== 'high') {
      throw new OrtqError('ConfigurationError', `priority must be normal or high, got ${JSON.stringify(priority)}`);
    }
    ttl = positiveSeconds('ttl', ttl);
    jobTimeout = positiveSeconds('jobTimeout', jobTimeout);
    const ids = (jobIds ?? manyInputs.map(() => randomUUID())).map(checkJobId);
    if (ids.length !== manyInputs.length) throw new OrtqError('ConfigurationError', 'one job id per job, please');
    const signature = this.validate || !this.allowUnknownModels ? await this.signature(model) : null;
    if (signature === null && !this.allowUnknownModels) {
      throw new OrtqError('UnknownModel', `no worker has served model ${JSON.stringify(model)} (it has no published signature); nothing was enqueued`);
    }
    if (signature !== null && this.validate) for (const inputs of manyInputs) checkInputs(signature, inputs);
    const jobs = manyInputs.map((inputs, i) => {
      const nonce = randomBytes(16);
      const frame = encodeRequest(inputs, { nonce });
      if (frame.byteLength > this.maxFrameBytes) {
        throw new OrtqError('PayloadTooLarge', `the request is ${frame.byteLength} bytes, over maxFrameBytes (${this.maxFrameBytes}): workers would refuse it`);
      }
      return { id: ids[i], nonce, proof: proofOf(model, nonce), frame };
    });
    if (this.maxQueueLength > 0) {
      // Backpressure (section 3.1): checked before the transaction, so not atomic with it.
      const queued = await redisCall(`could not enqueue for ${model}`, this.redis.llen(this.queueKey(model)));
      if (queued + jobs.length > this.maxQueueLength) {
        throw new OrtqError('QueueFull', `queue ortq:${model} holds ${queued} jobs; ${jobs.length} more would pass maxQueueLength (${this.maxQueueLength})`);
      }
    }
    const wait = ttl === null ? this.requestTtl : Math.min(this.requestTtl, ttl);
    const settings = { model, priority, ttl, jobTimeout, wait };
    const doing = `could not enqueue ${jobs.length} job(s) for ${model} (if the connection dropped during the write they may have been enqueued)`;
    // Expected before the enqueue is sent: a read of another wait may bring an answer before it returns.
    this.#expect(model, jobs.map((job) => job.id));
    try {
      if (jobIds !== undefined && jobIds !== null) return await this.#submitUnique(jobs, settings, doing);
      let replies;
      try {
        replies = await this.#enqueueOnce(jobs, settings, 'fcall');
      } catch (err) {
        // Redis 6.2 has no FCALL: refused as it is queued, the whole transaction was discarded.
        const noFcall = /EXECABORT/.test(err.message) && /unknown command/i.test(String(err.previousErrors?.map((e) => e.message)));
        if (!(priority === 'high' && noFcall)) throw redisFailure(err, doing);
        replies = await redisCall(doing, this.#enqueueOnce(jobs, settings, 'eval'));
      }
      // null: the transaction ran and its replies were lost (a MULTI goes in whole)
      if (replies !== null) await redisCall(doing, this.#settle(jobs, settings, replies));
    } catch (err) {
      this.#forget(jobs.filter((job) => !this.jobs.has(job.id)).map((job) => job.id));
      throw err;
    }
    for (const job of jobs) this.jobs.set(job.id, { model, nonce: job.nonce, proof: job.proof });
    return jobs.map((job) => job.id);
  }

  /** Jobs under ids of the caller's own (section 3.6): each by FCALL of ortq's function, which
   * enqueues it unless a job of that id exists; their ids, or JobExists naming the ids that were
   * not enqueued (the others were). */
  async #submitUnique(jobs, settings, doing) {
    const outcomes = await redisCall(doing, this.#enqueueUnique(jobs, settings));
    const fresh = jobs.filter((job, i) => outcomes[i] === 1);
    for (const job of fresh) this.jobs.set(job.id, { model: settings.model, nonce: job.nonce, proof: job.proof });
    // Not ours: a wait for them looks them up in their job hash.
    this.#forget(jobs.filter((job, i) => outcomes[i] !== 1 && !this.jobs.has(job.id)).map((job) => job.id));
    const foreign = jobs.filter((job, i) => outcomes[i] === -1).map((job) => job.id);
    const taken = jobs.filter((job, i) => outcomes[i] === 0).map((job) => job.id);
    const enqueued = fresh.length ? `; ${fresh.length} other job(s) were enqueued` : '';
    if (foreign.length) {
      throw new OrtqError('JobExists', `job id(s) ${foreign.slice(0, 5).join(', ')} belong to another model's job (or hold no job hash)${enqueued}`);
    }
    if (taken.length) {
      throw new OrtqError('JobExists', `a job of id(s) ${taken.slice(0, 5).join(', ')} exists for ${settings.model} (queued, running, or answered): nothing was overwritten${enqueued}`);
    }
    return jobs.map((job) => job.id);
  }

  /** Section 3.6's FCALL per job, sent once: each job's 1, 0 or -1; where the FCALL found no
   * function (no worker has loaded it yet, or Redis 6.2), the same code by EVAL. After a lost reply
   * each job is read back (#uniqueOutcomes), and those not there are sent once more. */
  async #enqueueUnique(jobs, settings) {
    const now = new Date().toISOString();
    const missingFunction = (err) => /function not found|unknown command/i.test(err.message);
    const send = async (some) => {
      const pipeline = this.enqueuer.pipeline();
      for (const job of some) pipeline.call('FCALL', ENQUEUE_UNIQUE, ...this.#uniqueArguments(job, settings, now));
      const replies = await pipeline.exec();
      const byEval = some.filter((job, i) => replies[i][0] && missingFunction(replies[i][0]));
      let evals = [];
      if (byEval.length) {
        const fallback = this.enqueuer.pipeline();
        for (const job of byEval) fallback.eval(ENQUEUE_UNIQUE_SCRIPT, ...this.#uniqueArguments(job, settings, now));
        evals = await fallback.exec();
      }
      return replies.map(([err, reply]) => {
        if (!err) return reply;
        if (missingFunction(err)) [err, reply] = evals.shift();
        if (!err) return reply;
        if (/^NOPERM/.test(err.message) && /eval/i.test(err.message)) {
          throw new OrtqError('ConfigurationError', `enqueue under an id of your own needs ortq's Redis function ${ENQUEUE_UNIQUE}, which workers load, or the right to EVAL its code: start a worker of any model on this Redis first (Redis 7 or later): ${err.message}`);
        }
        throw err;
      });
    };
    let outcomes;
    try {
      return await send(jobs);
    } catch (err) {
      if (err instanceof ReplyError || err instanceof OrtqError) throw err;
      outcomes = await this.#uniqueOutcomes(jobs, settings.model, now);
    }
    const missing = jobs.flatMap((job, i) => (outcomes[i] === null ? [i] : []));
    if (missing.length) {
      const again = await send(missing.map((i) => jobs[i]));
      for (const [j, i] of missing.entries()) outcomes[i] = again[j];
    }
    return outcomes;
  }

  #uniqueArguments(job, { model, priority, ttl, jobTimeout, wait }, now) {
    const fields = Object.entries(this.#jobFields(model, priority, ttl, jobTimeout, now)).flat();
    const queue = this.queueKey(model);
    return [3, this.jobKey(job.id), queue, `ortq:last-high:${model}`, job.id, job.frame, wait, wait + this.failureTtl, priority,
      `ortq:${model}`, requestKey(model, job.id), `${this.rqPrefix}:queues`, ...fields];
  }

  /** What section 3.6's call answered each of `jobs`, read back after its reply was lost: 1 where
   * the job is there with this call's created_at, 0 where another job of that id and model is, -1
   * where another model's is (or no hash), null where nothing is (a job hash lives as long as its answer). */
  async #uniqueOutcomes(jobs, model, now) {
    const probe = this.redis.pipeline();
    for (const job of jobs) probe.hget(this.jobKey(job.id), 'origin').hget(this.jobKey(job.id), 'created_at');
    const replies = await probe.exec();
    return jobs.map((job, i) => {
      const [[originErr, origin], [, created]] = replies.slice(2 * i, 2 * i + 2);
      if (originErr && /^WRONGTYPE/.test(originErr.message)) return -1;
      if (originErr) throw originErr;
      if (origin === null) return null;
      if (origin !== `ortq:${model}`) return -1;
      return created === now ? 1 : 0;
    });
  }

  /** #enqueue, sent once (section 3.2): after a broken connection or a timeout its jobs' records
   * are read back. There: it ran and its replies were lost, and null is returned (sent again, it
   * would queue the jobs twice, and set a job started meanwhile back to queued, to run twice). Not
   * there after a broken connection: sent once more; after a timeout (Redis may still run it): the
   * error, which the caller reports as maybe enqueued. */
  async #enqueueOnce(jobs, settings, how) {
    for (let sends = 2; ; sends -= 1) {
      try {
        return await this.#enqueue(jobs, settings, how);
      } catch (err) {
        if (err instanceof ReplyError) throw err; // Redis answered (EXECABORT): nothing of it ran
        if (await this.#wentIn(jobs)) return null;
        if (sends === 1 || /timed out/i.test(err.message)) throw err;
      }
    }
  }

  /** Whether any of `jobs` is in Redis: its job hash (which lives as long as its answer). */
  async #wentIn(jobs) {
    const probe = this.redis.pipeline();
    for (const job of jobs) probe.hget(this.jobKey(job.id), 'origin');
    const replies = await probe.exec();
    for (const [err] of replies) if (err) throw err;
    return replies.some(([, origin]) => origin !== null);
  }

  /** Section 3.2's transaction: three commands per job (high priority: four, with its FCALL or
   * EVAL), then one SADD and the RPUSH of all the ids in order, PUSH_CHUNK a command, in one
   * MULTI/EXEC; the [error, reply] of each command. */
  #enqueue(jobs, { model, priority, ttl, jobTimeout, wait }, how) {
    const now = new Date().toISOString(); // RQ's format: UTC, 3 fraction digits, Z
    const queue = this.queueKey(model);
    const fields = this.#jobFields(model, priority, ttl, jobTimeout, now);
    const multi = this.enqueuer.multi();
    for (const job of jobs) {
      multi.set(requestKey(model, job.id), job.frame, 'EX', wait);
      multi.hset(this.jobKey(job.id), fields);
      multi.expire(this.jobKey(job.id), wait + this.failureTtl);
      if (priority !== 'high') continue;
      if (how === 'fcall') multi.call('FCALL', ENQUEUE_HIGH, 2, queue, `ortq:last-high:${model}`, job.id, wait);
      else multi.eval(ENQUEUE_HIGH_SCRIPT, 2, queue, `ortq:last-high:${model}`, job.id, wait);
    }
    multi.sadd(`${this.rqPrefix}:queues`, queue);
    if (priority !== 'high') {
      const ids = jobs.map((job) => job.id);
      for (let at = 0; at < ids.length; at += PUSH_CHUNK) multi.rpush(queue, ...ids.slice(at, at + PUSH_CHUNK));
    }
    return multi.exec();
  }

  /** Section 3.3's job hash fields of a queued job (`now`: RQ's format, UTC, 3 fraction digits, Z). */
  #jobFields(model, priority, ttl, jobTimeout, now) {
    const fields = {
      status: 'queued',
      origin: `ortq:${model}`,
      data: Buffer.from(encode([JOB_FUNC, null, [model], {}])),
      description: `${JOB_FUNC}('${model}')`,
      created_at: now,
      enqueued_at: now,
      result_ttl: String(this.resultTtl),
      failure_ttl: String(this.failureTtl),
      ortq_reply: this.replyName,
    };
    if (ttl !== null) fields.ttl = String(ttl);
    if (jobTimeout !== null) fields.timeout = String(jobTimeout);
    if (priority === 'high') fields.ortq_priority = 'high';
    return fields;
  }

  /** The model's published signature (section 5), or null when no worker has published one;
   * ProtocolMismatch when its workers speak another protocol than PROTOCOL. */
  async signature(model) {
    const key = `ortq:signature:${checkModelName(model)}`;
    const raw = await redisCall(`could not read the signature of ${model}`, this.redis.get(key));
    if (raw === null) return null;
    let signature = null;
    try {
      signature = JSON.parse(raw);
    } catch {
      // not ortq's JSON
    }
    if (signature === null || typeof signature !== 'object' || !Array.isArray(signature.inputs)) {
      throw new OrtqError('CorruptRecord', `the published signature of ${JSON.stringify(model)} cannot be read`);
    }
    const protocol = signature.protocol ?? 2; // workers before protocol 3 did not say
    if (protocol !== PROTOCOL) {
      throw new OrtqError('ProtocolMismatch', `the workers of ${JSON.stringify(model)} speak ortq protocol ${JSON.stringify(protocol)} and this client ${PROTOCOL}: their jobs would never be answered, so nothing was enqueued; upgrade producers and workers together`);
    }
    return signature;
  }

  /** Check every EXEC reply (section 3.2): queue by EVAL a job whose FCALL found no function;
   * remove again, and report, a job any other required command of which failed. */
  async #settle(jobs, settings, replies) {
    const broken = [];
    const high = settings.priority === 'high';
    const perJob = high ? 4 : 3;
    const pushes = replies.slice(perJob * jobs.length + 1); // after the optional SADD: each RPUSH's
    for (const [index, job] of jobs.entries()) {
      const results = replies.slice(perJob * index, perJob * index + perJob);
      if (!high) results.push(pushes[Math.floor(index / PUSH_CHUNK)]); // a failed RPUSH fails all it carried
      const failed = results.findIndex(([err]) => err);
      if (failed === -1) continue;
      const err = results[failed][0];
      if (failed === 3 && high && /function not found/i.test(err.message)) {
        // No worker has loaded ortq's function yet: the same code by EVAL (section 3.5).
        const queue = this.queueKey(settings.model);
        try {
          await this.redis.eval(ENQUEUE_HIGH_SCRIPT, 2, queue, `ortq:last-high:${settings.model}`, job.id, settings.wait);
          continue;
        } catch (again) {
          if (!(again instanceof ReplyError)) throw again;
          broken.push([job, again]);
        }
      } else {
        broken.push([job, err]);
      }
    }
    if (broken.length === 0) return;
    const cleanup = this.redis.multi();
    for (const [job] of broken) cleanup.del(requestKey(settings.model, job.id), this.jobKey(job.id));
    await cleanup.exec();
    const first = broken[0][1].message;
    const message = `could not enqueue ${broken.length} of ${jobs.length} job(s) (nothing of them was left in Redis): ${first}`;
    // NOPERM: the Redis user lacks a right (docs/security.md); anything else: a key holds what ortq did not write.
    throw new OrtqError(/^NOPERM/.test(first) ? 'ConfigurationError' : 'CorruptRecord', message);
  }

  /**
   * The outputs of job `jobId` ({name: {dtype, shape, data}}), waiting at most `timeoutMs`.
   * Throws OrtqError: the worker's error type (remote: true) when the job failed,
   * ResultTimeout, ResponseMismatch (the reply does not answer our request), CorruptRecord.
   * A job this client submitted needs nothing more; for one submitted elsewhere give its `model`
   * and, to check its reply, `nonce` (a Buffer: the nonce its request carried).
   */
  async result(jobId, timeoutMs = 30000, { model, nonce } = {}) {
    const [response] = await this.waitResponses([{ id: jobId, model, nonce }], timeoutMs);
    if (!response.ok) throw new OrtqError(response.error.type, response.error.message, { jobId, remote: true });
    return response.outputs;
  }

  /** Submit one job and wait for its outputs; a job still queued when the wait ends is cancelled. */
  async infer(model, inputs, timeoutMs = 30000, options = {}) {
    const jobId = await this.submit(model, inputs, options);
    try {
      return await this.result(jobId, timeoutMs);
    } catch (err) {
      if (err.type === 'ResultTimeout') await this.cancel(jobId, model);
      throw err;
    }
  }

  /**
   * The decoded responses ({ok, outputs, error, timings, proof}) of many jobs, in order, each
   * checked by the proof rule (section 4.3). The answers of this client's own jobs come through
   * its reply streams, read with one XREAD (section 4.1); a job submitted elsewhere, or one of its
   * own whose answer it no longer keeps, is looked up in its job hash (`ortq_answer`). `jobs`: the
   * ids of jobs this client submitted, or {id, model, nonce} for jobs submitted elsewhere (nonce,
   * a Buffer, optional: without it the reply is not checked). Jobs answered are forgotten.
   */
  async waitResponses(jobs, timeoutMs = 30000) {
    const wanted = jobs.map((job) => this.#waitable(job));
    const byId = new Map();
    for (const job of wanted) if (!byId.has(job.id)) byId.set(job.id, job);
    const deadline = Date.now() + timeoutMs;
    const responses = new Map();
    // The jobs looked up in their hashes: id -> [when next (ms), the delay after that].
    const looks = new Map();
    // Redis unreachable at the last try (waits go on through it until the deadline), and the pause before the next.
    let outage = null;
    let pause = OUTAGE_PAUSE_MS[0];
    for (;;) {
      try {
        for (const job of byId.values()) {
          if (responses.has(job.id)) continue;
          if (this.kept.has(job.id)) responses.set(job.id, await this.#response(this.#take(job.id), job));
          else if (!looks.has(job.id) && this.expected.get(job.id) !== job.model) looks.set(job.id, [0, LOOK_AGAIN_MS[0]]);
        }
        const missing = [...byId.values()].filter((job) => !responses.has(job.id));
        if (missing.length === 0) break;
        const now = Date.now();
        if (deadline - now <= 0) {
          if (outage !== null) throw outage;
          throw new OrtqError('ResultTimeout', `no result for ${missing.length} of ${byId.size} job(s) within ${timeoutMs} ms`, { jobId: missing[0].id });
        }
        const due = missing.filter((job) => looks.get(job.id)?.[0] <= now);
        if (due.length) {
          for (const [job, frame] of await this.#lookUp(due)) {
            responses.set(job.id, await this.#response(frame, job));
            looks.delete(job.id);
          }
          for (const job of due) {
            const [, delay] = looks.get(job.id) ?? [];
            if (delay !== undefined) looks.set(job.id, [Date.now() + delay, Math.min(2 * delay, LOOK_AGAIN_MS[1])]);
          }
        } else {
          let next = deadline;
          for (const job of missing) next = Math.min(next, looks.get(job.id)?.[0] ?? deadline);
          const waitMs = Math.max(1, next - now);
          if (missing.some((job) => !looks.has(job.id))) await this.#readReplies(waitMs);
          else await sleep(waitMs);
        }
        [outage, pause] = [null, OUTAGE_PAUSE_MS[0]];
      } catch (err) {
        if (!(err instanceof OrtqError && err.outage)) throw err;
        outage = err;
        await sleep(Math.max(0, Math.min(pause, deadline - Date.now())));
        pause = Math.min(2 * pause, OUTAGE_PAUSE_MS[1]);
      }
    }
    for (const id of byId.keys()) this.jobs.delete(id);
    return wanted.map((job) => responses.get(job.id));
  }

  /** Jobs of `model` whose answers are to come through this client's reply stream of it. */
  #expect(model, jobIds) {
    const stream = replyKey(model, this.replyName);
    if (!this.cursors.has(stream)) this.cursors.set(stream, '0-0');
    for (const id of jobIds) {
      this.expected.delete(id);
      this.expected.set(id, model);
    }
    while (this.expected.size > RECENT_JOBS) this.#forget([this.expected.keys().next().value]);
  }

  /** Jobs whose answers are no longer kept (a wait for them looks them up). */
  #forget(jobIds) {
    for (const id of jobIds) {
      this.expected.delete(id);
      const frame = this.kept.get(id);
      if (frame === undefined) continue;
      this.kept.delete(id);
      this.keptBytes -= frame.byteLength;
    }
  }

  /** The frame read for job `id`, handed out once. */
  #take(id) {
    const frame = this.kept.get(id);
    this.#forget([id]);
    return frame;
  }

  /** Wait at most `waitMs` for the XREAD of this client's reply streams (section 4.1) to bring
   * something: one read at a time, from each stream's cursor, its block under the command timeout
   * (section 4.2); answers of expected jobs are kept for their waits. A read of another wait, which
   * may block longer, is waited for at most `waitMs`. */
  async #readReplies(waitMs) {
    if (this.reading === null) {
      const block = Math.max(1, Math.min(waitMs, this.socketTimeoutMs - 1000));
      this.reading = this.#read(block).finally(() => {
        this.reading = null;
      });
    }
    let timer;
    const timeout = new Promise((resolve) => {
      timer = setTimeout(resolve, waitMs);
    });
    try {
      await Promise.race([this.reading, timeout]);
    } finally {
      clearTimeout(timer);
    }
  }

  async #read(block) {
    const streams = [...this.cursors.keys()];
    let reply;
    try {
      reply = await this.blocking.xreadBuffer('COUNT', READ_COUNT, 'BLOCK', block, 'STREAMS', ...streams, ...streams.map((key) => this.cursors.get(key)));
    } catch (err) {
      // Redis may have restarted or failed over, numbering new entries below the cursors: every
      // stream is read again from its start (answers handed out already are not kept again).
      if (!(err instanceof ReplyError)) for (const key of streams) this.cursors.set(key, '0-0');
      throw redisFailure(err, 'could not read replies', 'a reply stream of this client holds something no worker wrote');
    }
    for (const [name, entries] of reply ?? []) {
      const stream = name.toString();
      if (!this.cursors.has(stream)) continue;
      for (const [entryId, fields] of entries ?? []) {
        this.cursors.set(stream, entryId.toString());
        const { id, frame } = entryFields(fields);
        if (id === null || frame === null) continue;
        const model = this.expected.get(id);
        if (model === undefined || this.kept.has(id) || replyKey(model, this.replyName) !== stream) continue;
        this.kept.set(id, frame);
        this.keptBytes += frame.byteLength;
      }
    }
    while (this.keptBytes > KEPT_BYTES && this.kept.size > 0) this.#forget([this.kept.keys().next().value]);
  }

  /** Look `jobs` up in their hashes (section 4.1): [job, frame] of each whose hash names its answer
   * (`ortq_reply`, `ortq_answer`), read alone from that entry; the others are not answered yet. */
  async #lookUp(jobs) {
    const probe = this.redis.pipeline();
    for (const job of jobs) probe.hmget(this.jobKey(job.id), 'ortq_reply', 'ortq_answer');
    const replies = await redisCall('could not look up answers', probe.exec());
    const found = [];
    for (const [i, job] of jobs.entries()) {
      const [err, fields] = replies[i];
      if (err) throw redisFailure(err, `could not look up the answer of job ${job.id}`, `its record ${this.jobKey(job.id)} is no hash`);
      const [name, answer] = fields;
      if (name === null || !REPLY_NAME.test(name) || answer === null) continue; // not (yet) answered, or gone
      const before = entryBefore(answer);
      if (before === null) {
        throw new OrtqError('CorruptRecord', `the record of job ${job.id} names no entry of a reply stream (${JSON.stringify(answer)})`, { jobId: job.id });
      }
      const stream = replyKey(job.model, name);
      const read = this.redis.xreadBuffer('COUNT', 1, 'STREAMS', stream, before);
      const reply = await redisCall(`could not read the answer of job ${job.id}`, read, `${stream} holds no stream: no ortq worker wrote it`);
      const [entryId, entry] = reply?.[0]?.[1]?.[0] ?? [];
      const { id, frame } = entryFields(entry ?? []);
      if (entryId?.toString() !== answer || id !== job.id || frame === null) {
        throw new OrtqError('ResultTimeout', `the answer of job ${job.id} is not in ${stream}: no longer kept, or the job is not ${job.model}'s`, { jobId: job.id });
      }
      found.push([job, frame]);
    }
    return found;
  }

  /** The checked response of `job` in an answer's frame: an empty frame is a large answer, in the
   * job's own stream (largeReplyKey). */
  async #response(frame, job) {
    if (frame.byteLength === 0) {
      const key = largeReplyKey(job.model, job.id);
      const read = this.redis.xreadBuffer('COUNT', 1, 'STREAMS', key, '0-0');
      const reply = await redisCall(`could not read the large answer of job ${job.id}`, read, `${key} holds no stream: no ortq worker wrote it`);
      frame = entryFields(reply?.[0]?.[1]?.[0]?.[1] ?? []).frame;
      if (frame === null || frame.byteLength === 0) throw new OrtqError('CorruptRecord', `the large answer of job ${job.id} (${key}) is gone`, { jobId: job.id });
    }
    return this.#checked(frame, job);
  }

  /** {id, model, proof} of a job to wait for (proof null: its reply is not checked). */
  #waitable(job) {
    const { id, model: given, nonce } = typeof job === 'string' ? { id: job } : (job ?? {});
    checkJobId(id);
    if (given !== undefined && given !== null) checkModelName(given);
    const ours = this.jobs.get(id);
    if (ours !== undefined && given !== undefined && given !== null && given !== ours.model) {
      throw new OrtqError('ConfigurationError', `job ${id} was submitted for model ${ours.model}, not ${given}`, { jobId: id });
    }
    const model = given ?? ours?.model;
    if (model === undefined) throw new OrtqError('ConfigurationError', `job ${id} was not submitted by this client: give its model`, { jobId: id });
    if (nonce === undefined || nonce === null) return { id, model, proof: ours?.proof ?? null };
    if (!(nonce instanceof Uint8Array)) throw new OrtqError('ConfigurationError', `the nonce of job ${id} must be a Buffer`, { jobId: id });
    return { id, model, proof: proofOf(model, nonce) };
  }

  /** Decode a response frame and apply the proof rule (section 4.3): it answers the request
   * whose proof is `job.proof` if it carries that proof, or if it carries none and is one of the
   * errors a worker gives without having read the request (UNPROVEN_ERRORS). */
  #checked(frame, job) {
    let response;
    try {
      response = decodeResponse(frame, this.maxFrameBytes);
    } catch (err) {
      throw new OrtqError('CorruptRecord', `the reply of job ${job.id} is no valid response frame: ${err.message}`, { jobId: job.id });
    }
    if (job.proof === null || (response.proof !== null && response.proof.equals(job.proof))) return response;
    if (response.proof === null && !response.ok && UNPROVEN_ERRORS.has(response.error.type)) return response;
    const carries = response.proof === null ? 'no proof' : 'the proof of another request or model';
    throw new OrtqError(
      'ResponseMismatch',
      `the response to job ${job.id} does not answer this request (it carries ${carries}): its request frame was replaced, or the job run by a worker of another model, by someone with write access to Redis; or its worker speaks another ortq protocol (upgrade producers and workers together)`,
      { jobId: job.id },
    );
  }

  /** RQ's status of the job (queued, started, finished, failed, canceled, scheduled), or null. */
  async status(jobId) {
    return redisCall(`could not read the status of job ${jobId}`, this.redis.hget(this.jobKey(checkJobId(jobId)), 'status'));
  }

  /** Take a job off its queue if no worker has started it, else ask the worker running it to stop
   * it (section 3.7: it then fails with JobStopped); whether it was removed or asked to stop (false:
   * it ended, or is unknown, or it is started and neither this client submitted it nor `nonce`, the
   * nonce its request carried, is given: its stop token is made from that nonce). */
  async cancel(jobId, model, { nonce } = {}) {
    const doing = `could not cancel job ${jobId}`;
    const wrong = `the queue of ${model} or its list of jobs parked for a version is no list`;
    let removed = await redisCall(doing, this.#takenOff(this.queueKey(checkModelName(model)), checkJobId(jobId)), wrong);
    if (!removed) {
      // parked for the version it is pinned to (section 3.7): off that list instead
      const pin = await redisCall(doing, this.redis.hget(this.jobKey(jobId), 'ortq_version').catch(() => null));
      if (typeof pin === 'string' && VERSION_NAME.test(pin)) {
        removed = await redisCall(doing, this.#takenOff(`ortq:parked:${model}@${pin}`, jobId), wrong);
      }
    }
    if (!removed) {
      const proof = nonce instanceof Uint8Array ? proofOf(model, nonce) : this.jobs.get(jobId)?.proof;
      return proof === undefined ? false : redisCall(doing, this.#requestStop(jobId, model, proof));
    }
    const records = this.redis
      .multi()
      .del(requestKey(model, jobId))
      .hset(this.jobKey(jobId), 'status', 'canceled')
      .zadd(`${this.rqPrefix}:canceled:ortq:${model}`, Math.floor(Date.now() / 1000), jobId)
      .exec();
    await redisCall(doing, records); // a job hash that is no hash: the job is off the queue anyway
    this.jobs.delete(jobId);
    this.#forget([jobId]);
    return true;
  }

  /** Mark a started job for its worker to stop (section 3.7's FCALL) with its stop token, made
   * from its `proof`; whether it was started. A Redis without the function has had no worker start
   * on it, so none runs the job. */
  async #requestStop(jobId, model, proof) {
    try {
      return (await this.redis.call('FCALL', REQUEST_STOP, 1, this.jobKey(jobId), `ortq:${model}`, stopTokenOf(proof))) === 1;
    } catch (err) {
      if (err instanceof ReplyError && /function not found/i.test(err.message)) return false;
      throw err;
    }
  }

  /** LREM of a job from its queue, sent once (section 3.7): after a lost reply it is sent once
   * more, and when that answers 0, a job still queued (so in no queue now) was taken off by the
   * first. Taken for "not in the queue", it would be neither cancelled nor ever run. */
  async #takenOff(queue, jobId) {
    try {
      return (await this.enqueuer.lrem(queue, 0, jobId)) > 0;
    } catch (err) {
      if (err instanceof ReplyError) throw err;
    }
    if ((await this.enqueuer.lrem(queue, 0, jobId)) > 0) return true;
    return (await this.redis.hget(this.jobKey(jobId), 'status')) === 'queued';
  }
}

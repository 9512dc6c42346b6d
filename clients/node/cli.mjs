#!/usr/bin/env node
// Command line for the ortq Node.js client:
//
//   node cli.mjs infer  REDIS_URL MODEL  [--priority high] [--ttl S] [--job-timeout S] [--timeout-ms MS]  < inputs.json
//   node cli.mjs submit REDIS_URL MODEL  [--priority high] [--ttl S] [--job-timeout S] [--job-id ID]     < inputs.json
//     both also take --no-validate (send inputs unchecked: the worker checks them) and
//     --allow-unknown-model (enqueue for a model no worker has published a signature for yet)
//   node cli.mjs result REDIS_URL JOB_ID --model MODEL [--nonce HEX] [--timeout-ms MS]
//   node cli.mjs cancel REDIS_URL JOB_ID --model MODEL [--nonce HEX]   (prints {"job", "cancelled"})
//     the result of a job submitted by another process, found through its job hash (ortq_answer: its
//     entry in its producer's reply stream of MODEL); with
//     --nonce (as submit printed it) the reply must carry the proof made from MODEL and that nonce
//   node cli.mjs many   REDIS_URL MODEL  [the options of infer]                                   < [inputs, ...]
//     many jobs in one MULTI/EXEC, waited for together; prints {"jobs": [ID, ...], "results":
//     [{"outputs": ...} or {"error": ...}, ...]} (exit 3 if any failed)
//
// inputs.json: {"x": {"dtype": "float32", "shape": [2, 4], "data": [1, 2, ...]}, ...}, where
// "base64" (the tensor's little-endian bytes) may stand instead of "data"; int64/uint64 values
// may be JSON strings. Outputs are printed as {"job": ID, "outputs": {name: {dtype, shape,
// base64, data}}}; submit prints {"job": ID, "model": MODEL, "nonce": HEX}. A failure prints
// {"job": ID, "error": {type, message}}. float16 "data" are the values' bit patterns (use
// "base64"). Exit status: 0 done, 3 the job failed on the worker, 1 no result in time, a reply
// that does not answer the request (ResponseMismatch) or Redis unavailable (or anything else that
// went wrong in Redis), 2 a usage, configuration or input error (ProtocolMismatch included: the
// model's workers speak another ortq protocol, and nothing was enqueued).

import { readFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { Client, DTYPES, OrtqError } from './ortq.mjs';

/** Errors of this client's own checks, before anything was enqueued: exit status 2. */
const LOCAL_USAGE_ERRORS = new Set(['ConfigurationError', 'InvalidInput', 'UnsupportedDtype', 'PayloadTooLarge', 'UnknownModel', 'ProtocolMismatch']);
const USAGE = 'usage: node cli.mjs infer|submit|many REDIS_URL MODEL [options] < inputs.json | node cli.mjs result|cancel REDIS_URL JOB_ID --model MODEL [options]';

function tensorFromJson(name, spec) {
  const entry = DTYPES[spec?.dtype];
  if (entry === undefined) throw new OrtqError('UnsupportedDtype', `input ${name}: unknown dtype ${spec?.dtype}`);
  const [itemsize, TypedArray] = entry;
  let data;
  if (typeof spec.base64 === 'string') {
    const raw = Buffer.from(spec.base64, 'base64');
    if (raw.byteLength % itemsize) throw new OrtqError('InvalidInput', `input ${name}: ${raw.byteLength} bytes is no whole number of ${spec.dtype}`);
    const copy = new Uint8Array(raw); // aligned for the typed array
    data = new TypedArray(copy.buffer, 0, raw.byteLength / itemsize);
  } else {
    const values = Array.isArray(spec.data) ? spec.data.flat(Infinity) : [spec.data];
    data = TypedArray.from(values, (v) => (itemsize === 8 && TypedArray !== Float64Array ? BigInt(v) : typeof v === 'boolean' ? Number(v) : v));
  }
  return { dtype: spec.dtype, shape: spec.shape ?? [data.length], data };
}

function tensorToJson({ dtype, shape, data }) {
  const bytes = Buffer.from(data.buffer, data.byteOffset, data.byteLength);
  return { dtype, shape, base64: bytes.toString('base64'), data: Array.from(data, (v) => (typeof v === 'bigint' ? v.toString() : v)) };
}

function print(value) {
  process.stdout.write(`${JSON.stringify(value)}\n`);
}

async function main(argv) {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      priority: { type: 'string', default: 'normal' },
      ttl: { type: 'string' },
      'job-timeout': { type: 'string' },
      'job-id': { type: 'string' },
      'timeout-ms': { type: 'string', default: '30000' },
      model: { type: 'string' },
      nonce: { type: 'string' },
      'no-validate': { type: 'boolean', default: false },
      'allow-unknown-model': { type: 'boolean', default: false },
    },
  });
  const [command, redisUrl, target] = positionals;
  if (!['infer', 'submit', 'result', 'cancel', 'many'].includes(command) || !redisUrl || !target || positionals.length > 3) {
    throw new OrtqError('ConfigurationError', USAGE);
  }
  const number = (text) => (text === undefined ? undefined : Number(text));
  const client = new Client(redisUrl, { validate: !values['no-validate'], allowUnknownModels: values['allow-unknown-model'] });
  let jobId = command === 'result' || command === 'cancel' ? target : null;
  try {
    if (command === 'result' || command === 'cancel') {
      if (values.model === undefined) throw new OrtqError('ConfigurationError', `${command} needs the job's --model; ${USAGE}`);
      if (values.nonce !== undefined && !/^(?:[0-9a-fA-F]{2})+$/.test(values.nonce)) {
        throw new OrtqError('ConfigurationError', '--nonce takes the hex digits submit printed');
      }
      const nonce = values.nonce === undefined ? undefined : Buffer.from(values.nonce, 'hex');
      if (command === 'cancel') {
        print({ job: jobId, cancelled: await client.cancel(jobId, values.model, { nonce }) });
        return 0;
      }
      const outputs = await client.result(jobId, number(values['timeout-ms']), { model: values.model, nonce });
      print({ job: jobId, outputs: Object.fromEntries(Object.entries(outputs).map(([k, t]) => [k, tensorToJson(t)])) });
      return 0;
    }
    const parsed = JSON.parse(readFileSync(0, 'utf8'));
    const toInputs = (json) => Object.fromEntries(Object.entries(json).map(([name, spec]) => [name, tensorFromJson(name, spec)]));
    const options = { priority: values.priority, ttl: number(values.ttl), jobTimeout: number(values['job-timeout']), jobId: values['job-id'] };
    if (command === 'many') {
      if (!Array.isArray(parsed)) throw new OrtqError('ConfigurationError', 'many reads a JSON list of inputs');
      const ids = await client.submitMany(target, parsed.map(toInputs), options);
      const responses = await client.waitResponses(ids, number(values['timeout-ms']) ?? 30000);
      const results = responses.map((r) => (r.ok ? { outputs: Object.fromEntries(Object.entries(r.outputs).map(([k, t]) => [k, tensorToJson(t)])) } : { error: r.error }));
      print({ jobs: ids, results });
      return responses.every((r) => r.ok) ? 0 : 3;
    }
    const inputs = toInputs(parsed);
    jobId = await client.submit(target, inputs, options);
    if (command === 'submit') {
      print({ job: jobId, model: target, nonce: client.jobs.get(jobId).nonce.toString('hex') });
      return 0;
    }
    let outputs;
    try {
      outputs = await client.result(jobId, number(values['timeout-ms']));
    } catch (err) {
      // Nobody waits for it any more: take it off the queue, or stop its run if a worker has started it.
      if (err.type === 'ResultTimeout') await client.cancel(jobId, target);
      throw err;
    }
    print({ job: jobId, outputs: Object.fromEntries(Object.entries(outputs).map(([k, t]) => [k, tensorToJson(t)])) });
    return 0;
  } catch (err) {
    if (!(err instanceof OrtqError)) throw err;
    print({ job: err.jobId ?? jobId, error: { type: err.type, message: err.message } });
    if (err.remote) return 3;
    return LOCAL_USAGE_ERRORS.has(err.type) ? 2 : 1;
  } finally {
    await client.close();
  }
}

main(process.argv.slice(2)).then(
  (status) => {
    process.exitCode = status;
  },
  (err) => {
    const type = err instanceof OrtqError ? err.type : err.name;
    process.stderr.write(`ortq-node: ${type}: ${err.message}\n`);
    process.exitCode = err instanceof OrtqError && !LOCAL_USAGE_ERRORS.has(err.type) ? 1 : 2;
  },
);

// The ortq frame (docs/wire-format.md section 6): "ORTQ", a little-endian u32 header length H,
// a msgpack header map, zero padding to a multiple of 8, then the tensors' little-endian bytes.
// Tensors are { dtype, shape, data } with data a typed array (see DTYPES).

import { createHash } from 'node:crypto';
import { endianness } from 'node:os';
import { decode, encode } from '@msgpack/msgpack';

/** Wire dtype -> [itemsize, the typed array that holds it]. float16 travels as its raw bits. */
export const DTYPES = Object.freeze({
  bool: [1, Uint8Array],
  int8: [1, Int8Array],
  int16: [2, Int16Array],
  int32: [4, Int32Array],
  int64: [8, BigInt64Array],
  uint8: [1, Uint8Array],
  uint16: [2, Uint16Array],
  uint32: [4, Uint32Array],
  uint64: [8, BigUint64Array],
  float16: [2, Uint16Array],
  float32: [4, Float32Array],
  float64: [8, Float64Array],
});

/** The dtype a typed array stands for when none is named (Uint16Array: uint16, not float16). */
export const DEFAULT_DTYPES = new Map([
  [Int8Array, 'int8'],
  [Int16Array, 'int16'],
  [Int32Array, 'int32'],
  [BigInt64Array, 'int64'],
  [Uint8Array, 'uint8'],
  [Uint16Array, 'uint16'],
  [Uint32Array, 'uint32'],
  [BigUint64Array, 'uint64'],
  [Float32Array, 'float32'],
  [Float64Array, 'float64'],
]);

export const WIRE_VERSION = 1;
/** Bytes of a response's proof (SHA-256). */
export const PROOF_BYTES = 32;
export const MAX_HEADER_BYTES = 1024 * 1024;
export const DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024;
const MAX_DIMS = 32;
const MAGIC = Buffer.from('ORTQ', 'latin1');

/** Every error this client raises: `type` names what went wrong (a worker's error type for a
 * failed job, with `remote` true), `message` says it for a person. */
export class OrtqError extends Error {
  constructor(type, message, { jobId = null, remote = false } = {}) {
    super(message);
    this.name = 'OrtqError';
    this.type = type;
    this.jobId = jobId;
    this.remote = remote;
  }
}

function wireError(message) {
  return new OrtqError('WireFormatError', message);
}

if (endianness() !== 'LE') {
  // Typed arrays use the host's byte order; the wire's is little-endian.
  throw new OrtqError('ConfigurationError', 'this client needs a little-endian host');
}

/** A tensor as the wire carries it: its dtype, its shape and its bytes. */
function toWire(name, tensor) {
  if (typeof name !== 'string' || name === '') {
    throw new OrtqError('InvalidInput', 'tensor names must be non-empty strings');
  }
  if (tensor === null || typeof tensor !== 'object' || !ArrayBuffer.isView(tensor.data)) {
    throw new OrtqError('InvalidInput', `tensor ${JSON.stringify(name)} must be {dtype, shape, data: a typed array}`);
  }
  const dtype = tensor.dtype ?? DEFAULT_DTYPES.get(tensor.data.constructor);
  const spec = DTYPES[dtype];
  if (spec === undefined) {
    throw new OrtqError('UnsupportedDtype', `tensor ${JSON.stringify(name)} has dtype ${dtype}; supported: ${Object.keys(DTYPES).join(', ')}`);
  }
  const [itemsize, TypedArray] = spec;
  if (!(tensor.data instanceof TypedArray)) {
    throw new OrtqError('InvalidInput', `tensor ${JSON.stringify(name)}: dtype ${dtype} needs a ${TypedArray.name}, got ${tensor.data.constructor.name}`);
  }
  const shape = tensor.shape ?? [tensor.data.length];
  if (!Array.isArray(shape) || shape.length > MAX_DIMS || !shape.every((d) => Number.isSafeInteger(d) && d >= 0)) {
    throw new OrtqError('InvalidInput', `tensor ${JSON.stringify(name)}: shape must be at most ${MAX_DIMS} non-negative integers`);
  }
  const count = shape.reduce((a, b) => a * b, 1);
  if (count !== tensor.data.length) {
    throw new OrtqError('InvalidInput', `tensor ${JSON.stringify(name)}: shape [${shape}] needs ${count} elements, data has ${tensor.data.length}`);
  }
  const bytes = new Uint8Array(tensor.data.buffer, tensor.data.byteOffset, count * itemsize);
  return { dtype, shape, bytes };
}

/** A request frame for `inputs` ({name: tensor}) with `options` (ortq's: {nonce}). */
export function encodeRequest(inputs, options = {}) {
  const descriptors = {};
  const chunks = [];
  let offset = 0;
  for (const [name, tensor] of Object.entries(inputs)) {
    const { dtype, shape, bytes } = toWire(name, tensor);
    const pad = (8 - (offset % 8)) % 8; // each tensor 8-aligned, as ortq's encoder does
    if (pad) {
      chunks.push(new Uint8Array(pad));
      offset += pad;
    }
    descriptors[name] = { dtype, shape, offset, nbytes: bytes.byteLength };
    if (bytes.byteLength) chunks.push(bytes);
    offset += bytes.byteLength;
  }
  const header = encode({ v: WIRE_VERSION, kind: 'request', inputs: descriptors, options });
  if (header.byteLength > MAX_HEADER_BYTES) {
    throw new OrtqError('PayloadTooLarge', `frame header is ${header.byteLength} bytes; the limit is ${MAX_HEADER_BYTES}`);
  }
  const prefix = Buffer.alloc(8);
  MAGIC.copy(prefix, 0);
  prefix.writeUInt32LE(header.byteLength, 4);
  const padding = new Uint8Array((8 - ((8 + header.byteLength) % 8)) % 8);
  return Buffer.concat([prefix, header, padding, ...chunks]);
}

const isMap = (value) => value !== null && typeof value === 'object' && !Array.isArray(value) && !ArrayBuffer.isView(value);

/** An integer from the header as a BigInt (msgpack int64 may decode as either), else null. */
function asInteger(value) {
  if (typeof value === 'bigint') return value;
  if (typeof value === 'number' && Number.isInteger(value)) return BigInt(value);
  return null;
}

/** What binds a response to its request (protocol 3): SHA-256 of the model name's UTF-8 bytes, a
 * newline (0x0A) and the request's nonce. The worker that read the request writes it in its
 * response; the producer, who alone knows the nonce, checks it. */
export function proofOf(model, nonce) {
  return createHash('sha256').update(Buffer.from(model, 'utf8')).update(Buffer.from([0x0a])).update(nonce).digest();
}

/** A response's proof as a Buffer (null when absent); anything but PROOF_BYTES of msgpack bin is
 * a WireFormatError. */
function checkProof(value) {
  if (value === undefined || value === null) return null;
  if (!(value instanceof Uint8Array) || value.byteLength !== PROOF_BYTES) {
    throw wireError(`header 'proof' must be ${PROOF_BYTES} bytes (msgpack bin)`);
  }
  return Buffer.from(value);
}

/** Copies of the tensors `descriptors` declares, each checked to lie inside `data`. */
function readTensors(descriptors, data) {
  if (!isMap(descriptors)) throw wireError("header 'outputs' must be a map of tensor descriptors");
  const tensors = {};
  for (const [name, desc] of Object.entries(descriptors)) {
    const where = `tensor ${JSON.stringify(name).slice(0, 80)}`;
    if (name === '' || !isMap(desc)) throw wireError(`${where}: bad descriptor`);
    const spec = typeof desc.dtype === 'string' && Object.hasOwn(DTYPES, desc.dtype) ? DTYPES[desc.dtype] : undefined;
    if (spec === undefined) throw wireError(`${where}: unknown dtype`);
    const [itemsize, TypedArray] = spec;
    const dims = Array.isArray(desc.shape) ? desc.shape.map(asInteger) : null;
    if (dims === null || dims.length > MAX_DIMS || dims.some((d) => d === null || d < 0n)) {
      throw wireError(`${where}: shape must be a list of at most ${MAX_DIMS} non-negative integers`);
    }
    const offset = asInteger(desc.offset);
    const nbytes = asInteger(desc.nbytes);
    if (offset === null || nbytes === null || offset < 0n) throw wireError(`${where}: offset and nbytes must be integers, offset >= 0`);
    const needed = dims.reduce((a, b) => a * b, 1n) * BigInt(itemsize); // BigInt: no overflow
    if (needed !== nbytes) throw wireError(`${where}: declared shape needs ${needed} bytes but nbytes is ${nbytes}`);
    if (offset + nbytes > BigInt(data.byteLength)) throw wireError(`${where}: bytes lie past the data section`);
    const start = Number(offset);
    const copy = new Uint8Array(Number(nbytes)); // a copy: aligned for the typed array, and the frame can go
    copy.set(data.subarray(start, start + copy.byteLength));
    tensors[name] = { dtype: desc.dtype, shape: dims.map(Number), data: new TypedArray(copy.buffer) };
  }
  return tensors;
}

/** The response in `frame` (a Buffer): {ok, outputs, error, timings, proof} (proof: a Buffer of
 * PROOF_BYTES, or null when the response carries none); throws OrtqError of type WireFormatError
 * (or PayloadTooLarge) for anything that is not a valid response. Keys it does not know (as the
 * `nonce` of protocol 2's responses) are ignored. */
export function decodeResponse(frame, maxBytes = DEFAULT_MAX_FRAME_BYTES) {
  if (frame.byteLength > maxBytes) throw new OrtqError('PayloadTooLarge', `frame is ${frame.byteLength} bytes; the limit is ${maxBytes}`);
  if (frame.byteLength < 8 || !frame.subarray(0, 4).equals(MAGIC)) throw wireError('not an ortq frame (bad magic, or shorter than its prefix)');
  const size = frame.readUInt32LE(4);
  const dataStart = Math.ceil((8 + size) / 8) * 8;
  if (dataStart > frame.byteLength) throw wireError(`truncated frame: header length ${size} needs ${dataStart} bytes, frame has ${frame.byteLength}`);
  if (size > MAX_HEADER_BYTES) throw new OrtqError('PayloadTooLarge', `frame header is ${size} bytes; the limit is ${MAX_HEADER_BYTES}`);
  let header;
  try {
    header = decode(frame.subarray(8, 8 + size), {
      useBigInt64: true,
      maxStrLength: size,
      maxBinLength: size,
      maxArrayLength: size,
      maxMapLength: size,
      maxExtLength: 0, // the format has no extension types
    });
  } catch (err) {
    throw wireError(`header is not one valid msgpack object: ${String(err.message).slice(0, 120)}`);
  }
  if (!isMap(header)) throw wireError('header must be a msgpack map');
  if (header.v !== WIRE_VERSION && header.v !== BigInt(WIRE_VERSION)) throw wireError(`unsupported wire version ${String(header.v).slice(0, 80)}; this decoder supports ${WIRE_VERSION}`);
  if (header.kind !== 'response') throw wireError(`expected a response frame, got kind ${String(header.kind).slice(0, 80)}`);
  const timings = header.timings ?? {};
  if (!isMap(timings) || !Object.values(timings).every((t) => typeof t === 'number' || typeof t === 'bigint')) {
    throw wireError("header 'timings' must be a map of string to number");
  }
  const proof = checkProof(header.proof);
  const data = frame.subarray(dataStart);
  const floatTimings = Object.fromEntries(Object.entries(timings).map(([k, t]) => [k, Number(t)]));
  if (header.ok === true) {
    return { ok: true, outputs: readTensors(header.outputs, data), error: null, timings: floatTimings, proof };
  }
  if (header.ok !== false) throw wireError("header 'ok' must be true or false");
  const error = header.error;
  if (!isMap(error) || typeof error.type !== 'string' || typeof error.message !== 'string') {
    throw wireError("a failed response needs 'error': {type: str, message: str}");
  }
  return { ok: false, outputs: {}, error: { type: error.type, message: error.message }, timings: floatTimings, proof };
}

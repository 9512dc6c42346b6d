// The frame codec against docs/wire-format.md's own examples and against hostile frames.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import { encode } from '@msgpack/msgpack';
import { decodeResponse, encodeRequest, proofOf } from '../frame.mjs';

const DOC = readFileSync(new URL('../../../docs/wire-format.md', import.meta.url), 'utf8');

function docHex(after) {
  const start = DOC.indexOf('```\n', DOC.indexOf(after)) + 4;
  return DOC.slice(start, DOC.indexOf('```', start)).replace(/\s/g, '');
}

function responseFrame(header, data = Buffer.alloc(0)) {
  const packed = Buffer.from(encode(header));
  const prefix = Buffer.alloc(8);
  prefix.write('ORTQ', 0, 'latin1');
  prefix.writeUInt32LE(packed.byteLength, 4);
  const pad = Buffer.alloc((8 - ((8 + packed.byteLength) % 8)) % 8);
  return Buffer.concat([prefix, packed, pad, data]);
}

test('the worked example of section 6.6, byte for byte', () => {
  const frame = encodeRequest({ x: { dtype: 'float32', shape: [2], data: new Float32Array([1, 2]) } });
  assert.equal(frame.toString('hex'), docHex('As one hex string:'));
});

test("the job hash's data for model digits (section 3.3)", () => {
  const row = DOC.split('\n').find((line) => line.startsWith('| `data` |'));
  const hex = row.match(/for model `digits`: `([0-9a-f ]+)`/)[1].replace(/ /g, '');
  assert.equal(Buffer.from(encode(['ortq.rqjob.infer', null, ['digits'], {}])).toString('hex'), hex);
});

test('a response decodes to typed arrays, at any offsets', () => {
  const data = Buffer.alloc(3 + 16);
  data.writeBigInt64LE(-5n, 3);
  data.writeBigInt64LE(2n ** 62n, 11);
  const proof = Buffer.alloc(32, 7);
  const frame = responseFrame({
    v: 1, kind: 'response', ok: true, proof, timings: { run: 0.5, queue: 1 },
    outputs: { i: { dtype: 'int64', shape: [2, 1], offset: 3, nbytes: 16 }, e: { dtype: 'float32', shape: [0, 5], offset: 0, nbytes: 0 } },
  }, data);
  const response = decodeResponse(frame);
  assert.equal(response.ok, true);
  assert.deepEqual(response.outputs.i, { dtype: 'int64', shape: [2, 1], data: new BigInt64Array([-5n, 2n ** 62n]) });
  assert.deepEqual(response.outputs.e.shape, [0, 5]);
  assert.deepEqual(response.timings, { run: 0.5, queue: 1 });
  assert.ok(response.proof.equals(proof));
});

test("the proof is SHA-256 of the model's UTF-8 name, a newline and the nonce (as ortq.wire.proof_of)", () => {
  assert.equal(proofOf('tiny', Buffer.from([...Array(16).keys()])).toString('hex'), '7700edef92c7e2b9589139ed49e3b1e72b9c3d74fb63a0b3a208aa95c85ba896');
  assert.equal(proofOf('m\u00f6del', Buffer.alloc(16, 7)).toString('hex'), '34b05a5861dfaad7f9a8a54a012e17c3d237ee4f053c1a15facab127c510b0f4');
});

test("a protocol 2 response's nonce is ignored; its proof is null", () => {
  const header = { v: 1, kind: 'response', ok: false, nonce: Buffer.alloc(4), error: { type: 'InvalidInput', message: 'no' } };
  assert.equal(decodeResponse(responseFrame(header)).proof, null);
});

test('a failed response', () => {
  const response = decodeResponse(responseFrame({ v: 1, kind: 'response', ok: false, error: { type: 'InvalidInput', message: 'no' } }));
  assert.deepEqual([response.ok, response.error, response.proof], [false, { type: 'InvalidInput', message: 'no' }, null]);
});

test('hostile frames are WireFormatErrors, never reads outside the frame', () => {
  const good = { v: 1, kind: 'response', ok: true, outputs: { y: { dtype: 'uint8', shape: [4], offset: 0, nbytes: 4 } } };
  const bad = [
    Buffer.from('ORT'),
    Buffer.from('XXXX\0\0\0\0'),
    responseFrame(good).subarray(0, 12),
    responseFrame(good), // no data section: 4 bytes past the end
    responseFrame({ ...good, v: 2 }, Buffer.alloc(4)),
    responseFrame({ ...good, v: true }, Buffer.alloc(4)),
    responseFrame({ ...good, kind: 'request' }, Buffer.alloc(4)),
    responseFrame({ ...good, ok: 1 }, Buffer.alloc(4)),
    responseFrame({ ...good, proof: Buffer.alloc(4) }, Buffer.alloc(4)),
    responseFrame({ ...good, proof: Buffer.alloc(33) }, Buffer.alloc(4)),
    responseFrame({ ...good, proof: 'a string proof, 32 characters!!' }, Buffer.alloc(4)),
    responseFrame({ ...good, proof: 32 }, Buffer.alloc(4)),
    responseFrame({ v: 1, kind: 'response', ok: false, proof: Buffer.alloc(16), error: { type: 'WorkerLost', message: 'x' } }),
    responseFrame({ ...good, outputs: { y: { dtype: 'uint8', shape: [5], offset: 0, nbytes: 4 } } }, Buffer.alloc(4)),
    responseFrame({ ...good, outputs: { y: { dtype: 'uint8', shape: [-4], offset: 0, nbytes: 4 } } }, Buffer.alloc(4)),
    responseFrame({ ...good, outputs: { y: { dtype: 'string', shape: [4], offset: 0, nbytes: 4 } } }, Buffer.alloc(4)),
    responseFrame({ ...good, outputs: { y: { dtype: 'uint8', shape: [4], offset: 1, nbytes: 4 } } }, Buffer.alloc(4)),
    responseFrame({ ...good, outputs: { y: { dtype: 'uint64', shape: [2 ** 31, 2 ** 31, 2 ** 31], offset: 0, nbytes: 0 } } }),
    responseFrame({ v: 1, kind: 'response', ok: false, error: { type: 'X' } }),
  ];
  for (const frame of bad) {
    assert.throws(() => decodeResponse(frame), (err) => err.type === 'WireFormatError', frame.toString('hex'));
  }
  assert.throws(() => decodeResponse(Buffer.alloc(64), 32), (err) => err.type === 'PayloadTooLarge');
});

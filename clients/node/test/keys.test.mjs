// The keys and entry ids of protocol 4 (docs/wire-format.md, section 4.1), without a Redis.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Client, ENQUEUE_HIGH_SCRIPT, ENQUEUE_UNIQUE_SCRIPT, PROTOCOL, entryBefore, largeReplyKey, newReplyName, replyKey } from '../ortq.mjs';

test('this client speaks protocol 4', () => {
  assert.equal(PROTOCOL, 4);
});

test('a reply name is 32 lowercase hex digits, a dot and the seconds its answers are kept (1 to a year)', () => {
  assert.match(newReplyName(600), /^[0-9a-f]{32}\.600$/);
  assert.notEqual(newReplyName(600), newReplyName(600));
  assert.match(newReplyName(0), /\.1$/);
  assert.match(newReplyName(10 ** 9), /\.31536000$/);
});

test("a client's reply name keeps its answers its resultTtl", () => {
  const client = new Client('redis://127.0.0.1:1/0', { resultTtl: 1234 });
  assert.match(client.replyName, /^[0-9a-f]{32}\.1234$/);
  client.redis.disconnect();
  client.blocking.disconnect();
  client.enqueuer.disconnect();
});

test('reply streams and large answers never collide: a reply name has a dot, a job id never', () => {
  assert.equal(replyKey('tiny', 'ab.600'), 'ortq:reply:tiny:ab.600');
  assert.equal(largeReplyKey('tiny', 'job-1'), 'ortq:reply:tiny:job-1');
});

test('the entry id just below another', () => {
  assert.equal(entryBefore('1700000000000-5'), '1700000000000-4');
  assert.equal(entryBefore('1700000000000-0'), '1699999999999-18446744073709551615');
  assert.equal(entryBefore('5-18446744073709551615'), '5-18446744073709551614');
  assert.equal(entryBefore('0-1'), '0-0');
  for (const none of ['0-0', '', '12', 'a-1', '1-', '-1', '1-2-3']) assert.equal(entryBefore(none), null, none);
});

test("the unique enqueue's EVAL script is section 3.5's code as a local function, then the function's own", () => {
  const body = ENQUEUE_HIGH_SCRIPT.slice(ENQUEUE_HIGH_SCRIPT.indexOf('\n') + 1).replace(/\n$/, '');
  const local = `local function enqueue_high(keys, args)\n${body.split('\n').map((line) => `  ${line}`).join('\n')}\nend\n`;
  assert.ok(ENQUEUE_UNIQUE_SCRIPT.startsWith(`${local}local keys, args = KEYS, ARGV\n-- Enqueue a job under an id`));
  assert.ok(ENQUEUE_UNIQUE_SCRIPT.includes("redis.call('HSET', job, unpack(args, 9))"));
  assert.ok(!ENQUEUE_UNIQUE_SCRIPT.includes('reply'.concat(' key')));
});

"""Jobs enqueued and read with plain Redis commands, exactly as docs/wire-format.md says.

Nothing from ortq is used on the client side: the frame is built with struct + msgpack, the
commands are sent with ``execute_command``, answers are read from this client's own reply stream
(section 4.1) and the response is parsed by hand, as a service in another language would. (ortq is
imported once, to load the worker's Redis function before any worker runs, and to check that the
doc's EVAL script is ortq's.)
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
import uuid
import zlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis

from ortq import redisfunctions
from tests.conftest import REPO, WorkerProcesses, eventually

pytestmark = pytest.mark.rqcompat  # also in the second pass: raw replies under redis-py 5.0 too

WAIT = 600  # <wait>: min(request_ttl, ttl) of these jobs
FAILURE_TTL = 600
KEEP = 600  # the seconds this client's answers are kept: its reply name's <keep> (section 1)
#: This client's reply name (section 1): a random token, a dot, <keep>.
REPLY_NAME = f"{uuid.uuid4().hex}.{KEEP}"


def doc_high_priority_script() -> str:
    """The EVAL script of docs/wire-format.md section 3.5, as written there."""
    doc = (REPO / "docs" / "wire-format.md").read_text()
    section = doc[doc.index("### 3.5 High priority") : doc.index("### 3.6")]
    found = re.search(r"```lua\n(.*?)```", section, re.S)
    assert found is not None
    return found.group(1)


def request_frame(name: str, array: np.ndarray, nonce: bytes | None = None) -> bytes:
    data = array.astype("<f4").tobytes(order="C")
    header = msgpack.packb(
        {
            "v": 1,
            "kind": "request",
            "inputs": {name: {"dtype": "float32", "shape": list(array.shape), "offset": 0, "nbytes": len(data)}},
            **({"options": {"nonce": nonce}} if nonce is not None else {}),
        }
    )
    frame = b"ORTQ" + struct.pack("<I", len(header)) + header
    return frame + b"\0" * (-len(frame) % 8) + data


def parse_response(frame: bytes) -> dict[str, Any]:
    assert frame[:4] == b"ORTQ"
    (length,) = struct.unpack_from("<I", frame, 4)
    header: dict[str, Any] = msgpack.unpackb(frame[8 : 8 + length])
    data_start = (8 + length + 7) // 8 * 8
    assert header["v"] == 1 and header["kind"] == "response"
    if header["ok"]:
        outputs = {}
        for name, d in header["outputs"].items():
            raw = frame[data_start + d["offset"] : data_start + d["offset"] + d["nbytes"]]
            outputs[name] = np.frombuffer(raw, dtype=np.dtype(d["dtype"]).newbyteorder("<")).reshape(d["shape"])
        header["outputs"] = outputs
    return header


def rq_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def job_fields(model: str, **overrides: object) -> dict[str, object]:
    """The job hash of section 3.3; an override of None leaves the field out."""
    now = rq_now()
    fields: dict[str, object] = {
        "status": "queued",
        "origin": f"ortq:{model}",
        "data": msgpack.packb(["ortq.rqjob.infer", None, [model], {}]),
        "description": f"ortq.rqjob.infer('{model}')",
        "created_at": now,
        "enqueued_at": now,
        "result_ttl": 600,
        "failure_ttl": FAILURE_TTL,
        "ortq_reply": REPLY_NAME,
        **overrides,
    }
    return {k: v for k, v in fields.items() if v is not None}


def enqueue_by_hand(
    r: redis.Redis, model: str, frame: bytes, *, high: str | None = None, job_id: str | None = None, **fields: object
) -> str:
    """Section 3.2's transaction for one job; ``high``: 'fcall' or 'eval' (section 3.5)."""
    job_id = job_id or str(uuid.uuid4())
    queue, last_high = f"rq:queue:ortq:{model}", f"ortq:last-high:{model}"
    flat = [item for pair in job_fields(model, **fields).items() for item in pair]
    r.execute_command("MULTI")
    r.execute_command("SET", f"ortq:req:{model}:{job_id}", frame, "EX", WAIT)
    r.execute_command("HSET", f"rq:job:{job_id}", *flat)
    r.execute_command("EXPIRE", f"rq:job:{job_id}", WAIT + FAILURE_TTL)
    r.execute_command("SADD", "rq:queues", queue)
    if high == "fcall":
        r.execute_command("FCALL", "ortq_enqueue_high_v2", 2, queue, last_high, job_id, WAIT)
    elif high == "eval":
        r.execute_command("EVAL", doc_high_priority_script(), 2, queue, last_high, job_id, WAIT)
    else:
        r.execute_command("RPUSH", queue, job_id)
    replies = r.execute_command("EXEC")
    assert not any(isinstance(reply, Exception) for reply in replies), replies
    return job_id


def raw_client(url: str) -> redis.Redis:
    """A client that hands back each reply as RESP2 gives it (redis-py's reply parsing off: a
    ``QUEUED`` inside MULTI is not fed to ZADD's number parser), to be read by hand."""
    client = redis.Redis.from_url(url, socket_timeout=5, protocol=2)
    client.response_callbacks.clear()
    return client


def reply_stream(model: str) -> str:
    """This client's reply stream of ``model`` (section 4.1)."""
    return f"ortq:reply:{model}:{REPLY_NAME}"


class Replies:
    """Section 4.1's wait: one XREAD of this client's reply streams, a cursor per stream (from 0-0),
    the answers read kept by job id until taken."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.cursors: dict[str, bytes] = {}
        self.answers: dict[str, tuple[bytes, bytes]] = {}  # job id -> (entry id, frame)

    def read(self, models: list[str], block_ms: int) -> None:
        for model in models:
            self.cursors.setdefault(reply_stream(model), b"0-0")
        streams = list(self.cursors)
        reply = self.r.execute_command(
            "XREAD", "BLOCK", block_ms, "COUNT", 1000, "STREAMS", *streams, *(self.cursors[s] for s in streams)
        )
        for stream, entries in reply or []:
            for entry_id, raw in entries:
                self.cursors[stream.decode()] = entry_id
                fields = as_dict(raw)
                self.answers.setdefault(fields[b"id"].decode(), (entry_id, bytes(fields[b"frame"])))

    def wait(self, model: str, job_id: str) -> bytes:
        """The response frame of ``job_id``: its entry's ``frame``, or (empty) its large answer's key."""
        for _ in range(20):  # 20 x 1 s blocks, each under the client's socket timeout
            if job_id in self.answers:
                break
            self.read([model], 1000)
        else:
            raise AssertionError("no reply")
        _entry_id, frame = self.answers.pop(job_id)
        if frame:
            return frame
        large = f"ortq:reply:{model}:{job_id}"
        [[_, [[_, fields]]]] = self.r.execute_command("XREAD", "COUNT", 1, "STREAMS", large, "0-0")
        return bytes(as_dict(fields)[b"frame"])

    def seen(self, job_id: str) -> bool:
        """Whether an entry for ``job_id`` was read (after a read that comes back at once)."""
        self.read([], 1)
        return job_id in self.answers


def entry_before(entry_id: bytes) -> str:
    """The id just below ``entry_id`` (section 4.1)."""
    ms, seq = (int(part) for part in entry_id.split(b"-"))
    return f"{ms}-{seq - 1}" if seq > 0 else f"{ms - 1}-18446744073709551615"


def look_up(r: redis.Redis, model: str, job_id: str) -> bytes | None:
    """Section 4.1's look-up, for a reader that did not follow the stream: the frame, or None when
    the job is not answered yet."""
    name = r.execute_command("HGET", f"rq:job:{job_id}", "ortq_reply")
    answer = r.execute_command("HGET", f"rq:job:{job_id}", "ortq_answer")
    if name is None or answer is None:
        return None
    stream = f"ortq:reply:{model}:{name.decode()}"
    [[_, [[entry_id, fields]]]] = r.execute_command("XREAD", "COUNT", 1, "STREAMS", stream, entry_before(answer))
    fields = as_dict(fields)
    assert entry_id == answer and fields[b"id"] == job_id.encode()
    return bytes(fields[b"frame"])


def as_dict(fields: Any) -> dict[bytes, bytes]:
    """A stream entry's fields (redis-py parses them into a dict; raw RESP is a flat list)."""
    return fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2], strict=True))


def latest_result(r: redis.Redis, job_id: str) -> dict[bytes, bytes]:
    """The newest entry of RQ's result stream (section 4.6)."""
    [(_entry_id, fields)] = r.execute_command("XREVRANGE", f"rq:results:{job_id}", "+", "-", "COUNT", 1)
    return as_dict(fields)


def test_doc_script_is_ortqs() -> None:
    assert doc_high_priority_script() == redisfunctions.script_source()


def test_raw_enqueue_and_read(workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path) -> None:
    r = raw_client(redis_url)
    x = np.array([[1, 2, 3, 4], [-1, 0, 0.5, 8]], dtype=np.float32)
    job_id = enqueue_by_hand(r, model_name, request_frame("x", x, nonce=b"0123456789abcdef"))
    # Until a worker starts it, the job hash expires (section 3.2), as does the request frame.
    assert 0 < r.execute_command("TTL", f"rq:job:{job_id}") <= WAIT + FAILURE_TTL
    assert 0 < r.execute_command("TTL", f"ortq:req:{model_name}:{job_id}") <= WAIT

    workers.serve(tiny_path, model_name, redis_url)
    signature = json.loads(r.execute_command("GET", f"ortq:signature:{model_name}"))
    assert signature["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]
    assert signature["protocol"] == 4
    replies = Replies(r)
    response = parse_response(replies.wait(model_name, job_id))
    # Section 4.3: the proof is SHA-256 of the model's name, a newline and the request's nonce; the
    # nonce itself is never echoed.
    assert response["ok"] is True and "nonce" not in response
    assert response["proof"] == hashlib.sha256(model_name.encode() + b"\n0123456789abcdef").digest()
    assert set(response["timings"]) == {"queue", "decode", "run"}
    np.testing.assert_array_equal(response["outputs"]["y"], x * 2 + 1)
    # The response stays readable (in this client's stream, which lives <keep> seconds after its
    # last answer; no key of the job's own for a small frame), the job's status is already final,
    # the request frame is gone.
    stream = reply_stream(model_name)
    assert r.execute_command("XLEN", stream) == 1
    assert r.execute_command("EXISTS", f"ortq:reply:{model_name}:{job_id}") == 0
    assert r.execute_command("HGET", f"rq:job:{job_id}", "status") == b"finished"
    assert r.execute_command("EXISTS", f"ortq:req:{model_name}:{job_id}") == 0
    assert 0 < r.execute_command("TTL", stream) <= KEEP
    # A reader that did not follow the stream finds the same answer through the job hash.
    assert parse_response(look_up(r, model_name, job_id) or b"")["proof"] == response["proof"]
    result = latest_result(r, job_id)
    assert result[b"type"] == b"1"
    summary = msgpack.unpackb(base64.b64decode(result[b"return_value"]))
    assert summary["reply_key"] == stream
    assert summary["outputs"] == {"y": ["float32", [2, 4]]} and summary["batch_size"] == 1

    bad = enqueue_by_hand(r, model_name, request_frame("not_x", x, nonce=b"fedcba9876543210"))
    failure = parse_response(replies.wait(model_name, bad))
    assert (
        failure["ok"] is False
        and failure["proof"] == hashlib.sha256(model_name.encode() + b"\nfedcba9876543210").digest()
    )
    assert failure["error"]["type"] == "InvalidInput"
    assert "not_x" in failure["error"]["message"]
    assert r.execute_command("HGET", f"rq:job:{bad}", "status") == b"failed"
    result = latest_result(r, bad)
    assert result[b"type"] == b"2"
    assert zlib.decompress(base64.b64decode(result[b"exc_string"])).decode().startswith("InvalidInput: ")


def test_raw_priority_and_cancel(workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path) -> None:
    """High priority by FCALL and by the doc's EVAL, a cancel, then a worker serves the rest."""
    r = raw_client(redis_url)
    # What every worker does at start-up; here before any worker runs, so the queue stays still.
    r.execute_command("FUNCTION", "LOAD", "REPLACE", redisfunctions.library_source())
    x = np.ones((1, 4), dtype=np.float32)
    frame = request_frame("x", x)
    normal = [enqueue_by_hand(r, model_name, frame) for _ in range(3)]
    high1 = enqueue_by_hand(r, model_name, frame, high="eval", ortq_priority="high")
    high2 = enqueue_by_hand(r, model_name, frame, high="fcall", ortq_priority="high")
    queue = f"rq:queue:ortq:{model_name}"
    assert [i.decode() for i in r.execute_command("LRANGE", queue, 0, -1)] == [high1, high2, *normal]
    assert r.execute_command("GET", f"ortq:last-high:{model_name}") == high2.encode()
    assert 0 < r.execute_command("TTL", f"ortq:last-high:{model_name}") <= WAIT

    canceled = normal.pop()
    assert r.execute_command("LREM", queue, 0, canceled) == 1
    r.execute_command("MULTI")
    r.execute_command("DEL", f"ortq:req:{model_name}:{canceled}")
    r.execute_command("HSET", f"rq:job:{canceled}", "status", "canceled")
    r.execute_command("ZADD", f"rq:canceled:ortq:{model_name}", int(datetime.now(UTC).timestamp()), canceled)
    r.execute_command("EXEC")
    assert r.execute_command("LREM", queue, 0, canceled) == 0  # a second cancel finds nothing

    workers.serve(tiny_path, model_name, redis_url)
    replies = Replies(r)
    for job_id in [high1, high2, *normal]:
        response = parse_response(replies.wait(model_name, job_id))
        np.testing.assert_array_equal(response["outputs"]["y"], x * 2 + 1)
    assert not replies.seen(canceled) and look_up(r, model_name, canceled) is None
    assert r.execute_command("HGET", f"rq:job:{canceled}", "status") == b"canceled"


def test_raw_lenient_fields_and_bad_ids(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    """What the worker does with what section 3.3/3.4 call optional or unreadable, and with ids
    outside the rule (section 1)."""
    workers.serve(tiny_path, model_name, redis_url)
    r = raw_client(redis_url)
    x = np.zeros((1, 4), dtype=np.float32)

    # No result_ttl / failure_ttl: the worker's own (600 s by default) apply to the job hash. An
    # ISO time with an offset is read: the queue timing is there.
    iso = datetime.now(UTC).isoformat()
    lenient = enqueue_by_hand(
        r, model_name, request_frame("x", x), result_ttl=None, failure_ttl=None, created_at=iso, enqueued_at=iso
    )
    replies = Replies(r)
    response = parse_response(replies.wait(model_name, lenient))
    assert response["ok"] is True and "queue" in response["timings"]
    eventually(lambda: r.execute_command("HGET", f"rq:job:{lenient}", "status") == b"finished")
    assert 0 < r.execute_command("TTL", f"rq:job:{lenient}") <= 600
    # An unreadable enqueued_at is no error: no queue timing, and the job still runs.
    odd = enqueue_by_hand(r, model_name, request_frame("x", x), enqueued_at="1714564800", ttl=5)
    response = parse_response(replies.wait(model_name, odd))
    assert response["ok"] is True and "queue" not in response["timings"]

    # An id outside the rule is dropped (and logged): nothing is written for it (section 1); the
    # worker goes on serving.
    outside = [f"{model_name}.bad", f"{model_name} bad"]
    for bad_id in outside:
        enqueue_by_hand(r, model_name, request_frame("x", x), job_id=bad_id)
    after = enqueue_by_hand(r, model_name, request_frame("x", x))
    assert parse_response(replies.wait(model_name, after))["ok"] is True
    for bad_id in outside:
        assert not replies.seen(bad_id)
        assert r.execute_command("EXISTS", f"ortq:reply:{model_name}:{bad_id}") == 0
        assert r.execute_command("HGET", f"rq:job:{bad_id}", "status") == b"queued"
    # A job whose record's origin is another queue is not run (section 3.3): it stays as it was.
    elsewhere = enqueue_by_hand(r, model_name, request_frame("x", x), origin="ortq:another-model")
    after = enqueue_by_hand(r, model_name, request_frame("x", x))
    assert parse_response(replies.wait(model_name, after))["ok"] is True
    assert not replies.seen(elsewhere) and look_up(r, model_name, elsewhere) is None
    assert r.execute_command("HGET", f"rq:job:{elsewhere}", "status") == b"queued"

    # A job that names no reply stream (a producer of another protocol: section 3.3) is failed
    # InvalidJob and answered nowhere; the worker goes on serving.
    unnamed = enqueue_by_hand(r, model_name, request_frame("x", x), ortq_reply=None)
    forged = enqueue_by_hand(r, model_name, request_frame("x", x), ortq_reply="no-keep")
    after = enqueue_by_hand(r, model_name, request_frame("x", x))
    assert parse_response(replies.wait(model_name, after))["ok"] is True
    for job_id in (unnamed, forged):
        eventually(lambda job_id=job_id: r.execute_command("HGET", f"rq:job:{job_id}", "status") == b"failed")
        assert not replies.seen(job_id) and r.execute_command("HGET", f"rq:job:{job_id}", "ortq_answer") is None
        exc = zlib.decompress(base64.b64decode(latest_result(r, job_id)[b"exc_string"])).decode()
        assert exc.startswith("InvalidJob: ") and "ortq_reply" in exc

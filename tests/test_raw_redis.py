"""A job enqueued and read with plain Redis commands, exactly as docs/wire-format.md says.

Nothing from ortq is used on the client side: the frame is built with struct + msgpack, the
commands are sent with ``execute_command``, and the response is parsed by hand, as a service in
another language would.
"""

from __future__ import annotations

import json
import struct
import uuid
from datetime import UTC, datetime
from pathlib import Path

import msgpack
import numpy as np
import redis

from tests.conftest import WorkerProcesses


def request_frame(name: str, array: np.ndarray) -> bytes:
    data = array.astype("<f4").tobytes(order="C")
    header = msgpack.packb(
        {
            "v": 1,
            "kind": "request",
            "inputs": {name: {"dtype": "float32", "shape": list(array.shape), "offset": 0, "nbytes": len(data)}},
        }
    )
    frame = b"ORTQ" + struct.pack("<I", len(header)) + header
    return frame + b"\0" * (-len(frame) % 8) + data


def parse_response(frame: bytes) -> dict[str, object]:
    assert frame[:4] == b"ORTQ"
    (length,) = struct.unpack_from("<I", frame, 4)
    header: dict[str, object] = msgpack.unpackb(frame[8 : 8 + length])
    data_start = (8 + length + 7) // 8 * 8
    assert header["v"] == 1 and header["kind"] == "response"
    if header["ok"]:
        outputs = {}
        for name, d in header["outputs"].items():  # type: ignore[attr-defined]
            raw = frame[data_start + d["offset"] : data_start + d["offset"] + d["nbytes"]]
            outputs[name] = np.frombuffer(raw, dtype=np.dtype(d["dtype"]).newbyteorder("<")).reshape(d["shape"])
        header["outputs"] = outputs
    return header


def enqueue_by_hand(r: redis.Redis, model: str, frame: bytes) -> str:
    job_id = str(uuid.uuid4())
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    data = msgpack.packb(["ortq.rqjob.infer", None, [model], {}])
    r.execute_command("MULTI")
    r.execute_command("SET", f"ortq:req:{job_id}", frame, "EX", 600)
    r.execute_command(
        "HSET", f"rq:job:{job_id}", "status", "queued", "origin", f"ortq:{model}", "data", data,
        "description", f"ortq.rqjob.infer('{model}')", "created_at", now, "enqueued_at", now,
        "result_ttl", 600, "failure_ttl", 600,
    )  # fmt: skip
    r.execute_command("SADD", "rq:queues", f"rq:queue:ortq:{model}")
    r.execute_command("RPUSH", f"rq:queue:ortq:{model}", job_id)
    r.execute_command("EXEC")
    return job_id


def wait_reply(r: redis.Redis, job_id: str) -> bytes:
    key = f"ortq:reply:{job_id}"
    for _ in range(20):  # 20 x 1 s blocks, each under the client's socket timeout
        frame = r.execute_command("BLMOVE", key, key, "RIGHT", "LEFT", 1)
        if frame is not None:
            return bytes(frame)
    raise AssertionError("no reply")


def test_raw_enqueue_and_read(workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    r = redis.Redis.from_url(redis_url, socket_timeout=5)
    signature = json.loads(r.execute_command("GET", f"ortq:signature:{model_name}"))
    assert signature["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]

    x = np.array([[1, 2, 3, 4], [-1, 0, 0.5, 8]], dtype=np.float32)
    job_id = enqueue_by_hand(r, model_name, request_frame("x", x))
    response = parse_response(wait_reply(r, job_id))
    assert response["ok"] is True
    np.testing.assert_array_equal(response["outputs"]["y"], x * 2 + 1)  # type: ignore[index]
    # The response stays readable, and the job's status is already final.
    assert r.execute_command("LINDEX", f"ortq:reply:{job_id}", 0) is not None
    assert r.execute_command("HGET", f"rq:job:{job_id}", "status") == b"finished"

    bad = enqueue_by_hand(r, model_name, request_frame("not_x", x))
    failure = parse_response(wait_reply(r, bad))
    assert failure["ok"] is False
    assert failure["error"]["type"] == "InvalidInput"  # type: ignore[index]
    assert "not_x" in failure["error"]["message"]  # type: ignore[index]
    assert r.execute_command("HGET", f"rq:job:{bad}", "status") == b"failed"

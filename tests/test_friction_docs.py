"""docs/operations.md's list of a job's timings is what real workers put in its response frame and
in RQ's result record (docs/wire-format.md 4.5 and 4.6 are the reference; ortq/worker/jobs.py
writes them), with batching and without."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import msgpack
import numpy as np
import redis

from ortq.producer import Producer
from tests.conftest import REPO, WorkerProcesses, eventually


def documented_timings() -> tuple[set[str], set[str], set[str]]:
    """(the frame's, the frame's with batching only, what RQ's result adds), as operations.md lists them."""
    text = " ".join((REPO / "docs" / "operations.md").read_text().split())
    found = re.search(
        r"its response frame \(.*?\) has (?P<frame>.+?), and with batching \(.*?\) (?P<batching>.+?); "
        r"RQ's result record \(.*?\) has the same and (?P<rq>`\w+`)",
        text,
    )
    assert found, "operations.md no longer lists a job's timings where this test looks"
    names = {part: set(re.findall(r"`(\w+)`", found.group(part))) for part in ("frame", "batching", "rq")}
    return names["frame"], names["batching"], names["rq"]


def rq_result_timings(connection: redis.Redis, job_id: str) -> set[str]:
    """The timings in RQ's newest result entry of the job (docs/wire-format.md 4.6)."""
    [(_, entry)] = connection.xrevrange(f"rq:results:{job_id}", count=1)
    summary = msgpack.unpackb(base64.b64decode(entry[b"return_value"]))
    return set(summary["timings"])


def test_operations_md_lists_the_timings_jobs_carry(
    workers: WorkerProcesses,
    producer: Producer,
    connection: redis.Redis,
    redis_url: str,
    model_name: str,
    tiny_path: Path,
) -> None:
    frame, batching, rq = documented_timings()
    assert frame == {"queue", "decode", "run"} and batching == {"batch_wait"} and rq == {"encode"}  # as read
    batched = model_name + "-batched"
    workers.serve(tiny_path, model_name, redis_url)
    workers.serve(tiny_path, batched, redis_url, 1, "--max-batch", "4", "--rows-independent")
    for model, expected in ((model_name, frame), (batched, frame | batching)):
        job = producer.submit(model, {"x": np.ones((1, 4), np.float32)})
        response = producer.wait_response(job.id, model, 30, job.proof)
        assert response.ok and set(response.timings) == expected, (model, response.timings)
        eventually(lambda job_id=job.id: connection.exists(f"rq:results:{job_id}") == 1)  # just after the reply
        assert rq_result_timings(connection, job.id) == expected | rq, model

"""What ``ortq info`` shows: models, their workers and their queues, read from Redis.

Reads only JSON records and plain counters: nothing here unpickles (RQ's ``rq info``
would, for the workers' records).
"""

from __future__ import annotations

import json
from typing import Any

import redis

from ortq import keys
from ortq.signature import ModelSignature


def _models_with_signatures(connection: redis.Redis) -> dict[str, dict[str, Any]]:
    models: dict[str, dict[str, Any]] = {}
    prefix = keys.signature_key("")
    for raw_key in connection.scan_iter(match=prefix + "*", count=500):
        key = keys.as_text(raw_key)
        raw = connection.get(key)
        if raw is None:
            continue
        models[key[len(prefix) :]] = ModelSignature.loads(raw).to_json()
    return models


def _workers(connection: redis.Redis) -> list[dict[str, Any]]:
    names = sorted(keys.as_text(n) for n in connection.smembers(keys.WORKERS_SET))
    if not names:
        return []
    records = connection.mget([keys.worker_key(n) for n in names])
    live = []
    for name, raw in zip(names, records, strict=True):
        if raw is None:  # the worker died without cleaning up; its record expired
            connection.srem(keys.WORKERS_SET, name)
            continue
        record = json.loads(raw)
        # RQ's own worker hash holds the live state and counters.
        stats = connection.hmget(
            "rq:worker:" + name, ["state", "successful_job_count", "failed_job_count", "current_job"]
        )
        record["state"], ok, failed, current = (None if v is None else keys.as_text(v) for v in stats)
        record["successful_jobs"] = int(ok or 0)
        record["failed_jobs"] = int(failed or 0)
        record["current_job"] = current
        live.append(record)
    return live


def collect(connection: redis.Redis) -> dict[str, Any]:
    """Everything ``ortq info`` prints, as one JSON-able dict."""
    signatures = _models_with_signatures(connection)
    workers = _workers(connection)
    names = set(signatures) | {w["model"] for w in workers}
    for raw_queue in connection.smembers(keys.RQ_QUEUES_SET):
        queue_key = keys.as_text(raw_queue)
        model = keys.model_from_queue_name(queue_key.removeprefix("rq:queue:"))
        if model:
            names.add(model)
    models = []
    for name in sorted(names):
        queue = keys.queue_name(name)
        with connection.pipeline(transaction=False) as pipe:
            pipe.llen(keys.queue_key(name))
            pipe.zcard("rq:wip:" + queue)
            pipe.zcard("rq:failed:" + queue)
            pipe.zcard("rq:finished:" + queue)
            queued, started, failed, finished = pipe.execute()
        models.append(
            {
                "model": name,
                "queue": queue,
                "queued": queued,
                "started": started,
                "failed": failed,
                "finished": finished,
                "signature": signatures.get(name),
                "workers": [w for w in workers if w["model"] == name],
            }
        )
    return {"models": models}

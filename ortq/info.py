"""What ``ortq info`` shows: models, their workers and their queues, read from Redis.

Reads only JSON records and plain counters: nothing here unpickles (RQ's ``rq info``
would, for the workers' records).
"""

from __future__ import annotations

import contextlib
from typing import Any

import redis

from ortq import keys, tables
from ortq.control import worker_records
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
    live = []
    for name, record in worker_records(connection):
        if record is None:  # the worker died without cleaning up; its record expired
            # A read-only (monitor) user may not prune; the name is skipped all the same.
            with contextlib.suppress(redis.exceptions.NoPermissionError):
                connection.srem(keys.WORKERS_SET, name)
            continue
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


def _shape(spec: dict[str, Any]) -> str:
    return f"{spec['name']}: {spec['dtype']}[{', '.join('?' if d is None else str(d) for d in spec['shape'])}]"


def _adapter(worker: dict[str, Any]) -> str:
    adapter = worker.get("adapter") or {}
    name = adapter.get("name") or adapter.get("spec")
    if name is None:
        return "" if worker["device_id"] is None else f"#{worker['device_id']}"
    return f"#{adapter.get('index', worker['device_id'])} {name}"


def format_info(info: dict[str, Any]) -> str:
    """``ortq info``'s tables: one row per model (queue counts, signature), one per worker."""
    if not info["models"]:
        return "no ortq models or workers in this Redis"
    models = tables.format_table(
        ("MODEL", "QUEUED", "RUNNING", "FINISHED", "FAILED", "WORKERS", "INPUTS", "OUTPUTS"),
        [
            (
                m["model"],
                m["queued"],
                m["started"],
                m["finished"],
                m["failed"],
                len(m["workers"]),
                ", ".join(_shape(s) for s in (m["signature"] or {}).get("inputs", [])),
                ", ".join(_shape(s) for s in (m["signature"] or {}).get("outputs", [])),
            )
            for m in info["models"]
        ],
    )
    workers = [w for m in info["models"] for w in m["workers"]]
    if not workers:
        return models + "\n\nno live workers"
    rows = [
        (
            w["name"],
            w["model"],
            w["state"],
            w["provider"] + (" (CPU FALLBACK)" if w["fell_back_to_cpu"] else ""),
            _adapter(w),
            w["host"],
            w["pid"],
            w["successful_jobs"],
            w["failed_jobs"],
        )
        for w in workers
    ]
    header = ("WORKER", "MODEL", "STATE", "PROVIDER", "ADAPTER", "HOST", "PID", "OK", "FAILED")
    return models + "\n\n" + tables.format_table(header, rows)

"""Stopping workers from anywhere: ``ortq stop`` sends RQ's shutdown command (a PUBLISH on the
worker's ``rq:pubsub:<name>`` channel), which an ortq worker takes as a warm stop: it finishes its
job, unregisters and exits 0. It needs no signal and no console, so it reaches workers on other
hosts, in containers and in Windows scheduled tasks alike."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import redis
from rq.command import send_shutdown_command

from ortq import keys

#: The most worker names read from ``ortq:workers`` (anyone with write access could fill it).
MAX_WORKERS = 10_000


def worker_records(connection: redis.Redis, by_get: bool = False) -> list[tuple[str, dict[str, Any] | None]]:
    """Every name in the workers set with its published record, or None where that expired (a
    worker that died without unregistering) or cannot be read (a live worker rewrites its record
    at its next heartbeat). Records are hostile input: a set or record of the wrong type or
    content is skipped, never an error. ``by_get``: the records read by GETs in one pipeline, not
    one MGET (a worker's ACL rule grants GET alone: docs/security.md)."""
    if keys.as_text(connection.type(keys.WORKERS_SET)) != "set":
        return []
    raw_names = connection.srandmember(keys.WORKERS_SET, MAX_WORKERS) or []
    names = sorted({n.decode(errors="replace") for n in raw_names if isinstance(n, bytes) and len(n) <= 256})
    if not by_get:
        records = connection.mget([keys.worker_key(n) for n in names]) if names else []  # nil for wrong types
    else:
        with connection.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.get(keys.worker_key(name))
            records = pipe.execute(raise_on_error=False)  # an error (a wrong type) is no record
    return [(name, parse_record(raw)) for name, raw in zip(names, records, strict=True)]


def parse_record(raw: object) -> dict[str, Any] | None:
    """A worker record read from Redis (hostile input): its JSON object, or None."""
    if not isinstance(raw, bytes) or len(raw) > 1 << 20:
        return None
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def live_workers(connection: redis.Redis) -> list[dict[str, Any]]:
    """The published records of every live ortq worker."""
    return [record for _, record in worker_records(connection) if record is not None]


def select_workers(
    records: Sequence[dict[str, Any]], model: str | None, names: Sequence[str], host: str | None
) -> list[dict[str, Any]]:
    """The records that match every filter given (model, any of ``names``, host)."""
    return [
        r
        for r in records
        if (model is None or r.get("model") == model)
        and (not names or r.get("name") in names)
        and (host is None or r.get("host") == host)
    ]


def stop_workers(targets: Sequence[tuple[redis.Redis, Sequence[str]]], wait: float) -> list[str]:
    """Ask each named worker to stop, on the Redis it is registered on (``targets``: a connection
    and the names there; several under a shard map); wait up to ``wait`` seconds for their records
    to go. Returns the names still registered at the end (empty: all stopped, or not waited for)."""
    for connection, names in targets:
        for name in names:
            send_shutdown_command(connection, name)
    deadline = time.monotonic() + wait
    pending = [(connection, list(names)) for connection, names in targets]
    while wait > 0:
        pending = [(connection, _registered(connection, names)) for connection, names in pending]
        pending = [(connection, names) for connection, names in pending if names]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [name for _, names in pending for name in names] if wait > 0 else []


def _registered(connection: redis.Redis, names: Sequence[str]) -> list[str]:
    alive = connection.mget([keys.worker_key(n) for n in names])
    return [n for n, raw in zip(names, alive, strict=True) if raw is not None]

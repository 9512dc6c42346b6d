"""What ``ortq info`` shows: models, their workers and their queues, read from Redis.

Reads only JSON records and plain counters: nothing here unpickles (RQ's ``rq info``
would, for the workers' records).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any, cast

import redis

from ortq import keys, tables
from ortq.control import worker_records
from ortq.errors import ConfigurationError, WireFormatError
from ortq.pool import status
from ortq.redisurls import redacted_url
from ortq.rqcompat import layout
from ortq.rqjob import parse_rq_time
from ortq.settings import REDIS_DOWN, Settings
from ortq.shards import ShardMap
from ortq.signature import ModelSignature
from ortq.worker.upkeep import DEAD_AFTER_BEATS

log = logging.getLogger("ortq")

#: A worker whose last heartbeat is older than this many heartbeat intervals is gone (killed, or its
#: host lost): the rule by which the other workers take back its jobs, so that what ``ortq info``
#: and the dashboard say agrees with what the queue does.
GONE_AFTER_BEATS = DEAD_AFTER_BEATS
#: Heartbeat intervals a worker's record may claim (``heartbeat_seconds``); any other value is
#: taken as absent, and the reader's own setting applies.
_MOST_HEARTBEAT_SECONDS = 3600.0
#: ``state`` of a worker that stopped beating.
GONE = "gone"
#: Signature records read at most (models and their versions): a bound on what a set anyone with
#: write access could fill makes one read.
_MOST_SIGNATURES = 10_000
#: The largest signature record a reader reads (a model's inputs and outputs take a few kB); one
#: past it shows as unreadable.
MOST_SIGNATURE_BYTES = 64 * 1024
#: Signature records read in one round trip.
_SIGNATURES_A_ROUND = 256


def _models_with_signatures(connection: redis.Redis) -> tuple[dict[str, dict[str, Any] | None], dict[str, list[str]]]:
    """Every published signature by model (None for one that cannot be read: shown as such), and
    the versions that published one, by model (from the same SCAN: ``<model>@<version>`` keys)."""
    models: dict[str, dict[str, Any] | None] = {}
    versions: dict[str, list[str]] = {}
    found, listed = _signature_names(connection)
    for name in found:
        model, _, version = name.partition("@")
        if version and _is_model(model) and _is_version(version):
            versions.setdefault(model, []).append(version)
    names = [n for n in found if _is_model(n)]
    for name, raw in zip(names, _signature_records(connection, names), strict=True):
        if raw is None and listed:  # a set member whose record expired (or was never written)
            continue
        try:
            signature = None if raw is None or len(raw) > MOST_SIGNATURE_BYTES else ModelSignature.loads(raw)
            models[name] = None if signature is None else {"version": signature.version, **signature.to_json()}
        except WireFormatError:
            models[name] = None
    return models, {model: sorted(names) for model, names in versions.items()}


def _signature_records(connection: redis.Redis, names: list[str]) -> Iterator[bytes | None]:
    """Each model's signature record (None: none, or no string), at most MOST_SIGNATURE_BYTES + 1
    bytes of it (more: shown as unreadable), read _SIGNATURES_A_ROUND at a time: a reader holds a
    bounded part of what anyone with write access made those records (one MGET of 200 records of 1
    MiB held 259 MiB)."""
    for at in range(0, len(names), _SIGNATURES_A_ROUND):
        with connection.pipeline(transaction=False) as pipe:
            for name in names[at : at + _SIGNATURES_A_ROUND]:
                pipe.getrange(keys.signature_key(name), 0, MOST_SIGNATURE_BYTES)
            for raw in pipe.execute(raise_on_error=False):
                yield raw if isinstance(raw, bytes) and raw else None  # b"": no key; an error: no string


def _signature_names(connection: redis.Redis) -> tuple[list[str], bool]:
    """The names after ``signature_key``'s prefix of the published signature records, and whether
    they were listed rather than found: the workers' set of them (keys.SIGNATURES_SET, which may
    name records that expired), else (workers from before it, or a key of another type there) a
    SCAN of the keyspace."""
    if keys.as_text(connection.type(keys.SIGNATURES_SET)) == "set":
        members = cast(list[bytes], connection.srandmember(keys.SIGNATURES_SET, _MOST_SIGNATURES) or [])
        return [keys.as_text(m) for m in members if len(m) <= 200], True  # a model and a version name, at most
    prefix = keys.signature_key("")
    return [keys.as_text(k)[len(prefix) :] for k in connection.scan_iter(match=prefix + "*", count=500)], False


def _is_version(name: str) -> bool:
    return _passes(keys.check_version_name, name)


def _is_model(name: str) -> bool:
    return _passes(keys.check_model_name, name)


def _passes(check: Callable[[str], str], name: str) -> bool:
    try:
        check(name)
    except ConfigurationError:
        return False
    return True


def _workers(connection: redis.Redis, heartbeat_seconds: float) -> list[dict[str, Any]]:
    records = worker_records(connection)
    for name, record in records:
        if record is None:  # the worker died without cleaning up; its record expired
            # A read-only (monitor) user may not prune; the name is skipped all the same.
            with contextlib.suppress(redis.exceptions.NoPermissionError):
                connection.srem(keys.WORKERS_SET, name)
    live = [_shown(name, r) for name, r in records if r is not None and isinstance(r.get("model"), str)]
    # RQ's own worker hash holds the live state, counters and last heartbeat (and RQ 3 its running
    # executions).
    with connection.pipeline(transaction=False) as pipe:
        for record in live:
            pipe.hmget(
                layout.worker_key(str(record.get("name"))),
                ["state", "successful_job_count", "failed_job_count", "last_heartbeat"],
            )
            pipe.srandmember(layout.worker_executions_key(str(record.get("name"))), 1)
            pipe.hget(layout.worker_key(str(record.get("name"))), "current_job")
        replies = pipe.execute(raise_on_error=False)
    now = layout.utcnow()
    for i, record in enumerate(live):
        stats, executions, current = replies[3 * i : 3 * i + 3]
        state, ok, failed, beat = stats if isinstance(stats, list) else (None, None, None, None)
        record["state"] = record["rq_state"] = _text(state)
        record["successful_jobs"] = _count(ok)
        record["failed_jobs"] = _count(failed)
        record["heartbeat_age"] = _age(beat, now)
        execution = _text(executions[0]) if isinstance(executions, list) and executions else None
        # RQ 3's index of the worker's executions, RQ 2's field, else (a worker without RQ's
        # execution records) the job it held at its last heartbeat, while RQ's state says busy.
        held = record.get("held_job")
        held = held if isinstance(held, str) and layout.is_job_id(held) and record["state"] == "busy" else None
        record["current_job"] = execution.rpartition(":")[0] if execution else _text(current) or held
        # A killed worker leaves its records (RQ's state "idle" or "busy" among them) until they
        # expire, minutes later: past the rule its jobs are taken back by, it is shown as gone.
        interval = _interval(record.get("heartbeat_seconds"), heartbeat_seconds)
        if record["heartbeat_age"] is not None and record["heartbeat_age"] > GONE_AFTER_BEATS * interval:
            record["state"] = GONE
    return live


def _age(raw: object, now: datetime) -> float | None:
    """Seconds since the heartbeat RQ's time ``raw`` records (0 for one in the future: another
    host's clock), to 0.1 s; None when absent or unreadable."""
    moment = parse_rq_time(raw) if isinstance(raw, bytes) and len(raw) <= 64 else None
    return None if moment is None else round(max(0.0, (now - moment).total_seconds()), 1)


def _interval(published: object, default: float) -> float:
    """The worker's heartbeat interval: the one its record publishes, else the reader's setting."""
    if isinstance(published, bool) or not isinstance(published, int | float):
        return default
    return float(published) if math.isfinite(published) and 0 < published <= _MOST_HEARTBEAT_SECONDS else default


def state_text(worker: dict[str, Any]) -> str:
    """A worker's state as ``ortq info`` and the dashboard show it: RQ's (``idle``, ``busy``, ...),
    or ``gone (no heartbeat for N s)``."""
    if worker.get("state") == GONE:
        return f"gone (no heartbeat for {worker.get('heartbeat_age') or 0:.0f} s)"
    return str(worker.get("state") or "?")


def heartbeat_text(worker: dict[str, Any]) -> str:
    """How long ago the worker's last heartbeat was: ``0.4 s ago``; ``?`` when RQ's record lacks it."""
    age = worker.get("heartbeat_age")
    return "?" if age is None else f"{age:.1f} s ago" if age < 60 else f"{age:.0f} s ago"


#: The fields of a worker's record that ``ortq info`` and the page show, with the type each must
#: have; any other value (a record written by someone else) shows as unknown.
_SHOWN_FIELDS: dict[str, type | tuple[type, ...]] = {
    "provider": str,
    "version": str,
    "requested_provider": str,
    "fell_back_to_cpu": bool,
    "adapter": dict,
    "device_id": int,
    "host": str,
    "pid": int,
}


def _shown(name: str, record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its shown fields of the right types (None where not) and the name it is
    registered under."""
    record["name"] = name
    for field, kind in _SHOWN_FIELDS.items():
        if not isinstance(record.get(field), kind):
            record[field] = None
    return record


def _text(raw: object) -> str | None:
    return raw.decode(errors="replace")[:200] if isinstance(raw, bytes) else None


def _count(raw: object) -> int:
    try:
        return max(0, int(float(raw))) if isinstance(raw, bytes) else 0
    except (ValueError, OverflowError):
        return 0


def collect(connection: redis.Redis, heartbeat_seconds: float = Settings.heartbeat_seconds) -> dict[str, Any]:
    """Everything ``ortq info`` prints, as one JSON-able dict. Redis is read as hostile input: a
    record of the wrong type or content shows as missing or zero, never as an error.

    Each worker has RQ's ``state`` (``rq_state``) and ``heartbeat_age``, the seconds since its last
    heartbeat; one past :data:`GONE_AFTER_BEATS` heartbeat intervals (the interval its record
    publishes, else ``heartbeat_seconds``) has the state ``gone``."""
    signatures, versions = _models_with_signatures(connection)
    workers = _workers(connection, heartbeat_seconds)
    names = set(signatures) | {w["model"] for w in workers}
    waiting, skipped = _unserved_queues(connection, names)
    names |= waiting
    parked, skipped_parked = parked_jobs(connection, sorted(names), versions)
    models = []
    for name in sorted(names):
        queue = layout.QueueKeys.of(keys.queue_name(name))
        with connection.pipeline(transaction=False) as pipe:
            pipe.llen(queue.queue)
            pipe.zcard(queue.started)
            pipe.zcard(queue.failed)
            pipe.zcard(queue.finished)
            counts = [c if isinstance(c, int) else 0 for c in pipe.execute(raise_on_error=False)]
        queued, started, failed, finished = counts[:4]
        models.append(
            {
                "model": name,
                "queue": queue.name,
                "queued": queued,
                # Jobs pinned to a version that a worker of another version parked for it (in no
                # queue list: docs/autoscaling.md), by version; only versions with some.
                "parked": parked.get(name, {}),
                "started": started,
                "failed": failed,
                "finished": finished,
                "signature": signatures.get(name),
                "workers": [w for w in workers if w["model"] == name],
            }
        )
    pools, skipped_pools = status.read_pools(connection)
    shown = {"models": models, "skipped_queues": skipped, "skipped_parked_versions": skipped_parked}
    return {**shown, "pools": pools, "skipped_pools": skipped_pools}


#: Versions with a parked list looked at per model at most: the workers' set of them may name as
#: many versions as producers pinned jobs to (any name passes), so what one read takes is bounded.
MOST_PARKED_VERSIONS = 100


def parked_jobs(
    connection: redis.Redis, models: list[str], published: Mapping[str, list[str]]
) -> tuple[dict[str, dict[str, int]], int]:
    """The jobs parked for each version of each of ``models`` (only versions with some), and how many
    versions were not looked at. A version is looked at when it has a signature (``published``) or
    is in the workers' set of versions with a parked list (a version nobody serves has none: its
    jobs are the ones that wait for nothing), at most MOST_PARKED_VERSIONS of that set a model; two
    round trips in all. A key of another type shows as none (collect's rule)."""
    with connection.pipeline(transaction=False) as pipe:
        for model in models:
            pipe.scard(keys.parked_versions_key(model))
            pipe.srandmember(keys.parked_versions_key(model), MOST_PARKED_VERSIONS)
        replies = pipe.execute(raise_on_error=False) if models else []
    looked: list[tuple[str, str]] = []
    skipped = 0
    for i, model in enumerate(models):
        total, members = replies[2 * i : 2 * i + 2]
        listed = [keys.as_text(m) for m in members if len(m) <= 64] if isinstance(members, list) else []
        skipped += max(0, total - len(listed)) if isinstance(total, int) else 0
        named = dict.fromkeys([*published.get(model, []), *(v for v in listed if _is_version(v))])
        looked += [(model, version) for version in named]
    with connection.pipeline(transaction=False) as pipe:
        for model, version in looked:
            pipe.llen(keys.parked_key(model, version))
        counts = pipe.execute(raise_on_error=False) if looked else []
    parked: dict[str, dict[str, int]] = {}
    for (model, version), count in zip(looked, counts, strict=True):
        if isinstance(count, int) and count > 0:
            parked.setdefault(model, {})[version] = count
    return parked, skipped


#: Members of RQ's queue set read at most, and of those naming a model no worker or signature
#: names, queues looked at (LLEN) at most: producers may add any name to that set (10,000 junk
#: names made one scrape 8.8 s and 40,006 series), so what it adds to the models is bounded.
_MOST_QUEUE_MEMBERS, _MOST_UNSERVED_QUEUES = 1000, 200


def _unserved_queues(connection: redis.Redis, named: set[str]) -> tuple[set[str], int]:
    """The models of RQ's queue set (rq:queues) that no worker or signature names but that have
    jobs queued, running or failed (a model enqueued for before any worker served it, or whose
    workers are gone), or a key of another type in one of those places, and how many members were
    not looked at (the bounds above: ``ortq info`` says so). An empty queue of such a name is no
    model: anyone may add a name to that set."""
    if connection.type(keys.RQ_QUEUES_SET) not in (b"set", "set"):
        return set(), 0
    queue_prefix = layout.QueueKeys.of("").queue
    with connection.pipeline(transaction=False) as pipe:
        pipe.scard(keys.RQ_QUEUES_SET)
        pipe.srandmember(keys.RQ_QUEUES_SET, _MOST_QUEUE_MEMBERS)
        total, members = pipe.execute(raise_on_error=False)
    if not isinstance(total, int) or not isinstance(members, list):
        return set(), 0
    candidates = []
    for raw in members:
        model = keys.model_from_queue_name(keys.as_text(cast(bytes, raw)).removeprefix(queue_prefix))
        if model and model not in named and _is_model(model):
            candidates.append(model)
    looked = candidates[:_MOST_UNSERVED_QUEUES]
    with connection.pipeline(transaction=False) as pipe:
        for model in looked:
            queue = layout.QueueKeys.of(keys.queue_name(model))
            pipe.llen(queue.queue)
            pipe.zcard(queue.started)
            pipe.zcard(queue.failed)
        counts = pipe.execute(raise_on_error=False) if looked else []
    # A key there of another type is shown too (as empty, by collect's rule): it is no one's
    # record, and a reader should see it is there.
    waiting = {m for i, m in enumerate(looked) if any(map(_has_jobs_or_is_wrong, counts[3 * i : 3 * i + 3]))}
    return waiting, max(0, total - len(members)) + len(candidates) - len(looked)


def _has_jobs_or_is_wrong(count: object) -> bool:
    return (isinstance(count, int) and count > 0) or str(count).startswith("WRONGTYPE")


def collect_shards(
    connections: Mapping[str, redis.Redis], shards: ShardMap, heartbeat_seconds: float = Settings.heartbeat_seconds
) -> dict[str, Any]:
    """:func:`collect` of every Redis of the shard map (URL -> client, the default first), each
    model marked with its Redis (password left out); ``warnings`` names every model with workers or
    queued jobs on a Redis the map does not send it to (a worker started with the wrong URL)."""
    models: list[dict[str, Any]] = []
    warnings = []
    pools: list[dict[str, Any]] = []
    skipped = skipped_parked = skipped_pools = 0
    for url, connection in connections.items():
        info = collect(connection, heartbeat_seconds)
        pools += info["pools"]
        skipped += info["skipped_queues"]
        skipped_parked += info["skipped_parked_versions"]
        skipped_pools += info["skipped_pools"]
        for model in info["models"]:
            model["redis"] = redacted_url(url)
            models.append(model)
            if (warning := misplaced(model, url, shards)) is not None:
                warnings.append(warning)
    shown = {"models": models, "warnings": warnings, "skipped_queues": skipped, "pools": pools}
    return {**shown, "skipped_parked_versions": skipped_parked, "skipped_pools": skipped_pools}


def misplaced(model: dict[str, Any], url: str, shards: ShardMap) -> str | None:
    """The warning for ``model`` (one of :func:`collect`'s, read on ``url``) when it has workers or
    queued jobs on a Redis the shard map does not send it to (a worker started with the wrong URL)."""
    home = shards.url_for(model["model"])
    if home == url or not (model["workers"] or model["queued"]):
        return None
    return (
        f"model {model['model']!r} has {len(model['workers'])} worker(s) and {model['queued']} queued "
        f"job(s) on {redacted_url(url)}, but the shard map sends its jobs to {redacted_url(home)}"
    )


def shard_clients(settings: Settings, meanwhile: str) -> tuple[ShardMap, dict[str, redis.Redis]]:
    """The shard map (one with no entries without one) and a client per Redis in it, the default
    first. A login, TLS or ACL mistake is ConfigurationError now; a Redis that is down now is
    logged, with ``meanwhile`` (what the reader shows until it is back), and read later."""
    shards = settings.shards or ShardMap(settings.redis_url)
    clients: dict[str, redis.Redis] = {}
    for url in shards.urls():
        try:
            clients[url] = settings.for_redis(url).connect()
        except REDIS_DOWN as exc:
            log.warning("Redis at %s is unreachable now (%s); %s", redacted_url(url), exc, meanwhile)
            clients[url] = settings.for_redis(url).connect(check=False)
    return shards, clients


def _shape(spec: dict[str, Any]) -> str:
    if spec.get("any_shape") is True:  # docs/wire-format.md, section 5: no declared shape, any rank
        return f"{spec['name']}: {spec['dtype']} (any shape)"
    return f"{spec['name']}: {spec['dtype']}[{', '.join('?' if d is None else str(d) for d in spec['shape'])}]"


def _adapter(worker: dict[str, Any]) -> str:
    """The ADAPTER column: ``cpu`` for a session on the CPU (a fallback's included: the GPU it asked
    for is not what runs it), else the adapter's index and name, or ``auto`` where ONNX Runtime chose."""
    if worker.get("provider") == "CPUExecutionProvider":
        return "cpu"
    adapter = worker.get("adapter") or {}
    name = adapter.get("name") or adapter.get("spec")
    if name is None:
        if worker.get("device_id") is not None:
            return f"#{worker['device_id']}"
        return "auto" if worker.get("requested_provider") == "auto" else ""
    return f"#{adapter.get('index', worker.get('device_id'))} {name}"


def _parked(model: dict[str, Any]) -> str:
    """The PARKED column: how many jobs wait parked for each version (``3 for v1``), or 0; a version
    no live worker of the model serves says so (``2 for v9 (not served)``): its jobs wait for
    nothing until their requests expire."""
    served = served_versions(model)
    return (
        ", ".join(
            f"{count} for {version[:64]}" + ("" if version in served else " (not served)")
            for version, count in model["parked"].items()
        )
        or "0"
    )


def served_versions(model: dict[str, Any]) -> set[str]:
    """The versions that live workers of ``model`` (one of :func:`collect`'s) serve."""
    return {w["version"] for w in model["workers"] if w.get("state") != GONE and isinstance(w.get("version"), str)}


def _parked_note(info: dict[str, Any]) -> str:
    """The note below the tables when some versions with parked jobs were not looked at."""
    skipped = info.get("skipped_parked_versions", 0)
    if not skipped:
        return ""
    return (
        f"\nnote: {skipped} version(s) with a parked list were not looked at (at most {MOST_PARKED_VERSIONS} a "
        "model are): their parked jobs are not counted"
    )


def _worker_count(workers: list[dict[str, Any]]) -> str:
    """The WORKERS column: the live workers (``2``), and apart the gone ones whose records have not
    expired yet (``2 (+1 gone)``): a gone worker serves nothing, and the exporter counts only live ones."""
    gone = sum(w.get("state") == GONE for w in workers)
    live = len(workers) - gone
    return f"{live} (+{gone} gone)" if gone else str(live)


def _current_version(signature: dict[str, Any] | None) -> str:
    """The version of a model's current signature (that of its worker that started last)."""
    version = (signature or {}).get("version")
    return version[:64] if isinstance(version, str) else "-"


def format_info(info: dict[str, Any]) -> str:
    """``ortq info``'s tables: one row per model (queue counts, signature), one per worker; with a
    shard map (:func:`collect_shards`) a REDIS column, and its warnings below."""
    sharded = "warnings" in info
    warnings = "".join(f"\nWARNING: {w}" for w in info.get("warnings", []))
    if skipped := info.get("skipped_queues", 0):
        warnings += (
            f"\nnote: {skipped} member(s) of RQ's queue set ({keys.RQ_QUEUES_SET}) that no worker or signature"
            f" names were not looked at (at most {_MOST_UNSERVED_QUEUES} are): a queue of theirs is not shown"
        )
    warnings += _parked_note(info)
    if skipped_pools := info.get("skipped_pools", 0):
        warnings += (
            f"\nnote: {skipped_pools} name(s) in {status.POOLS_SET} were not looked at (at most {status.MOST_POOLS} "
            "are): a pool of theirs is not shown"
        )
    if info.get("pools"):  # pools that follow their queues (ortq.pool.status)
        warnings = "\n\n" + status.format_pools(info["pools"]) + warnings
    if not info["models"]:
        return f"no ortq models or workers in {'these Redis instances' if sharded else 'this Redis'}{warnings}"
    redis_column: tuple[str, ...] = ("REDIS",) if sharded else ()
    models = tables.format_table(
        (
            "MODEL",
            *redis_column,
            "VERSION",
            "QUEUED",
            "PARKED",
            "RUNNING",
            "FINISHED",
            "FAILED",
            "WORKERS",
            "INPUTS",
            "OUTPUTS",
        ),
        [
            (
                m["model"],
                *((m["redis"],) if sharded else ()),
                _current_version(m["signature"]),
                m["queued"],
                _parked(m),
                m["started"],
                m["finished"],
                m["failed"],
                _worker_count(m["workers"]),
                ", ".join(_shape(s) for s in (m["signature"] or {}).get("inputs", [])),
                ", ".join(_shape(s) for s in (m["signature"] or {}).get("outputs", [])),
            )
            for m in info["models"]
        ],
    )
    workers = [(w, m.get("redis")) for m in info["models"] for w in m["workers"]]
    if not workers:
        return models + "\n\nno live workers" + warnings
    rows = [
        (
            w["name"],
            w["model"],
            *((redis_url,) if sharded else ()),
            w["version"] or "?",
            state_text(w),
            (w["provider"] or "?") + (" (CPU FALLBACK)" if w["fell_back_to_cpu"] else ""),
            _adapter(w),
            w["host"] or "?",
            "?" if w["pid"] is None else w["pid"],
            w["successful_jobs"],
            w["failed_jobs"],
            heartbeat_text(w),
        )
        for w, redis_url in workers
    ]
    header = ("WORKER", "MODEL", *redis_column, "VERSION", "STATE", "PROVIDER", "ADAPTER", "HOST", "PID", "OK",
              "FAILED", "HEARTBEAT")  # fmt: skip
    return models + "\n\n" + tables.format_table(header, rows) + warnings

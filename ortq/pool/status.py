"""A following pool's record in Redis: each adapter's budget and what its workers hold, which
models are resident, workers loading, serving or stopping and why, evictions and model loads.

The pool writes it every second it follows its queues (``ortq:pool:<host>.<pid>``, JSON, living
:data:`RECORD_TTL` seconds, named in the set ``ortq:pools``) and deletes it when it stops; ``ortq
info``, the exporter and the dashboard read it. Readers take it as hostile input, like every other
record: at most :data:`MOST_POOLS` names, :data:`MOST_RECORD_BYTES` of each, anything malformed
skipped.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from ortq import keys, tables

log = logging.getLogger("ortq.pool")

POOLS_SET = keys.PREFIX + "pools"
#: A record outlives its last write this long: a killed pool's is gone soon after.
RECORD_TTL = 15
#: Readers look at this many pools' records at most, and this much of each.
MOST_POOLS = 100
MOST_RECORD_BYTES = 64 * 1024
#: Names of ortq:pools a write looks at, to forget those whose record is gone.
PRUNED_A_WRITE = 4
#: The pool's latest starts and stops, kept in its record.
RECENT_ACTIONS = 20


def pool_key(name: str) -> str:
    return keys.PREFIX + "pool:" + name


@dataclass(frozen=True)
class WorkerNow:
    """One elastic worker as the record shows it."""

    label: str
    model: str
    adapter: str
    #: "loading" (started, not yet registered with RQ), "serving" or "stopping".
    state: str
    worker_bytes: int
    #: Why it was started or is stopping (the follower's words).
    why: str = ""


@dataclass
class PoolStatus:
    """What the pool counts for its record, across ticks."""

    name: str
    evictions: int = 0
    cold_starts: int = 0
    #: model -> (loads, their seconds in all, the last one's seconds): started to registered with RQ.
    loads: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECENT_ACTIONS))

    def acted(self, start: bool, label: str, model: str, why: str, cold: bool, evicts: bool) -> None:
        """A start (``cold``: its model had no worker) or a stop (``evicts``: to make room for
        another model) the follower decided."""
        if start and cold:
            self.cold_starts += 1
        if evicts:
            self.evictions += 1
        self.recent.append({"at": time.time(), "action": "start" if start else "stop", "worker": label,
                            "model": model, "why": why})  # fmt: skip

    def loaded(self, model: str, seconds: float) -> None:
        count, total, _ = self.loads.get(model, (0, 0.0, 0.0))
        self.loads[model] = (count + 1, total + seconds, seconds)

    def record(self, budgets: Mapping[str, int | None], workers: Iterable[WorkerNow]) -> dict[str, Any]:
        """The JSON record: per adapter its budget, the memory its workers hold and its workers."""
        adapters: dict[str, dict[str, Any]] = {
            name: {"adapter": name, "budget_bytes": budget, "used_bytes": 0, "resident": [], "workers": []}
            for name, budget in budgets.items()
        }
        for worker in workers:
            entry = adapters[worker.adapter]
            entry["used_bytes"] += worker.worker_bytes
            entry["workers"].append({"worker": worker.label, "model": worker.model, "state": worker.state,
                                     "why": worker.why})  # fmt: skip
            if worker.state == "serving" and worker.model not in entry["resident"]:
                entry["resident"].append(worker.model)
        return {
            "pool": self.name,
            "at": time.time(),
            "adapters": list(adapters.values()),
            "evictions": self.evictions,
            "cold_starts": self.cold_starts,
            "loads": {m: {"count": c, "seconds": t, "last_seconds": last} for m, (c, t, last) in self.loads.items()},
            "recent": list(self.recent),
        }


class Publisher:
    """Writes the record to the pool's Redis (errors logged once until a write succeeds again)."""

    def __init__(self, connection: redis.Redis, name: str) -> None:
        self._connection, self._failing = connection, False
        #: The pool's name in its record: <host>.<pid>.
        self.name = name

    def publish(self, record: dict[str, Any]) -> None:
        """Write the record, and forget a few names in ``ortq:pools`` whose record is gone (pools
        killed before they could withdraw theirs): the set holds about as many names as live pools,
        not one more for every pool ever killed, so readers' MOST_POOLS reach the live ones."""
        try:
            with self._connection.pipeline(transaction=False) as pipe:
                pipe.set(pool_key(self.name), json.dumps(record), ex=RECORD_TTL)
                pipe.sadd(POOLS_SET, self.name)
                pipe.srandmember(POOLS_SET, PRUNED_A_WRITE)
                others = [m for m in pipe.execute()[2] if keys.as_text(m) != self.name]
            if others:
                with self._connection.pipeline(transaction=False) as pipe:
                    for other in others:
                        pipe.exists(pool_key(keys.as_text(other)))
                    gone = [m for m, there in zip(others, pipe.execute(), strict=True) if not there]
                if gone:
                    self._connection.srem(POOLS_SET, *gone)
            self._failing = False
        except redis.RedisError as exc:
            if not self._failing:
                log.warning("cannot write the pool's record to Redis (%s): ortq info will not show it", exc)
            self._failing = True

    def withdraw(self) -> None:
        try:
            with self._connection.pipeline(transaction=False) as pipe:
                pipe.delete(pool_key(self.name))
                pipe.srem(POOLS_SET, self.name)
                pipe.execute()
        except redis.RedisError:
            pass  # it expires within RECORD_TTL anyway


def read_pools(connection: redis.Redis) -> tuple[list[dict[str, Any]], int]:
    """The records of the pools that follow their queues on this Redis (at most MOST_POOLS), each
    checked for its shape (a record that is gone, too large or malformed is left out), and how many
    names of ``ortq:pools`` were not looked at (past MOST_POOLS: readers say so)."""
    with connection.pipeline(transaction=False) as pipe:
        pipe.srandmember(POOLS_SET, MOST_POOLS)
        pipe.scard(POOLS_SET)
        members, count = pipe.execute(raise_on_error=False)
    if isinstance(members, redis.exceptions.NoPermissionError):  # a reader's rule from before pools had records
        return [], 0
    if isinstance(members, Exception):  # WRONGTYPE: not the pools' set (anyone with ~ortq:* may write it)
        return [], 0
    names = sorted(keys.as_text(m) for m in members) if isinstance(members, list) else []
    skipped = max(0, count - len(names)) if isinstance(count, int) else 0
    if not names:
        return [], skipped
    with connection.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.getrange(pool_key(name), 0, MOST_RECORD_BYTES)
        raws = pipe.execute(raise_on_error=False)
    pools = []
    for raw in raws:
        if not isinstance(raw, bytes) or not raw or len(raw) > MOST_RECORD_BYTES:
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if _well_formed(record):
            pools.append(record)
    return pools, skipped


def _well_formed(record: Any) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("pool"), str):
        return False
    adapters = record.get("adapters")
    counts = (record.get("evictions"), record.get("cold_starts"))
    if not isinstance(adapters, list) or not all(isinstance(c, int) for c in counts):
        return False
    for adapter in adapters:
        if not isinstance(adapter, dict) or not isinstance(adapter.get("adapter"), str):
            return False
        if not isinstance(adapter.get("used_bytes"), int) or not isinstance(adapter.get("workers"), list):
            return False
        if not all(isinstance(w, dict) and isinstance(w.get("model"), str) for w in adapter["workers"]):
            return False
    return True


POOL_BUDGET = "ortq_pool_budget_bytes"
POOL_USED = "ortq_pool_used_bytes"
POOL_WORKERS = "ortq_pool_workers"
POOL_EVICTIONS = "ortq_pool_evictions_total"
POOL_COLD_STARTS = "ortq_pool_cold_starts_total"
MODEL_LOAD = "ortq_model_load_seconds"
#: The series :func:`pool_metrics` gives, as PromQL names them (the load time is a summary).
POOL_METRIC_NAMES = (POOL_BUDGET, POOL_USED, POOL_WORKERS, POOL_EVICTIONS, POOL_COLD_STARTS,
                     MODEL_LOAD + "_count", MODEL_LOAD + "_sum")  # fmt: skip


def pool_metrics(pools: list[dict[str, Any]]) -> list[Metric]:
    """The exporter's series of the pools' records: per pool and adapter the budget and the memory
    held, workers by model and state, evictions and cold starts, and each model's load time."""
    labels = ["pool", "adapter"]
    budget = GaugeMetricFamily(POOL_BUDGET, "A following pool's memory budget on the adapter.", labels=labels)
    used = GaugeMetricFamily(POOL_USED, "What the pool's elastic workers on the adapter hold (the plan's "
                             "figure a worker), stopping ones included.", labels=labels)  # fmt: skip
    workers = GaugeMetricFamily(POOL_WORKERS, "The pool's elastic workers by model and state (loading, serving, "
                                "stopping).", labels=[*labels, "model", "state"])  # fmt: skip
    evictions = CounterMetricFamily(POOL_EVICTIONS.removesuffix("_total"), "Workers the pool stopped to make room "
                                    "for another model.", labels=["pool"])  # fmt: skip
    cold = CounterMetricFamily(POOL_COLD_STARTS.removesuffix("_total"), "Workers the pool started for a model "
                               "that had none running.", labels=["pool"])  # fmt: skip
    load = SummaryMetricFamily(MODEL_LOAD, "Seconds from a worker's start to its registration with RQ (its model "
                               "loaded), in the pool.", labels=["pool", "model"])  # fmt: skip
    for pool in pools:
        name = pool["pool"]
        evictions.add_metric([name], float(pool["evictions"]))
        cold.add_metric([name], float(pool["cold_starts"]))
        for adapter in pool["adapters"]:
            where = [name, adapter["adapter"]]
            if isinstance(adapter.get("budget_bytes"), int):
                budget.add_metric(where, float(adapter["budget_bytes"]))
            used.add_metric(where, float(adapter["used_bytes"]))
            counts: dict[tuple[str, str], int] = {}
            for worker in adapter["workers"]:
                key = (worker["model"], str(worker.get("state")))
                counts[key] = counts.get(key, 0) + 1
            for (model, state), count in counts.items():
                workers.add_metric([*where, model, state], float(count))
        loads = pool.get("loads")
        for model, seen in loads.items() if isinstance(loads, dict) else ():
            if not isinstance(seen, dict):
                continue
            runs, seconds = seen.get("count"), seen.get("seconds")
            if isinstance(runs, int) and isinstance(seconds, int | float):
                load.add_metric([name, str(model)], runs, float(seconds))
    return [budget, used, workers, evictions, cold, load]


def format_pools(pools: list[dict[str, Any]]) -> str:
    """``ortq info``'s pool table: per pool and adapter, budget, used, resident models, workers
    loading and stopping, evictions and cold starts."""
    rows = []
    for pool in pools:
        for adapter in pool["adapters"]:
            budget = adapter.get("budget_bytes")
            states = [w for w in adapter["workers"] if w.get("state") in ("loading", "stopping")]
            rows.append(
                (
                    pool["pool"],
                    adapter["adapter"],
                    "none" if not isinstance(budget, int) else _mib(budget),
                    _mib(adapter["used_bytes"]),
                    ", ".join(str(m) for m in adapter.get("resident", [])) or "-",
                    ", ".join(f"{w['model']} {w['state']}" for w in states) or "-",
                    pool["evictions"],
                    pool["cold_starts"],
                )
            )
    header = ("POOL", "ADAPTER", "BUDGET", "USED", "RESIDENT", "CHANGING", "EVICTIONS", "COLD STARTS")
    return tables.format_table(header, rows)


def _mib(n: int) -> str:
    return f"{n / 1024**2:.0f} MiB"

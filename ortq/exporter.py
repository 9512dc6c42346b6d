"""``ortq exporter``: Prometheus metrics of every model's queue, read from Redis at scrape time, with
or without workers.

A worker's own ``ortq_queue_depth`` goes away with the last worker, which is exactly when an
autoscaler that scales to zero must still see the queue (docs/autoscaling.md); and a job left
``started`` by a killed worker, the age of the oldest waiting job and the newest heartbeat are facts
about a queue, not about one worker. So this process reads them from Redis itself, at every scrape,
and holds no state between scrapes.

What a scrape costs, per Redis of the shard map: :func:`ortq.info.collect` (what ``ortq info``
reads: the workers' set of their signature records, the workers' records, four counters per model
and one per version with a signature or a parked list, its parked jobs), then two
pipelined round trips for the oldest waiting job of every model (``LINDEX 0`` of the queue, ``HGET``
of that one job's ``enqueued_at``). Nothing is unpickled. Redis is hostile input as everywhere in
ortq: a key of the wrong type or content shows as missing (collect's rule) and is logged, never an
error of the scrape; a Redis that cannot be read gives ``ortq_exporter_redis_up 0`` and no model
series for it, and the server goes on.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import click
import redis
from prometheus_client import CollectorRegistry, start_wsgi_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ortq import keys
from ortq.cliopts import redis_url_option, shards_option
from ortq.errors import ConfigurationError
from ortq.info import GONE, MOST_PARKED_VERSIONS, collect_shards, shard_clients
from ortq.pool import status
from ortq.redisurls import redacted_url
from ortq.rqcompat import layout
from ortq.rqjob import parse_rq_time
from ortq.settings import Settings
from ortq.shards import ShardMap

log = logging.getLogger("ortq.exporter")

#: Not 9109 (graphite_exporter's ingestion port in Prometheus's list of default ports) and not the
#: workers' 9850 and up (``ortq pool`` counts up from its ``metrics_port_base``).
DEFAULT_PORT = 9849

QUEUE_LENGTH = "ortq_queue_length"
OLDEST_AGE = "ortq_queue_oldest_job_age_seconds"
RUNNING = "ortq_queue_running_jobs"
PARKED = "ortq_queue_parked_jobs"
FAILED = "ortq_queue_failed_jobs"
WORKERS_ALIVE = "ortq_queue_workers_alive"
NEWEST_HEARTBEAT_AGE = "ortq_queue_newest_heartbeat_age_seconds"
REDIS_UP = "ortq_exporter_redis_up"

#: Every series the exporter exposes, as PromQL names them (all gauges); docs/autoscaling.md has
#: the table and deploy/grafana/ortq-dashboard.json queries them.
METRIC_NAMES: tuple[str, ...] = (
    QUEUE_LENGTH, OLDEST_AGE, RUNNING, PARKED, FAILED, WORKERS_ALIVE, NEWEST_HEARTBEAT_AGE, REDIS_UP,
    *status.POOL_METRIC_NAMES,
)  # fmt: skip

#: Labels of the per-model series: the model, and its Redis (URL without password and query).
LABELS = ("model", "redis")

_HELP = {
    QUEUE_LENGTH: "Jobs waiting in the model's queue (LLEN of RQ's queue list).",
    OLDEST_AGE: "Seconds since the job at the head of the queue (the next to run) was enqueued; absent when empty.",
    RUNNING: "Jobs started and not ended (RQ's started registry), those of killed workers included until taken back.",
    FAILED: "Jobs in RQ's failed registry (kept failure_ttl).",
    WORKERS_ALIVE: "Workers of the model whose heartbeat is recent (not gone, by ortq info's rule).",
    NEWEST_HEARTBEAT_AGE: "Seconds since the newest heartbeat of any worker of the model; absent without records.",
}

#: The most distinct problems remembered so that each is logged once, not at every scrape.
_MOST_REMEMBERED = 1000


class QueueCollector(Collector):
    """The exporter's series, read from each Redis (``clients``: URL -> client, the default first)
    when Prometheus scrapes; ``shards`` says which models belong where (collect_shards' warnings)."""

    def __init__(self, clients: Mapping[str, redis.Redis], shards: ShardMap, heartbeat_seconds: float) -> None:
        self._clients = dict(clients)
        self._shards = shards
        self._heartbeat_seconds = heartbeat_seconds
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._down: set[str] = set()

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily(REDIS_UP, "1 when the last scrape read this Redis, else 0.", labels=["redis"])
        families = {name: GaugeMetricFamily(name, doc, labels=LABELS) for name, doc in _HELP.items()}
        parked = GaugeMetricFamily(
            PARKED,
            "Jobs pinned to the version that a worker of another version parked for it (in no queue list), "
            "whether or not any worker serves that version; absent where none are.",
            labels=[*LABELS, "version"],
        )
        pools: list[dict[str, Any]] = []
        for url, client in self._clients.items():
            where = redacted_url(url)
            try:
                models, ages, found = self._read(url, client)
            except redis.RedisError as exc:
                self._note_down(where, exc)
                up.add_metric([where], 0.0)
                continue
            self._note_up(where)
            up.add_metric([where], 1.0)
            pools += found
            for model in models:
                labels = [model["model"], where]
                workers = model["workers"]
                beats = [w["heartbeat_age"] for w in workers if isinstance(w.get("heartbeat_age"), int | float)]
                families[QUEUE_LENGTH].add_metric(labels, float(model["queued"]))
                families[RUNNING].add_metric(labels, float(model["started"]))
                for version, count in model["parked"].items():
                    parked.add_metric([*labels, version], float(count))
                families[FAILED].add_metric(labels, float(model["failed"]))
                families[WORKERS_ALIVE].add_metric(labels, float(sum(w.get("state") != GONE for w in workers)))
                if beats:
                    families[NEWEST_HEARTBEAT_AGE].add_metric(labels, float(min(beats)))
                if model["model"] in ages:
                    families[OLDEST_AGE].add_metric(labels, ages[model["model"]])
        return [up, *families.values(), parked, *status.pool_metrics(pools)]

    def _read(
        self, url: str, client: redis.Redis
    ) -> tuple[list[dict[str, Any]], dict[str, float], list[dict[str, Any]]]:
        """``collect_shards`` of this one Redis, the oldest waiting job's age of each model there,
        and the records of the pools that follow their queues there."""
        info = collect_shards({url: client}, self._shards, self._heartbeat_seconds)
        for warning in info["warnings"]:
            self._once(logging.WARNING, warning)
        if info["skipped_queues"]:
            self._once(
                logging.WARNING,
                f"{keys.RQ_QUEUES_SET} holds more queue names than a scrape looks at: the queues of names no worker or "
                "signature gives may go unseen (ortq info says how many)",
            )
        if info["skipped_parked_versions"]:
            self._once(
                logging.WARNING,
                f"a model has more versions with parked jobs than a scrape looks at ({MOST_PARKED_VERSIONS}): "
                f"{PARKED} leaves some out (ortq info says how many)",
            )
        if info["skipped_pools"]:
            self._once(
                logging.WARNING,
                f"{status.POOLS_SET} holds more pool names than a scrape looks at ({status.MOST_POOLS}): the "
                "ortq_pool_* series may leave pools out (ortq info says how many)",
            )
        models: list[dict[str, Any]] = info["models"]
        return models, self._oldest_ages(client, [m["model"] for m in models]), info["pools"]

    def _oldest_ages(self, client: redis.Redis, models: list[str]) -> dict[str, float]:
        """Seconds since the head of each model's queue was enqueued (RQ's ``enqueued_at``), for the
        models whose head is a job id whose hash holds a readable time: two commands a model."""
        with client.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.lindex(keys.queue_key(model), 0)
            heads = pipe.execute(raise_on_error=False)
        ids: dict[str, str] = {}
        for model, head in zip(models, heads, strict=True):
            text = head.decode(errors="replace") if isinstance(head, bytes) else None
            if text is not None and layout.is_job_id(text):
                ids[model] = text
            elif head is not None:  # an error (a key of the wrong type) or an entry that is no job id
                self._once(logging.WARNING, f"{keys.queue_key(model)}: its head is no job id ({_said(head)})")
        with client.pipeline(transaction=False) as pipe:
            for job_id in ids.values():
                pipe.hget(keys.job_key(job_id), "enqueued_at")
            raws = pipe.execute(raise_on_error=False)
        now = layout.utcnow()
        ages: dict[str, float] = {}
        for (model, job_id), raw in zip(ids.items(), raws, strict=True):
            moment = parse_rq_time(raw) if isinstance(raw, bytes) and len(raw) <= 64 else None
            if moment is None:  # taken by a worker since the LINDEX, expired, or not RQ's time
                log.debug("%s: no readable enqueued_at (%s)", keys.job_key(job_id), _said(raw))
                continue
            ages[model] = max(0.0, (now - moment).total_seconds())  # another host's clock may be ahead
        return ages

    def _once(self, level: int, message: str) -> None:
        """Log ``message`` the first time only (a scrape comes every few seconds), up to a bound."""
        with self._lock:
            if message in self._logged or len(self._logged) >= _MOST_REMEMBERED:
                return
            self._logged.add(message)
        log.log(level, "%s", message)

    def _note_down(self, where: str, exc: redis.RedisError) -> None:
        with self._lock:
            first = where not in self._down
            self._down.add(where)
        if first:
            log.error("cannot read Redis at %s (%s: %s); ortq_exporter_redis_up 0 until it can",
                      where, type(exc).__name__, exc)  # fmt: skip

    def _note_up(self, where: str) -> None:
        with self._lock:
            was_down = where in self._down
            self._down.discard(where)
        if was_down:
            log.info("Redis at %s is readable again", where)


def _said(value: object) -> str:
    """A short, printable account of a value read from Redis, for a log line."""
    if isinstance(value, Exception):
        return f"{type(value).__name__}: {str(value)[:120]}"
    return repr(value[:64] if isinstance(value, bytes) else value)


def serve(settings: Settings, host: str, port: int, stop: threading.Event | None = None) -> int:
    """Serve /metrics on ``host:port`` until SIGTERM or SIGINT (or ``stop`` is set); returns 0. A
    port that cannot be bound is ConfigurationError."""
    shards, clients = shard_clients(settings, "serving ortq_exporter_redis_up 0 until it is back")
    registry = CollectorRegistry()
    registry.register(QueueCollector(clients, shards, settings.heartbeat_seconds))
    try:
        httpd, _thread = start_wsgi_server(port, host, registry)
    except OSError as exc:
        raise ConfigurationError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda _signum, _frame: stop.set())
    bound = httpd.server_address
    log.info("exporter serving http://%s:%s/metrics for %s", host, bound[1],
             ", ".join(redacted_url(url) for url in clients))  # fmt: skip
    try:
        while not stop.wait(0.5):
            pass
    finally:
        httpd.shutdown()
        httpd.server_close()
        for client in clients.values():
            client.close()
    log.info("exporter stopped")
    return 0


@click.command(
    epilog="Examples:\n\n\b\n  ortq exporter\n  ortq exporter --host 0.0.0.0 --port 9849\n"
    "  ortq exporter --shards conv=redis://redis-big:6379/0   # every Redis of the map, a redis label"
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to serve /metrics on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True, help="Port (0: any free one)."
)
@redis_url_option()
@shards_option()
def exporter(host: str, port: int, redis_url: str | None, shards: str | None) -> None:
    """Serve Prometheus metrics of every model's queue (length, oldest job's age, running, failed,
    workers alive, newest heartbeat), read from Redis at each scrape: they exist with no worker
    running, which autoscaling to zero needs (docs/autoscaling.md). Runs until SIGTERM or SIGINT."""
    raise SystemExit(serve(Settings.from_env(redis_url=redis_url, redis_shards=shards), host, port))

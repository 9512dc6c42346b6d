"""Starting a worker: check the runtime, resolve the adapter, create the session, warm up,
compare with the CPU, then serve the queue."""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis

from ortq import keys
from ortq.errors import AdapterNotFound, ConfigurationError, ProviderUnavailable
from ortq.metrics import WorkerMetrics, open_metrics_port
from ortq.settings import Settings
from ortq.worker.adapters import (
    PREFERENCES,
    enumerate_adapters,
    select_adapter,
    unenumerated_dml_options,
)
from ortq.worker.batch import check_batchable
from ortq.worker.identity import WorkerIdentity
from ortq.worker.loop import Worker
from ortq.worker.session import (
    AUTO_POLICIES,
    EXECUTION_PROVIDERS,
    LoadedModel,
    SessionPlan,
    canary,
    load_model,
    platform_refusal,
    warm_up,
)

log = logging.getLogger("ortq.worker")

PROVIDER_CHOICES = (*EXECUTION_PROVIDERS, "auto")


@dataclass(frozen=True)
class WorkerConfig:
    """What one ``ortq worker`` process serves, and on what."""

    model_path: Path
    model_name: str
    provider: str = "cpu"
    #: Which adapter (see ortq.worker.adapters.select_adapter); None means adapter index 0.
    adapter: str | None = None
    allow_cpu_fallback: bool = False
    policy: str = "prefer-gpu"
    threads: int | None = None
    burst: bool = False
    worker_name: str | None = None
    skip_canary: bool = False
    #: Dynamic batching: up to max_batch queued jobs share one run, waiting at most max_wait_ms
    #: for more to arrive after the first. 1 = off.
    max_batch: int = 1
    max_wait_ms: float = 0.0
    #: The declaration batching needs: the model computes each row of its outputs from the same
    #: row of its inputs only, so that jobs sharing a run cannot read or change each other's rows.
    rows_independent: bool = False
    #: Prometheus /metrics and /ready on this port (0: off), bound to metrics_host.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    #: A regular expression matched against run errors that mean the GPU is gone, besides
    #: ortq's own list (ortq.worker.devicelost).
    device_lost_pattern: str | None = None

    def __post_init__(self) -> None:
        keys.check_model_name(self.model_name)
        if self.device_lost_pattern is not None:
            try:
                re.compile(self.device_lost_pattern)
            except re.error as exc:
                raise ConfigurationError(f"--device-lost-pattern {self.device_lost_pattern!r}: {exc}") from exc
        if self.provider not in PROVIDER_CHOICES:
            raise ConfigurationError(f"unknown provider {self.provider!r}; choose one of {', '.join(PROVIDER_CHOICES)}")
        if self.policy not in AUTO_POLICIES:
            raise ConfigurationError(f"unknown policy {self.policy!r}; choose one of {', '.join(AUTO_POLICIES)}")
        if self.adapter is not None and self.provider in ("cpu", "auto"):
            raise ConfigurationError(f"--adapter does not apply to --provider {self.provider}")
        if self.max_batch < 1 or self.max_wait_ms < 0:
            raise ConfigurationError(
                f"need max_batch >= 1 and max_wait_ms >= 0, got {self.max_batch}, {self.max_wait_ms}"
            )
        if self.max_wait_ms > 0 and self.max_batch == 1:
            raise ConfigurationError("--max-wait-ms only applies with --max-batch > 1")
        if self.max_batch > 1 and not self.rows_independent:
            raise ConfigurationError(
                "--max-batch joins the rows of several jobs into one run: that is only safe for a model whose "
                "output rows each depend on the same input row alone (not for one that mixes rows, e.g. "
                "x - mean(x, axis=0), or gathers rows by an index the job supplies); if each output row of this "
                "model depends only on the same input row, say so with --rows-independent (docs/pool.md, 'Batching')"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigurationError(f"threads must be >= 1, got {self.threads}")

    def default_worker_name(self) -> str:
        return f"{self.model_name}.{socket.gethostname()}.{os.getpid()}"


def resolve_plan(config: WorkerConfig) -> tuple[SessionPlan, dict[str, Any] | None]:
    """The session plan and the resolved adapter's record, from a fresh enumeration."""
    base = SessionPlan(config.provider, None, config.threads, config.allow_cpu_fallback, policy=config.policy)
    if config.provider in ("cpu", "auto"):
        return base, None
    spec = config.adapter or "0"
    adapters, notes = enumerate_adapters()
    if any(a.provider == config.provider for a in adapters):
        adapter = select_adapter(spec, adapters, config.provider)
        log.info("adapter %r resolved to %s %d: %s", spec, adapter.provider, adapter.index, adapter.name)
        return replace(base, device_id=adapter.index), adapter.to_json()
    # Nothing to resolve against: say so, and only go on where that is still well defined.
    why = "; ".join(notes)
    if config.provider == "dml" and (options := unenumerated_dml_options(spec)) is not None:
        log.warning("%s: DirectML itself chooses the adapter by %s", why, options["performance_preference"])
        return replace(base, extra_options=tuple(options.items())), {"spec": spec, **options}
    if spec.isdigit():
        log.warning("%s: using adapter index %s unverified", why, spec)
        return replace(base, device_id=int(spec)), {"spec": spec, "index": int(spec)}
    refusal = platform_refusal(config.provider)
    if refusal is not None:  # the real reason: this provider cannot run on this OS at all
        raise ProviderUnavailable(refusal)
    hint = " (or one of: " + ", ".join(PREFERENCES) + ")" if config.provider == "dml" else ""
    raise AdapterNotFound(f"cannot resolve --adapter {spec!r}: {why}; use an index{hint}")


def build_worker(config: WorkerConfig, settings: Settings) -> Worker:
    """Create the session, warm it up, check it against the CPU, and return a worker ready to ``work()``."""
    # CUDA's default order is fastest-first; NVML's (and so `ortq adapters`') is PCI bus order.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    plan, adapter = resolve_plan(config)
    model: LoadedModel = load_model(config.model_path, plan)
    if config.max_batch > 1:
        check_batchable(model.signature)
    seconds = warm_up(model)
    log.info(
        "model %s loaded on %s%s, warm-up run %.1f ms",
        config.model_path,
        model.provider,
        " (CPU FALLBACK: the requested provider was unavailable)" if model.fell_back_to_cpu else "",
        seconds * 1000,
    )
    check = (
        {"passed": True, "skipped": "--skip-canary"} if config.skip_canary else canary(model, config.model_path, plan)
    )
    identity = WorkerIdentity(
        model=config.model_name,
        model_path=str(config.model_path),
        provider=model.provider,
        device_id=model.device_id,
        fell_back_to_cpu=model.fell_back_to_cpu,
        host=socket.gethostname(),
        pid=os.getpid(),
        extra={
            "requested_provider": config.provider,
            "adapter": adapter,
            "canary": check,
            "max_batch": config.max_batch,
            "max_wait_ms": config.max_wait_ms,
        },
    )
    name = config.worker_name or config.default_worker_name()
    return Worker(
        model,
        identity,
        settings,
        name,
        max_batch=config.max_batch,
        max_wait_ms=config.max_wait_ms,
        burst=config.burst,
        device_lost_pattern=config.device_lost_pattern,
    )


def serve(config: WorkerConfig, settings: Settings) -> int:
    """Run a worker until it is stopped (or, with ``burst``, until its queue is empty); returns
    the process's exit status: 0, EXIT_DEVICE_LOST when the GPU went away under it, EXIT_CRASHED
    when an unexpected error ended it."""
    server = None
    if config.metrics_port:  # opened first: /ready answers 503 while the model loads, a busy port fails at once
        name = config.worker_name or config.default_worker_name()
        server = open_metrics_port(config.metrics_host, config.metrics_port, model=config.model_name, worker=name)
        log.info("metrics on %s/metrics, readiness on %s/ready", server.url, server.url)
    try:
        worker = build_worker(config, settings)
        if server is not None:
            worker.metrics = worker_metrics(worker)
            server.attach(worker.metrics)
        return worker.serve()
    finally:
        if server is not None:
            server.close()


def worker_metrics(worker: Worker) -> WorkerMetrics:
    """The worker's Prometheus metrics, labelled with what it runs on."""
    identity = worker.identity
    adapter = identity.extra.get("adapter") or {}
    label = (
        "cpu" if identity.provider == "CPUExecutionProvider" else str(adapter.get("name") or adapter.get("spec") or 0)
    )
    queue = worker.book.queue.queue
    return WorkerMetrics(
        identity.model,
        label,
        identity.provider,
        worker.name,
        queue_depth=lambda: _queue_depth(worker.connection, queue),
    )


def _queue_depth(connection: redis.Redis, queue: str) -> int:
    """LLEN of the queue, 0 when it cannot be read (a key of the wrong type, Redis down): a
    scrape must not fail for it."""
    try:
        return int(connection.llen(queue))
    except redis.RedisError:
        return 0

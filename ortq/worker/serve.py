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

from ortq import keys
from ortq.errors import EXIT_CRASHED, EXIT_DEVICE_LOST, AdapterNotFound, ConfigurationError
from ortq.metrics import WorkerMetrics
from ortq.settings import Settings
from ortq.worker.adapters import (
    PREFERENCES,
    enumerate_adapters,
    select_adapter,
    unenumerated_dml_options,
)
from ortq.worker.base import WorkerIdentity
from ortq.worker.batch import check_batchable
from ortq.worker.session import (
    AUTO_POLICIES,
    EXECUTION_PROVIDERS,
    LoadedModel,
    SessionPlan,
    canary,
    load_model,
    warm_up,
)
from ortq.worker.worker import OrtqWorker

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
    hint = " (or one of: " + ", ".join(PREFERENCES) + ")" if config.provider == "dml" else ""
    raise AdapterNotFound(f"cannot resolve --adapter {spec!r}: {why}; use an index{hint}")


def build_worker(config: WorkerConfig, settings: Settings) -> OrtqWorker:
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
    return OrtqWorker(
        model,
        identity,
        settings,
        name,
        max_batch=config.max_batch,
        max_wait_ms=config.max_wait_ms,
        device_lost_pattern=config.device_lost_pattern,
    )


def serve(config: WorkerConfig, settings: Settings) -> int:
    """Run a worker until it is stopped (or, with ``burst``, until its queue is empty); returns
    the process's exit status: 0, EXIT_DEVICE_LOST when the GPU went away under it, EXIT_CRASHED
    when an unexpected error ended it."""
    worker = build_worker(config, settings)
    server = None
    if config.metrics_port:
        worker.metrics = worker_metrics(worker)
        server = worker.metrics.serve(config.metrics_host, config.metrics_port)
        log.info("metrics on %s/metrics, readiness on %s/ready", server.url, server.url)
    # RQ logs every dequeued job at INFO; ortq's own log says what matters, RQ's only when debugging.
    rq_level = "DEBUG" if log.isEnabledFor(logging.DEBUG) else "WARNING"
    try:
        worker.work(burst=config.burst, logging_level=rq_level)
    finally:
        if server is not None:
            server.close()
    if worker.device_lost is not None:
        return EXIT_DEVICE_LOST
    return EXIT_CRASHED if worker.crashed is not None else 0


def worker_metrics(worker: OrtqWorker) -> WorkerMetrics:
    """The worker's Prometheus metrics, labelled with what it runs on."""
    identity = worker.identity
    adapter = identity.extra.get("adapter") or {}
    label = (
        "cpu" if identity.provider == "CPUExecutionProvider" else str(adapter.get("name") or adapter.get("spec") or 0)
    )
    queue_key = keys.queue_key(identity.model)
    return WorkerMetrics(
        identity.model,
        label,
        identity.provider,
        worker.name,
        queue_depth=lambda: int(worker.connection.llen(queue_key)),
    )

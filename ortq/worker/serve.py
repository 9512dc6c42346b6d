"""Starting a worker: check the runtime, resolve the adapter, create the session, warm up,
compare with the CPU, then serve the queue."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis

from ortq import keys
from ortq.devices import plugin_ep
from ortq.devices.adapters import PREFERENCES, select_adapter, unenumerated_dml_options
from ortq.devices.enumeration import enumerate_adapters
from ortq.errors import AdapterNotFound, ConfigurationError, ProviderUnavailable
from ortq.metrics import WorkerMetrics, open_metrics_port
from ortq.redisurls import redacted_url
from ortq.settings import Settings
from ortq.worker import custom_ops, options, provider_options
from ortq.worker.batch import check_batchable
from ortq.worker.identity import WorkerIdentity
from ortq.worker.loop import Worker
from ortq.worker.options import DEFAULTS, ORT_LOG_LEVELS
from ortq.worker.runtime import import_onnxruntime, platform_refusal
from ortq.worker.session import (
    PLUGIN_PROVIDERS,
    LoadedModel,
    SessionPlan,
    canary,
    load_model,
    missing_provider,
    quiet_onnxruntime,
    warm_up,
)

log = logging.getLogger("ortq.worker")


@dataclass(frozen=True)
class WorkerConfig:
    """What one ``ortq worker`` process serves, and on what."""

    model_path: Path
    model_name: str
    provider: str = DEFAULTS["provider"]
    #: Which adapter (see ortq.devices.adapters.select_adapter); None means adapter index 0 (a plugin
    #: EP's first device that is not the CPU; for webgpu, Dawn's high-performance choice; for winml,
    #: ONNX Runtime's choice by ``policy``).
    adapter: str | None = DEFAULTS["adapter"]
    #: --provider plugin: the EP's shared library and its ONNX Runtime name (optional where the
    #: library registers one EP); --provider winml: only this EP of Windows ML's catalog.
    ep_library: str | None = DEFAULTS["ep_library"]
    ep_name: str | None = DEFAULTS["ep_name"]
    allow_cpu_fallback: bool = DEFAULTS["allow_cpu_fallback"]
    policy: str = DEFAULTS["policy"]
    threads: int | None = DEFAULTS["threads"]
    ort_log_level: str = DEFAULTS["ort_log_level"]
    burst: bool = DEFAULTS["burst"]
    worker_name: str | None = DEFAULTS["worker_name"]
    skip_canary: bool = DEFAULTS["skip_canary"]
    #: Dynamic batching: up to max_batch queued jobs share one run, waiting at most max_wait_ms
    #: for more to arrive after the first. 1 = off.
    max_batch: int = DEFAULTS["max_batch"]
    max_wait_ms: float = DEFAULTS["max_wait_ms"]
    #: The declaration batching needs: the model computes each row of its outputs from the same
    #: row of its inputs only, so that jobs sharing a run cannot read or change each other's rows.
    rows_independent: bool = DEFAULTS["rows_independent"]
    #: Batches taken ahead of time while one runs (ortq.worker.overlap.Ahead); None: auto, only
    #: while runs are short next to a take's round trip to Redis.
    prefetch: int | None = DEFAULTS["prefetch"]
    #: Prometheus /metrics and /ready on this port (0: off), bound to metrics_host.
    metrics_port: int = DEFAULTS["metrics_port"]
    metrics_host: str = DEFAULTS["metrics_host"]
    #: A regular expression matched against run errors that mean the GPU is gone, besides
    #: ortq's own list (ortq.worker.devicelost).
    device_lost_pattern: str | None = DEFAULTS["device_lost_pattern"]
    #: A run that lasts longer is taken as hung: the worker hands on its jobs and exits 75
    #: (ortq.worker.watchdog); 0: never.
    stall_seconds: float = DEFAULTS["stall_seconds"]
    #: Seconds a run may take for a job that sets no ``timeout`` of its own (RQ's job timeout); None: no limit.
    job_timeout: float | None = DEFAULTS["job_timeout"]
    #: The version of the model it serves, which every answer names and producers may pin; None:
    #: the model file's digest (file_version).
    model_version: str | None = DEFAULTS["model_version"]
    #: A custom-op library to register before the session is made: ``onnxruntime_extensions`` (that
    #: package's library) or a shared library's path (ortq.worker.custom_ops).
    custom_ops: str | None = DEFAULTS["custom_ops"]
    #: (key, value) options for the execution provider, after ortq's own (ortq.worker.provider_options).
    provider_options: tuple[tuple[str, str], ...] = DEFAULTS["provider_options"]

    def __post_init__(self) -> None:
        keys.check_model_name(self.model_name)
        # Checked (and made a tuple) before anything starts: malformed, duplicated, or one ortq sets itself.
        object.__setattr__(self, "provider_options", provider_options.check(self.provider, self.provider_options))
        options.check({field: getattr(self, field) for field in options.BY_FIELD})

    def default_worker_name(self) -> str:
        return f"{self.model_name}.{socket.gethostname()}.{os.getpid()}"


def resolve_plan(config: WorkerConfig) -> tuple[SessionPlan, dict[str, Any] | None]:
    """The session plan and the resolved adapter's record, from a fresh enumeration."""
    library = None if config.custom_ops is None else custom_ops.library_path(config.custom_ops)
    base = SessionPlan(
        config.provider,
        None,
        config.threads,
        config.allow_cpu_fallback,
        policy=config.policy,
        custom_ops=library,
        user_options=config.provider_options,
        log_severity=ORT_LOG_LEVELS.index(config.ort_log_level),
    )
    if config.provider in ("cpu", "auto"):
        return base, None
    if config.provider in PLUGIN_PROVIDERS:
        try:
            return _resolve_plugin(config, base)
        except ProviderUnavailable as exc:
            if not config.allow_cpu_fallback:
                raise
            return replace(base, unavailable=str(exc)), None
    missing = missing_provider(config.provider)
    if missing is not None:  # no adapter can help: load_model says so first (or falls back), no listing before it
        return replace(base, unavailable=missing), None
    return resolve_adapter(config, base)


def resolve_adapter(config: WorkerConfig, base: SessionPlan) -> tuple[SessionPlan, dict[str, Any] | None]:
    """``base`` (a dml or cuda plan) with the adapter ``config.adapter`` names, and its record,
    resolved against a fresh enumeration (or, where nothing enumerates, as far as it still can)."""
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


def _resolve_plugin(config: WorkerConfig, base: SessionPlan) -> tuple[SessionPlan, dict[str, Any] | None]:
    """Register the plugin EP's library, list its devices, and choose one by ``config.adapter``."""
    refusal = platform_refusal(config.provider)
    if refusal is not None:
        raise ProviderUnavailable(refusal)
    ort = import_onnxruntime(config.provider)
    quiet_onnxruntime(ort, base.log_severity)  # the registration below logs through ORT's default logger
    if config.provider == "webgpu":
        plugin_ep.register_webgpu(ort)
        adapter, preference = plugin_ep.resolve_webgpu(config.adapter, plugin_ep.webgpu_adapters(ort))
        devices = plugin_ep.ep_devices(ort, plugin_ep.WEBGPU_EP)
        if not devices:
            raise ProviderUnavailable(f"the WebGPU EP offers no device for {adapter.name}: get_ep_devices() lists none")
        if adapter.software:
            log.warning("WebGPU runs on %s, a software Vulkan driver on the CPU: correct, not fast", adapter.name)
        plan = replace(
            base,
            ep_name=plugin_ep.WEBGPU_EP,
            libraries=(("ortq-webgpu", plugin_ep.webgpu_library()),),
            ep_device=0,  # the EP takes one device and leaves the GPU to Dawn's power preference
            config_entries=((plugin_ep.WEBGPU_POWER_PREFERENCE, plugin_ep.DAWN_PREFERENCE[preference]),),
        )
        return plan, {**adapter.to_json(), "power_preference": preference, "chosen_by": "Dawn, by power preference"}
    if config.provider == "winml":
        from ortq.devices import winml

        libraries, choice = winml.resolve_winml(ort, config.adapter, config.ep_name)
        if choice is None:  # ONNX Runtime chooses among the registered EPs by --policy
            record = {"policy": config.policy, "registered": [n for n, _ in libraries]}
            return replace(base, libraries=libraries), record
        adapter, index = choice
        plan = replace(base, ep_name=adapter.ep_name, libraries=libraries, ep_device=index)
        return plan, {**adapter.to_json(), "registered": [n for n, _ in libraries]}
    library = str(config.ep_library)
    registration, ep_name, adapters = plugin_ep.open_library(ort, library, config.ep_name)
    adapter = plugin_ep.choose_plugin_adapter(config.adapter, adapters, ep_name)
    plan = replace(base, ep_name=ep_name, libraries=((registration, library),), ep_device=adapter.index)
    return plan, {**adapter.to_json(), "ep_library": library}


def build_worker(config: WorkerConfig, settings: Settings) -> Worker:
    """Create the session, warm it up, check it against the CPU, and return a worker ready to ``work()``.
    Under a shard map (``ORTQ_REDIS_SHARDS``) the worker serves from its model's Redis, as the
    producers that read the same map send there; ``redis_url`` is the Redis of models it does not list."""
    settings = model_redis(settings, config.model_name)
    # CUDA's default order is fastest-first; NVML's (and so `ortq adapters`') is PCI bus order.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    plan, adapter = resolve_plan(config)
    model: LoadedModel = load_model(config.model_path, plan)
    if config.max_batch > 1:
        if model.encoded_inputs:  # one file's bytes after another's are no image, nor rows to split
            raise ConfigurationError(
                f"--max-batch cannot join jobs whose input {model.encoded_inputs[0]!r} is an encoded image's bytes "
                "(--custom-ops): run them one job a run (--max-batch 1)"
            )
        check_batchable(model.signature)
    seconds = warm_up(model)
    log.info(
        "model %s loaded on %s%s, %s",
        config.model_path,
        model.provider,
        " (CPU FALLBACK: the requested provider was unavailable)" if model.fell_back_to_cpu else "",
        "no warm-up run" if seconds is None else f"warm-up run {seconds * 1000:.1f} ms",
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
        version=config.model_version or file_version(config.model_path),
        extra={
            "requested_provider": config.provider,
            "adapter": adapter,
            "canary": check,
            "nodes": model.placement,
            "custom_ops": plan.custom_ops,
            "provider_options": model.provider_options,
            "max_batch": config.max_batch,
            "max_wait_ms": config.max_wait_ms,
            "prefetch": "auto" if config.prefetch is None else config.prefetch,
            "stall_seconds": config.stall_seconds,
            "job_timeout": config.job_timeout,
            "rq_results": settings.rq_results,
            "rq_executions": settings.rq_executions,
            # Readers judge by it whether this worker is gone (ortq.info.GONE_AFTER_BEATS).
            "heartbeat_seconds": settings.heartbeat_seconds,
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
        prefetch=config.prefetch,
        burst=config.burst,
        device_lost_pattern=config.device_lost_pattern,
        stall_seconds=config.stall_seconds,
        job_timeout=config.job_timeout,
    )


def file_version(model_path: Path) -> str:
    """A model's default version: the first 12 hex digits of its file's SHA-256, so that workers
    started on the same file share a version and a changed file makes a new one."""
    digest = hashlib.sha256()
    with model_path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:12]


def model_redis(settings: Settings, model: str) -> Settings:
    """``settings`` for ``model``'s Redis under the shard map, if there is one."""
    shards = settings.shards
    if shards is None:
        return settings
    url = shards.url_for(model)
    if url != settings.redis_url:
        log.info("model %r is on %s by the shard map ($ORTQ_REDIS_SHARDS)", model, redacted_url(url))
    return settings.for_redis(url)


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
    queue = worker.upkeep.book.queue.queue
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

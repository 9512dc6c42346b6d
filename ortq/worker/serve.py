"""Starting a worker: check the runtime, create the session, warm up, then serve the queue."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ortq import keys
from ortq.errors import ConfigurationError
from ortq.settings import Settings
from ortq.worker.session import EXECUTION_PROVIDERS, LoadedModel, SessionPlan, load_model, warm_up
from ortq.worker.worker import OrtqWorker, WorkerIdentity

log = logging.getLogger("ortq.worker")


@dataclass(frozen=True)
class WorkerConfig:
    """What one ``ortq worker`` process serves, and on what."""

    model_path: Path
    model_name: str
    provider: str = "cpu"
    device_id: int = 0
    allow_cpu_fallback: bool = False
    threads: int | None = None
    burst: bool = False
    worker_name: str | None = None

    def __post_init__(self) -> None:
        keys.check_model_name(self.model_name)
        if self.provider not in EXECUTION_PROVIDERS:
            raise ConfigurationError(
                f"unknown provider {self.provider!r}; choose one of {', '.join(EXECUTION_PROVIDERS)}"
            )
        if self.device_id < 0:
            raise ConfigurationError(f"device id must be >= 0, got {self.device_id}")
        if self.threads is not None and self.threads < 1:
            raise ConfigurationError(f"threads must be >= 1, got {self.threads}")

    def plan(self) -> SessionPlan:
        return SessionPlan(self.provider, self.device_id, self.threads, self.allow_cpu_fallback)

    def default_worker_name(self) -> str:
        return f"{self.model_name}.{socket.gethostname()}.{os.getpid()}"


def build_worker(config: WorkerConfig, settings: Settings) -> OrtqWorker:
    """Create the session, warm it up and return a worker ready to ``work()``."""
    model: LoadedModel = load_model(config.model_path, config.plan())
    seconds = warm_up(model)
    log.info(
        "model %s loaded on %s%s, warm-up run %.1f ms",
        config.model_path,
        model.provider,
        " (CPU FALLBACK: the requested provider was unavailable)" if model.fell_back_to_cpu else "",
        seconds * 1000,
    )
    identity = WorkerIdentity(
        model=config.model_name,
        model_path=str(config.model_path),
        provider=model.provider,
        device_id=model.device_id,
        fell_back_to_cpu=model.fell_back_to_cpu,
        host=socket.gethostname(),
        pid=os.getpid(),
        extra={"requested_provider": config.provider},
    )
    return OrtqWorker(model, identity, settings, name=config.worker_name or config.default_worker_name())


def serve(config: WorkerConfig, settings: Settings) -> bool:
    """Run a worker until it is stopped (or, with ``burst``, until its queue is empty)."""
    worker = build_worker(config, settings)
    # RQ logs every dequeued job at INFO; ortq's own log says what matters, RQ's only when debugging.
    rq_level = "DEBUG" if log.isEnabledFor(logging.DEBUG) else "WARNING"
    return bool(worker.work(burst=config.burst, logging_level=rq_level))

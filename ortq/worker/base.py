"""What an ortq worker is to RQ and to the people watching it, apart from running jobs: the
records it publishes (RQ's worker hash, ortq's worker record and the model's signature), its
heartbeats, signal handling on Windows, and RQ's registry maintenance made safe for it."""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from rq.queue import Queue
from rq.registry import DeferredJobRegistry, FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.utils import now
from rq.worker import SimpleWorker
from rq.worker_registration import clean_worker_registry

from ortq import keys
from ortq.metrics import WorkerMetrics
from ortq.rqjob import OrtqJob
from ortq.serializer import MsgpackSerializer
from ortq.settings import REDIS_DOWN, Settings

log = logging.getLogger("ortq.worker")


@dataclass
class WorkerIdentity:
    """What the worker publishes under ``ortq:worker:<name>``, besides its live counters."""

    model: str
    model_path: str
    provider: str
    device_id: int | None
    fell_back_to_cpu: bool
    host: str
    pid: int
    extra: dict[str, Any] = field(default_factory=dict)


class PublishingWorker(SimpleWorker):
    """An RQ SimpleWorker on one ortq queue that publishes ortq's records with its heartbeats."""

    def __init__(
        self, queue: Queue, identity: WorkerIdentity, settings: Settings, signature: dict[str, Any], name: str | None
    ) -> None:
        super().__init__(
            [queue],
            name=name,
            connection=queue.connection,
            serializer=MsgpackSerializer,
            job_class=OrtqJob,
            queue_class=Queue,
        )
        self.identity = identity
        self.settings = settings
        self.signature = signature
        #: Prometheus metrics, when the worker serves them (serve.py); ready once its record is out.
        self.metrics: WorkerMetrics | None = None
        self._signature_json = json.dumps({"model": identity.model, **signature})
        self._last_beat = 0.0
        self._last_suspension_check = 0.0

    # ----------------------------------------------------------- records ortq publishes

    def record(self) -> dict[str, Any]:
        ident = self.identity
        return {
            "name": self.name,
            "model": ident.model,
            "model_path": ident.model_path,
            "provider": ident.provider,
            "device_id": ident.device_id,
            "fell_back_to_cpu": ident.fell_back_to_cpu,
            "host": ident.host,
            "pid": ident.pid,
            "queue": keys.queue_name(ident.model),
            "state": self.get_state(),
            "signature": self.signature,
            **ident.extra,
        }

    def _publish(self, pipe: Any) -> None:
        ttl = self.worker_ttl + 60
        pipe.set(keys.worker_key(self.name), json.dumps(self.record()), ex=ttl)
        pipe.sadd(keys.WORKERS_SET, self.name)
        pipe.set(keys.signature_key(self.identity.model), self._signature_json, ex=self.settings.request_ttl)

    def register_death(self) -> None:
        if self.metrics is not None:
            self.metrics.set_ready(False)
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.delete(keys.worker_key(self.name))
            pipe.srem(keys.WORKERS_SET, self.name)
            pipe.execute()
        super().register_death()

    def handle_payload(self, message: dict[str, Any]) -> None:
        """RQ's commands over its pub/sub channel (``rq.command.send_shutdown_command``, used by
        ``ortq pool`` on Windows, where a service has no console for CTRL_BREAK). RQ's own handler
        signals SIGINT to itself, which on Windows is TerminateProcess: here a shutdown is a warm
        stop request instead, seen by the work loop between jobs."""
        try:
            command = json.loads(message["data"]).get("command")
        except (ValueError, TypeError, AttributeError, KeyError):
            log.warning("ignoring an unreadable command on %s", self.pubsub_channel_name)
            return
        if command != "shutdown":
            log.warning("ignoring command %r: an ortq worker only takes 'shutdown'", command)
            return
        log.info("worker %s: shutdown command received; stopping after the current job", self.name)
        if self.metrics is not None:
            self.metrics.set_ready(False)
        self._stop_requested = True

    def request_stop(self, signum: Any, frame: Any) -> None:
        if self.metrics is not None:
            self.metrics.set_ready(False)  # stop sending it traffic: it finishes what it has, then exits
        super().request_stop(signum, frame)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's heartbeat in one round trip, refreshing ortq's records too; standalone beats are
        rate-limited because RQ calls this several times per job and the TTL is minutes long."""
        if pipeline is not None:
            super().heartbeat(timeout, pipeline=pipeline)
            return
        if time.monotonic() - self._last_beat < self.settings.heartbeat_seconds and timeout is None:
            return
        try:
            with self.connection.pipeline(transaction=False) as pipe:
                super().heartbeat(timeout, pipeline=pipe)
                self._publish(pipe)
                pipe.execute()
        except REDIS_DOWN as exc:
            # RQ's work loop quits on any error it sees; a missed beat is retried by the next one
            # (the dequeue loop rides out the outage itself).
            log.warning("heartbeat failed: Redis unavailable (%s)", exc)
            return
        self._last_beat = time.monotonic()
        if self.metrics is not None and not self.metrics.ready and not self._stop_requested:
            self.metrics.set_ready(True)  # its record is out: producers can see it

    def set_state(self, state: str, pipeline: Any = None) -> None:
        if pipeline is None and state == self._state:
            return  # RQ re-announces IDLE before every dequeue; it is already written
        super().set_state(state, pipeline=pipeline)

    # ----------------------------------------------------------- platform and maintenance

    def _install_signal_handlers(self) -> None:
        super()._install_signal_handlers()
        sigbreak = getattr(signal, "SIGBREAK", None)  # CTRL_BREAK_EVENT on Windows
        if sigbreak is not None:
            signal.signal(sigbreak, self.request_stop)

    def clean_registries(self) -> None:
        """RQ's registry maintenance, with this worker's job class and death penalty.

        RQ's own ``clean_registries`` builds registries whose death penalty is hard-coded to
        SIGALRM, which does not exist on Windows; OrtqJob makes sure no callback is imported.
        """
        for queue in self.queues:
            if not queue.acquire_maintenance_lock():
                continue
            for registry_class in (
                FinishedJobRegistry,
                StartedJobRegistry,
                FailedJobRegistry,
                DeferredJobRegistry,
            ):
                registry_class(
                    name=queue.name,
                    connection=self.connection,
                    job_class=OrtqJob,
                    serializer=MsgpackSerializer,
                    death_penalty_class=self.death_penalty_class,
                ).cleanup(exception_handlers=self._exc_handlers)
            clean_worker_registry(queue)
            queue.intermediate_queue.cleanup(self, queue)
            queue.release_maintenance_lock()
        self.last_cleaned_at = now()  # type: ignore[assignment]  # RQ annotates it as None only

    def check_for_suspension(self, burst: bool) -> None:
        # RQ asks Redis before every job; once a second is enough for `rq suspend` to take effect.
        if time.monotonic() - self._last_suspension_check >= 1.0:
            self._last_suspension_check = time.monotonic()
            try:
                super().check_for_suspension(burst)
            except REDIS_DOWN as exc:
                log.warning("suspension check failed: Redis unavailable (%s)", exc)

    def run_maintenance_tasks(self) -> None:
        try:
            super().run_maintenance_tasks()
        except REDIS_DOWN as exc:  # RQ's maintenance runs again at its next interval
            log.warning("RQ maintenance failed: Redis unavailable (%s)", exc)

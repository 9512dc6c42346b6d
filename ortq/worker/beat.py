"""The worker's second thread: its heartbeats, RQ's commands for it, and the upkeep that needs no
job of its own.

The main thread owns the session and spends most of its time in ``session.run`` or blocked on the
queue; this thread, on a connection of its own, keeps the worker visibly alive meanwhile (ONNX
Runtime releases the GIL during ``Run``):

- every ``interval`` seconds, RQ's heartbeat of the worker and of each job the main thread runs,
  with ortq's own records (``ortq:worker:<name>``, the model's signature) in the same round trip;
- RQ's command channel (``<prefix>:pubsub:<name>``, where ``rq.command.send_shutdown_command``
  publishes): a shutdown is a warm stop request;
- ``upkeep``, called after each beat and at least once a second: taking back jobs of dead
  workers, rescuing lost dequeues, due retries, registry cleanup (see ortq.worker.upkeep);
- ``poll``, every ``poll_interval`` seconds: the stop requests of jobs held that long (so that a
  stop takes a fraction of a second, not up to a heartbeat interval: ortq.worker.stops).

Nothing here may end the thread: a Redis outage is logged and retried at the next beat, and any
other error is logged, so that a worker never looks dead while it is not.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import redis

from ortq.rqcompat import layout
from ortq.settings import REDIS_DOWN

log = logging.getLogger("ortq.worker")

#: The largest command payload read from the channel: RQ's are a few dozen bytes.
_MAX_COMMAND_BYTES = 4096


class Beat:
    """``beat(pipe)`` every ``interval`` s, ``upkeep()`` about once a second, ``on_shutdown()``
    when RQ's shutdown command arrives and ``on_stop_job(id)`` when its stop-job command does; all on
    one daemon thread with its own connection."""

    def __init__(
        self,
        connect: Callable[[], redis.Redis],
        worker_name: str,
        interval: float,
        beat: Callable[[redis.Redis], None],
        upkeep: Callable[[redis.Redis], None],
        on_shutdown: Callable[[], None],
        on_stop_job: Callable[[str], None] = lambda job_id: None,
        poll: Callable[[redis.Redis], None] = lambda connection: None,
        poll_interval: float = 0.5,
    ) -> None:
        self._connect = connect
        self._channel = layout.pubsub_channel(worker_name)
        self.interval = interval
        self._beat = beat
        self._upkeep = upkeep
        self._on_shutdown = on_shutdown
        self._on_stop_job = on_stop_job
        self._poll = poll
        self.poll_interval = poll_interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ortq-beat", daemon=True)
        self._connection: redis.Redis | None = None
        self._pubsub: Any = None

    def start(self) -> None:
        """Subscribe to the command channel (here, so that whoever sees the worker from now on can
        stop it: a command published before the subscription would be lost), then start beating."""
        self._connection = self._connect()
        self._pubsub = self._listen(self._connection, None, 0.0)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)

    def _run(self) -> None:
        connection = self._connection or self._connect()
        pubsub: Any = self._pubsub
        next_beat = next_upkeep = next_poll = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.interval
                    self._guarded("heartbeat", lambda: self._beat(connection))
                if now >= next_upkeep:
                    next_upkeep = now + 1.0
                    self._guarded("upkeep", lambda: self._upkeep(connection))
                if now >= next_poll:
                    next_poll = now + self.poll_interval
                    self._guarded("reading stop requests", lambda: self._poll(connection))
                # Short waits: a stop request (the worker's exit) is seen within a quarter second.
                wait = max(0.01, min(next_beat, next_upkeep, next_poll, time.monotonic() + 0.25) - time.monotonic())
                pubsub = self._listen(connection, pubsub, wait)
        finally:
            if pubsub is not None:
                pubsub.close()
            connection.close()

    def _guarded(self, what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except REDIS_DOWN as exc:
            log.warning("%s skipped: Redis unavailable (%s)", what, exc)
        except Exception:  # a bug or a record nobody foresaw: logged, the next round tries again
            log.exception("%s failed", what)

    def _listen(self, connection: redis.Redis, pubsub: Any, wait: float) -> Any:
        """Wait up to ``wait`` s for a command; returns the subscription (None after a failure,
        so that the next call subscribes again)."""
        try:
            if pubsub is None:
                # Any: redis-py's annotations of pubsub() differ between its releases.
                pubsub = cast(Any, connection).pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self._channel)
            message = pubsub.get_message(timeout=wait)
        except (*REDIS_DOWN, redis.ResponseError) as exc:
            # Down, or SUBSCRIBE denied by the ACL (docs/security.md grants it): beat on without it.
            if pubsub is not None:
                pubsub.close()
            log.debug("command channel unavailable (%s)", exc)
            if wait > 0:
                self._stop.wait(wait)
            return None
        if message is not None and message.get("type") == "message":
            self._command(message.get("data"))
        return pubsub

    def _command(self, data: object) -> None:
        """RQ's ``send_command`` payload: JSON with a ``command``. ``shutdown``: RQ's own handler would
        signal SIGINT to itself, which on Windows is TerminateProcess, so here it is a warm stop
        request. ``stop-job`` (with ``job_id``): that job is stopped (ortq.worker.stops), not the
        process RQ's handler would kill. Nothing else means anything to an ortq worker."""
        try:
            if not isinstance(data, bytes) or len(data) > _MAX_COMMAND_BYTES:
                raise ValueError("not a short byte string")
            payload = json.loads(data)
            command = payload.get("command")
        except (ValueError, AttributeError, RecursionError):
            log.warning("ignoring an unreadable command on %s", self._channel)
            return
        if command == "stop-job" and isinstance(job_id := payload.get("job_id"), str) and len(job_id) <= 128:
            self._on_stop_job(job_id)
            return
        if command != "shutdown":
            log.warning("ignoring command %.40r: an ortq worker only takes 'shutdown' and 'stop-job'", command)
            return
        log.info("shutdown command received: stopping after the current batch")
        self._on_shutdown()

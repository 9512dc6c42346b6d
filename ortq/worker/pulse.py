"""A heartbeat that keeps going while ``session.run`` holds the worker's main thread.

RQ's SimpleWorker sends no heartbeat while a job runs, so a long run looks like a dead worker
(and a dead worker looks alive until its TTLs pass). ONNX Runtime releases the GIL during
``Run``, so one daemon thread can beat for it: it calls ``beat`` every ``interval`` seconds
while a run is marked in progress, and does nothing otherwise (no thread per job).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

log = logging.getLogger("ortq.worker")

T = TypeVar("T")


class Pulse(Generic[T]):
    """``with pulse.running(what): session.run(...)`` — ``beat(what)`` is called every
    ``interval`` seconds until the block ends."""

    def __init__(self, beat: Callable[[T], None], interval: float) -> None:
        self._beat = beat
        self.interval = interval
        self._current: tuple[float, T] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ortq-pulse", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @contextmanager
    def running(self, what: T) -> Iterator[None]:
        with self._lock:
            self._current = (time.monotonic(), what)
        try:
            yield
        finally:
            with self._lock:
                self._current = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval / 4):
            with self._lock:
                current = self._current
            if current is None or time.monotonic() - current[0] < self.interval:
                continue
            try:
                self._beat(current[1])
            except Exception as exc:  # a lost beat must not kill the thread; the next one retries
                log.warning("heartbeat during a run failed: %s", exc)
            with self._lock:
                if self._current is not None and self._current[1] is current[1]:
                    self._current = (time.monotonic(), current[1])

"""Job timeouts for ``session.run``: one watcher thread a worker, not a timer thread a run.

A timeout like RQ's (a signal or a timer raising in Python) cannot interrupt native code, so a run
past its job's timeout is stopped by ONNX Runtime itself: ``RunOptions.terminate`` set from another
thread. ``threading.Timer`` would start an OS thread for every run, ~165 µs a run on the CI VM
(thread start-up, its start handshake, its wake-up at ``cancel``; bench/run_timeout.py), which a
worker running one-job batches of small models would pay per job. Here one daemon thread, started
at the first timed run, sleeps toward the armed run's deadline; arming a run costs two lock round
trips, and wakes the watcher only when the new deadline is earlier than the one it sleeps toward
(back-to-back runs with one timeout move the deadline later: no wake-up at all).
"""

from __future__ import annotations

import threading
import time
from typing import Any


class RunDeadline:
    """Stops the one run in flight once its deadline passes (only the main thread calls ``Run``,
    so one armed run at a time is all a worker has)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._armed: tuple[Any, float] | None = None  # (the run's RunOptions, its monotonic deadline)
        self._sleeping_until: float | None = None  # the deadline the watcher waits for; None: none
        self._watcher: threading.Thread | None = None
        #: Whether the last armed run's deadline passed (its ``terminate`` was set here, not by a stop).
        self.fired = False

    def arm(self, options: Any, seconds: float) -> None:
        """Set ``options.terminate`` once ``seconds`` pass, unless ``disarm`` comes first."""
        deadline = time.monotonic() + seconds
        with self._changed:
            self._armed = (options, deadline)
            self.fired = False
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="ortq-run-timeout", daemon=True)
                self._watcher.start()
            elif self._sleeping_until is None or deadline < self._sleeping_until:
                self._changed.notify()

    def disarm(self) -> None:
        """The run ended: its deadline no longer applies. (The watcher is not woken: at the deadline
        it slept toward, it finds nothing or a later run's deadline, and sleeps on.)"""
        with self._changed:
            self._armed = None

    def _watch(self) -> None:
        with self._changed:
            while True:
                if self._armed is None:
                    self._sleeping_until = None
                    self._changed.wait()
                    continue
                options, deadline = self._armed
                left = deadline - time.monotonic()
                if left <= 0:
                    options.terminate = True  # under the lock: never after its run's disarm
                    self.fired = True
                    self._armed = None
                    continue
                self._sleeping_until = deadline
                self._changed.wait(left)

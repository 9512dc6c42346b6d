"""Stopping a job a worker holds, at its producer's request (``job.cancel()`` on a started job) or
an operator's (RQ's ``stop-job`` command on the worker's channel).

A producer may not publish on a worker's command channel (docs/security.md: with that right it could
also shut workers down), so it marks the job instead: ``ortq_stop`` in the job hash, written by
``ortq_request_stop_v1`` only while the job is started. The heartbeat thread reads whether that
field is set (its length: one HSTRLEN a job) for every job the worker holds, in the heartbeat's
round trip, and every STOP_POLL_SECONDS between heartbeats for the jobs held that long; RQ's
command is read as it arrives. A requested job is then

* not run, when the main thread has not run it yet (checked before each run: a set lookup);
* stopped in its run, when every job of the run in flight is requested (``RunOptions.terminate``,
  as a job timeout is: ONNX Runtime ends the run at its next node);

and fails with JobStopped, RQ's status ``stopped``. A run that ends before the request is seen
answers as usual: the stop came too late.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

#: How often the heartbeat thread reads the stop requests of the jobs held at least this long: a
#: stop takes about this long to be seen, whatever the heartbeat interval.
STOP_POLL_SECONDS = 0.5


class Stops:
    """The ids of held jobs whose stop was requested, and the run in flight, which is stopped once
    every job in it is requested. Written by the heartbeat thread, read by the main thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requested: frozenset[str] = frozenset()
        self._run: tuple[frozenset[str], Any] | None = None  # its jobs' ids and RunOptions
        self._stopped_run = False

    def request(self, job_ids: Iterable[str], held: Iterable[str]) -> None:
        """Stop ``job_ids``, those of them that are among the ``held`` jobs' ids (the rest are no
        longer, or never were, this worker's); the ids of jobs no longer held are forgotten."""
        held = frozenset(held)
        with self._lock:
            self._requested = (self._requested | frozenset(job_ids)) & held
            if self._run is not None and self._run[0] <= self._requested:
                self._run[1].terminate = True
                self._stopped_run = True

    def requested(self, job_id: str) -> bool:
        """Whether ``job_id``'s stop was requested (one lookup: the main thread asks before each run)."""
        return job_id in self._requested

    @property
    def any(self) -> bool:
        return bool(self._requested)

    def run_began(self, job_ids: Iterable[str], options: Any) -> None:
        """The main thread starts the run of ``job_ids`` with ``options`` (onnxruntime.RunOptions)."""
        with self._lock:
            self._run = (frozenset(job_ids), options)
            self._stopped_run = False
            if self._run[0] <= self._requested:  # requested between the check and now
                options.terminate = True
                self._stopped_run = True

    def run_ended(self) -> bool:
        """The run ended; whether it was stopped here (its jobs fail with JobStopped)."""
        with self._lock:
            self._run = None
            stopped, self._stopped_run = self._stopped_run, False
            return stopped

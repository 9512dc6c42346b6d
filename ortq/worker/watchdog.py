"""Liveness tied to progress: a worker whose run has stopped making progress ends, handing on its jobs.

The heartbeat thread (ortq.worker.beat) beats whatever the main thread does: that is what lets a
long run keep its jobs, and what would let a hung one keep them forever (a GPU driver that never
returns from ``Run``, a TDR that does not end in a device-removed error, a run of a job that has no
``timeout``). So before each beat the heartbeat thread asks ``Progress`` whether the run in flight
has lasted longer than ``stall_seconds`` (``ortq worker --stall-seconds``, 600 by default; 0: never).
If it has, the worker stops beating, hands on every job it holds (back at the head of the queue,
counted against each job's recoveries, so that a job that hangs every worker ends as ``WorkerLost``
after two), unregisters and exits at once with EXIT_DEVICE_LOST (75): the pool starts a fresh
process, with a fresh device, at once. The stuck thread cannot be stopped or joined, so the process
exits from the heartbeat thread.

``stall_seconds`` bounds every run, whatever its job's own ``timeout`` says: a producer cannot hold a
GPU longer than the operator allows. A job timeout (the job's, or the worker's ``--job-timeout``
for jobs without one) stops a run that is merely slow, and fails its jobs with ``JobTimeout``;
this is for the run that does not stop.
"""

from __future__ import annotations

import time

#: The default of ``ortq worker --stall-seconds``: far longer than any one run of an online model
#: should take, short enough that a hung GPU does not hold its jobs for long.
DEFAULT_STALL_SECONDS = 600.0


class Progress:
    """When the run in flight began, as the main thread says; read by the heartbeat thread. (Plain
    attribute writes and reads: each is atomic under the GIL, and nothing needs them together.)"""

    def __init__(self, stall_seconds: float = DEFAULT_STALL_SECONDS) -> None:
        self.stall_seconds = stall_seconds
        self._began: float | None = None

    def run_began(self) -> None:
        self._began = time.monotonic()

    def run_ended(self) -> None:
        self._began = None

    def stalled_for(self) -> float | None:
        """Seconds the run in flight has lasted, when that is past ``stall_seconds``; else None."""
        began = self._began
        if began is None or self.stall_seconds <= 0:
            return None
        lasted = time.monotonic() - began
        return lasted if lasted > self.stall_seconds else None

"""Stopping a job a worker holds, at its producer's request (``job.cancel()`` on a started job) or
an operator's (RQ's ``stop-job`` command on the worker's channel).

A producer may not publish on a worker's command channel (docs/security.md: with that right it could
also shut workers down), so it marks the job instead: ``ortq_stop`` in the job hash, written by
``ortq_request_stop_v3`` only while the job is started. The heartbeat thread reads whether that
field holds something of a stop token's length (one HSTRLEN a job) for every job the worker holds,
in the heartbeat's round trip, and every STOP_POLL_SECONDS between heartbeats for the jobs held that
long, and then reads those marks; RQ's command is read as it arrives.

A mark stops its job only when it is the job's own stop token (redisfunctions.stop_token: made from
the proof of the request the worker read, so from a nonce only the job's producer knows). Any
producer may write any job hash's fields (RQ's job hashes are every model's), so a mark of anything
else is ignored and the job runs: a plain ``HSET rq:job:<id> ortq_stop 1`` by another model's
producer stopped the job before. RQ's command comes from the worker's channel, on which no producer
may publish: it stops the job as it is. A job that is marked and stopped is then

* not run, when the main thread has not run it yet (checked before each run);
* stopped in its run, when every job of the run in flight is stopped (``RunOptions.terminate``,
  as a job timeout is: ONNX Runtime ends the run at its next node);

and fails with JobStopped, RQ's status ``stopped``. A run that ends before the request is seen
answers as usual: the stop came too late.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from ortq import redisfunctions

log = logging.getLogger("ortq.worker")

#: How often the heartbeat thread reads the stop requests of the jobs held at least this long: a
#: stop takes about this long to be seen, whatever the heartbeat interval.
STOP_POLL_SECONDS = 0.5


#: A job's stop asked on RQ's command channel (an operator's): it needs no token.
COMMANDED = None


class Stops:
    """The held jobs asked to stop, each with its stop mark (or COMMANDED), and the run in flight,
    which is stopped once every job in it is rightly asked. Written by the heartbeat thread, read by
    the main thread, which alone knows each job's proof (checked: ``applies``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._marks: dict[str, bytes | None] = {}
        self._run: tuple[dict[str, bytes | None], Any] | None = None  # its jobs' proofs and RunOptions
        self._stopped_run = False
        self._refused: set[str] = set()  # jobs whose mark was said to be no token of theirs

    def request(self, marks: Mapping[str, bytes | None], held: Iterable[str]) -> None:
        """Jobs asked to stop, with their marks (COMMANDED: by RQ's command), those of them among
        the ``held`` jobs' ids (the rest are no longer, or never were, this worker's); the jobs no
        longer held are forgotten."""
        held = frozenset(held)
        with self._lock:
            # A job's latest mark replaces the one before (what its hash holds now), but never RQ's
            # command: a mark written after it does not undo it.
            merged = {**marks, **{i: m for i, m in self._marks.items() if m is COMMANDED or i not in marks}}
            self._marks = {i: m for i, m in merged.items() if i in held}
            self._refused &= held
            if self._run is not None and self._all_apply(self._run[0]):
                self._run[1].terminate = True
                self._stopped_run = True

    def requested(self, job_id: str) -> bool:
        """Whether ``job_id`` was asked to stop, rightly or not (for the log)."""
        return job_id in self._marks

    def applies(self, job_id: str, proof: bytes | None) -> bool:
        """Whether ``job_id``, whose request's proof is ``proof``, is to stop: asked by RQ's command,
        or marked with its own stop token (None: a request without a nonce, which no mark stops).
        One lookup when not asked: the main thread asks before each run."""
        if job_id not in self._marks:
            return False
        with self._lock:
            return self._applies(job_id, proof)

    @property
    def any(self) -> bool:
        return bool(self._marks)

    def run_began(self, proofs: Mapping[str, bytes | None], options: Any) -> None:
        """The main thread starts the run of the jobs of ``proofs`` (job id -> its request's proof)
        with ``options`` (onnxruntime.RunOptions)."""
        with self._lock:
            self._run = (dict(proofs), options)
            self._stopped_run = False
            if self._all_apply(self._run[0]):  # asked between the check and now
                options.terminate = True
                self._stopped_run = True

    def run_ended(self) -> bool:
        """The run ended; whether it was stopped here (its jobs fail with JobStopped)."""
        with self._lock:
            self._run = None
            stopped, self._stopped_run = self._stopped_run, False
            return stopped

    def _all_apply(self, proofs: Mapping[str, bytes | None]) -> bool:
        return bool(proofs) and all(self._applies(job_id, proof) for job_id, proof in proofs.items())

    def _applies(self, job_id: str, proof: bytes | None) -> bool:
        """``applies``, under the lock; a mark that is not the job's token is said once."""
        if job_id not in self._marks:
            return False
        mark = self._marks[job_id]
        if mark is None:  # COMMANDED
            return True
        if proof is not None and hmac.compare_digest(mark, redisfunctions.stop_token(proof)):
            return True
        if job_id not in self._refused:
            self._refused.add(job_id)
            log.warning(
                "job %s has a stop mark that is not its stop token (written by someone but its producer): "
                "ignored, the job runs",
                job_id,
            )
        return False

"""Keeping a pool's worker processes running: start each, relay its output, restart it by
ortq.pool.restart's policy, and stop them all on request.

Each worker is its own fresh interpreter (``sys.executable -m ortq worker ...`` through
subprocess, never fork: a forked ONNX Runtime or CUDA/DirectML state is not usable), in its own
process group, so that a terminal's Ctrl+C reaches only the pool, which then asks each worker
exactly once: RQ takes a second signal more than a second after the first as "stop now", which
abandons the running job. The stop request is SIGTERM on POSIX; on Windows it is RQ's shutdown
command through Redis (a service has no console), else CTRL_BREAK_EVENT (the worker's SIGBREAK
handler); what has not exited after the grace period is killed.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

from ortq.pool.config import RestartPolicy
from ortq.pool.follow import FOLLOW_SECONDS, Follower, QueueReader, SlotState, SlotView
from ortq.pool.plan import WorkerSlot, worker_environment
from ortq.pool.restart import Action, Decision, ExitHistory, decide, describe_exit
from ortq.pool.status import PoolStatus, Publisher, WorkerNow

log = logging.getLogger("ortq.pool")

#: How often the pool looks at its workers (exits, due restarts, a stop request).
POLL_SECONDS = 0.2


@dataclass(frozen=True)
class ExitRecord:
    """One worker exit and what the pool decided about it."""

    label: str
    pid: int
    code: int
    uptime: float
    decision: Decision


@dataclass
class _Stopped:
    """What became of the workers the pool stopped: for its last line and its exit status."""

    clean_exits: int = 0
    killed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """Every worker exited 0 by itself."""
        return not self.killed and not self.failed

    def describe(self) -> str:
        """``2 workers stopped cleanly``, and which were killed or exited non-zero."""
        parts = [f"{self.clean_exits} worker{'' if self.clean_exits == 1 else 's'} stopped cleanly"]
        if self.killed:
            parts.append(f"killed {', '.join(self.killed)}")
        if self.failed:
            parts.append(f"exited non-zero: {', '.join(self.failed)}")
        return ", ".join(parts)


@dataclass
class _Worker:
    """One slot's running state."""

    slot: WorkerSlot
    process: subprocess.Popen[bytes] | None = None
    name: str = ""
    started_at: float = 0.0
    starts: int = 0
    history: ExitHistory = field(default_factory=ExitHistory)
    #: Monotonic time of the next start; None: never again (finished, given up, or stopping).
    next_start: float | None = 0.0
    relay: threading.Thread | None = None
    #: An elastic slot runs only while the follower wants it (a fixed one always).
    wanted: bool = True
    #: Why the follower stopped it: its exit is then no crash, and it is not restarted.
    stopped_for: str | None = None
    given_up: bool = False


class Supervisor:
    """Runs ``slots`` until :meth:`request_stop`, or until no slot has anything left to run."""

    def __init__(
        self,
        slots: Sequence[WorkerSlot],
        policy: RestartPolicy,
        grace_seconds: float,
        log_dir: Path | None = None,
        output: TextIO | None = None,
        send_shutdown: Callable[[str, str | None], None] | None = None,
        queues: QueueReader | None = None,
        publisher: Publisher | None = None,
    ) -> None:
        #: Asks the worker of that name to stop through its Redis (RQ's shutdown command; the URL is
        #: its slot's, None for the pool's); used on Windows, where a pool running as a service has
        #: no console to send CTRL_BREAK_EVENT with.
        self.send_shutdown = send_shutdown
        self.policy = policy
        self.grace_seconds = grace_seconds
        self.log_dir = log_dir
        self.output = output
        self.exits: list[ExitRecord] = []
        self._workers = [_Worker(slot) for slot in slots]
        #: Elastic slots start when the follower wants them (its first look starts each group's
        #: min_workers); it reads the queues through ``queues``.
        for worker in self._workers:
            if worker.slot.elastic is not None:
                worker.wanted, worker.next_start = False, None
        #: The elastic slots' workers, each with what the follower knows of its group.
        self._elastic = [(w, w.slot.elastic) for w in self._workers if w.slot.elastic is not None]
        if self._elastic and queues is None:
            raise ValueError("elastic slots need a QueueReader")
        self._queues = queues
        self._follower = Follower()
        self._followed_at = -FOLLOW_SECONDS
        #: The pool's record for ortq info and the exporter (ortq.pool.status), and the workers
        #: whose model load it has counted.
        self._publisher = publisher
        self._status = PoolStatus(publisher.name if publisher else "")
        self._loaded: set[str] = set()
        self._reasons: dict[int, str] = {}  # slot number -> why it was last started or stopped
        self._host = socket.gethostname()
        # Plain flags, not an Event: request_stop runs in a signal handler, which must not take a
        # lock the interrupted main thread may hold.
        self._stopping = False
        self._force = False
        self._why = "stop requested"
        self._output_lock = threading.Lock()

    # ------------------------------------------------------------------ control

    def request_stop(self, why: str = "stop requested") -> None:
        """Stop every worker (a second request: kill them now). Safe to call from a signal handler."""
        if self._stopping:
            self._force = True
        self._stopping = True
        self._why = why

    def pids(self) -> dict[str, int]:
        """Label -> pid of every worker now running."""
        return {w.slot.label: w.process.pid for w in self._workers if w.process is not None}

    def run(self) -> int:
        """Supervise until stopped; returns the pool's exit status (docs/pool.md), which its last
        log line gives with what stopped."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._supervise()
        finally:
            stopped = self._shutdown()
            if self._publisher is not None:
                self._publisher.withdraw()
        if self._stopping:
            status = 0 if stopped.clean else 1
            log.log(logging.INFO if stopped.clean else logging.WARNING,
                    "pool stopped (%s): %s; exit status %d", self._why, stopped.describe(), status)  # fmt: skip
            return status
        # Nothing left to run: every worker finished its burst, or the pool gave up on it.
        gave_up = [w.slot.label for w in self._workers if w.history.configuration_errors]
        if gave_up:
            log.error("no workers left to run: gave up on %s; exit status 2", ", ".join(gave_up))
            return 2
        log.info("every worker has finished; exit status 0")
        return 0

    # ------------------------------------------------------------------ the loop

    def _supervise(self) -> None:
        while not self._stopping:
            now = time.monotonic()
            freed = False  # an elastic worker exited: its memory may be what a waiting model needs
            for worker in self._workers:
                if worker.process is not None and (code := worker.process.poll()) is not None:
                    self._exited(worker, code, now)
                    freed |= worker.slot.elastic is not None
            if self._elastic and (freed or now - self._followed_at >= FOLLOW_SECONDS):
                self._followed_at = now
                self._follow(now)
            for worker in self._workers:
                if worker.process is None and worker.next_start is not None and now >= worker.next_start:
                    self._start(worker)
            # A pool that follows its queues waits for jobs even with no worker running.
            if not self._elastic and all(w.process is None and w.next_start is None for w in self._workers):
                return
            time.sleep(POLL_SECONDS)
        log.info("%s: stopping %d workers", self._why, sum(w.process is not None for w in self._workers))

    def _start(self, worker: _Worker) -> None:
        slot = worker.slot
        # A fresh name per start: RQ refuses a name whose previous holder was killed and never unregistered.
        worker.name = f"{slot.label}.{self._host}.{os.getpid()}.{worker.starts}"
        worker.starts += 1
        env = {**worker_environment(os.environ), **dict(slot.env)}
        stdout: Any = subprocess.PIPE
        log_file: IO[bytes] | None = None
        if self.log_dir is not None:
            log_file = open(self.log_dir / f"{slot.label}.log", "ab")  # noqa: SIM115  (the child's from here)
            log_file.write(f"--- ortq pool: starting {worker.name} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
            log_file.flush()
            stdout = log_file
        try:
            worker.process = subprocess.Popen(
                [*slot.argv, "--worker-name", worker.name],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=subprocess.STDOUT,
                **_new_process_group(),
            )
        except OSError as exc:
            log.error("worker %s could not be started: %s", slot.label, exc)
            worker.started_at = time.monotonic()
            self._decided(worker, -1, 0.0, decide(self.policy, worker.history, 1, 0.0, slot.burst))
            return
        finally:
            if log_file is not None:
                log_file.close()
        worker.started_at = time.monotonic()
        worker.next_start = None
        log.info("worker %s started: pid %d, name %s", slot.label, worker.process.pid, worker.name)
        if worker.process.stdout is not None:
            worker.relay = threading.Thread(
                target=self._relay, args=(slot.label, worker.process.stdout), name=f"relay-{slot.label}", daemon=True
            )
            worker.relay.start()

    def _relay(self, label: str, pipe: IO[bytes]) -> None:
        """Copy a worker's output to the pool's, each line prefixed with its label."""
        out = self.output or sys.stderr
        with pipe:
            for raw in iter(pipe.readline, b""):
                # No NULs and no \r: ONNX Runtime writes its warnings as UTF-16 on Windows.
                text = raw.replace(b"\x00", b"").decode("utf-8", errors="replace").rstrip("\r\n")
                with self._output_lock:
                    out.write(f"{label} | {text}\n")
                    out.flush()

    def _exited(self, worker: _Worker, code: int, now: float) -> None:
        assert worker.process is not None
        pid = worker.process.pid
        self._finish_relay(worker)
        uptime = now - worker.started_at
        if worker.stopped_for is not None:  # the follower asked: not restarted, not a crash
            why, worker.stopped_for = worker.stopped_for, None
            reason = f"stopped ({why})"
            self._decided(worker, pid, uptime, Decision(Action.FINISHED, 0.0, reason, worker.history), code)
            return
        self._decided(worker, pid, uptime, decide(self.policy, worker.history, code, uptime, worker.slot.burst), code)

    def _follow(self, now: float) -> None:
        """Start and stop elastic slots as the follower decides from the queues (ortq.pool.follow)."""
        assert self._queues is not None
        running: dict[str, list[str]] = {}
        views = []
        for worker, spec in self._elastic:
            names = running.setdefault(spec.model, [])
            if worker.process is not None and worker.wanted:
                state = SlotState.RUNNING
                names.append(worker.name)
            elif worker.process is not None:
                state = SlotState.STOPPING
            elif worker.wanted and worker.next_start is not None:  # a restart due (backoff)
                state = SlotState.RUNNING
            else:
                state = SlotState.OFF
            views.append(SlotView(worker.slot.number, spec, state, worker.started_at, worker.name, worker.given_up))
        by_number = {w.slot.number: (w, spec) for w, spec in self._elastic}
        for action in self._follower.decide(now, views, self._queues.read(running)):
            worker, spec = by_number[action.number]
            cold = not running[spec.model]
            self._status.acted(action.start, worker.slot.label, spec.model, action.why, cold, action.evicts)
            self._reasons[action.number] = action.why
            if action.start:
                worker.wanted, worker.next_start = True, now
                log.info("starting a worker %s: %s", worker.slot.label, action.why)
                continue
            worker.wanted, worker.next_start = False, None
            if worker.process is not None:
                worker.stopped_for = action.why
                log.info("stopping worker %s (pid %d): %s", worker.slot.label, worker.process.pid, action.why)
                self._send_stop(worker)
        if self._publisher is not None:
            self._publisher.publish(self._record())

    def _record(self) -> dict[str, Any]:
        """The pool's record now (ortq.pool.status), with the model loads seen since the last."""
        ready_at = self._follower.ready_at
        budgets: dict[str, int | None] = {}
        now: list[WorkerNow] = []
        for worker, spec in self._elastic:
            budgets[spec.adapter] = spec.budget_bytes
            if worker.process is None:
                continue
            if worker.name in ready_at and worker.name not in self._loaded:
                self._loaded.add(worker.name)
                self._status.loaded(spec.model, ready_at[worker.name] - worker.started_at)
            state = "stopping" if not worker.wanted else "serving" if worker.name in ready_at else "loading"
            why = self._reasons.get(worker.slot.number, "")
            now.append(WorkerNow(worker.slot.label, spec.model, spec.adapter, state, spec.worker_bytes, why))
        return self._status.record(budgets, now)

    def _decided(self, worker: _Worker, pid: int, uptime: float, decision: Decision, code: int = 1) -> None:
        worker.process = None
        worker.history = decision.history
        self.exits.append(ExitRecord(worker.slot.label, pid, code, uptime, decision))
        what = f"worker {worker.slot.label} (pid {pid}) {describe_exit(code)} after {uptime:.1f} s: {decision.reason}"
        if decision.action is Action.FINISHED:
            worker.next_start = None
            log.info("%s; not restarted", what)
        elif decision.action is Action.GIVE_UP:
            worker.next_start, worker.given_up = None, True
            log.error("%s. GIVING UP on this worker; the others keep running", what)
        else:
            worker.next_start = time.monotonic() + decision.delay
            level = logging.ERROR if code == 2 else logging.WARNING
            when = "at once" if decision.delay == 0 else f"in {decision.delay:g} s"
            log.log(level, "%s; restarting %s", what, when)

    def _finish_relay(self, worker: _Worker) -> None:
        if worker.relay is not None:
            worker.relay.join(5)  # the pipe ends with the process; what it still holds is its last words
            worker.relay = None

    # ------------------------------------------------------------------ stopping

    def _shutdown(self) -> _Stopped:
        """Ask every running worker to stop, wait until they have exited (up to the grace period),
        kill the rest; what became of them."""
        running = [w for w in self._workers if w.process is not None and w.process.poll() is None]
        for worker in self._workers:
            worker.next_start = None
        for worker in running:
            self._send_stop(worker)
        self._wait_exited(running, time.monotonic() + self.grace_seconds)
        stopped = _Stopped()
        for worker in self._workers:
            if worker.process is not None:
                self._reap(worker, stopped)
        return stopped

    def _reap(self, worker: _Worker, stopped: _Stopped) -> None:
        """Kill ``worker`` if it still runs, take its last output, and note in ``stopped`` (and the
        log) how it ended."""
        process = worker.process
        assert process is not None
        worker.process = None
        if process.poll() is None:
            why = "a second stop request" if self._force else f"the {self.grace_seconds:g} s grace period"
            log.warning("worker %s (pid %d) still running after %s: killing it", worker.slot.label, process.pid, why)
            process.kill()
            process.wait()
            self._finish_relay(worker)
            stopped.killed.append(worker.slot.label)
            return
        self._finish_relay(worker)  # its last words come before the pool's note of its exit
        if process.returncode != 0:
            log.warning("worker %s (pid %d) %s while stopping", worker.slot.label, process.pid,
                        describe_exit(process.returncode))  # fmt: skip
            stopped.failed.append(worker.slot.label)
        else:
            log.info("worker %s (pid %d) stopped", worker.slot.label, process.pid)
            stopped.clean_exits += 1

    def _wait_exited(self, workers: Sequence[_Worker], deadline: float) -> None:
        """Return as soon as every one of ``workers`` has exited, at ``deadline``, or on a second
        stop request. Each wait is on the process itself (Popen.wait looks every few ms), not a
        sleep of POLL_SECONDS: the pool exits right after its last worker does."""
        for worker in workers:
            process = worker.process
            assert process is not None
            while not self._force:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                try:
                    # In slices, so that a second stop request (a flag set by the signal handler) is seen.
                    process.wait(min(remaining, POLL_SECONDS))
                    break
                except subprocess.TimeoutExpired:
                    continue

    def _send_stop(self, worker: _Worker) -> None:
        assert worker.process is not None
        if sys.platform != "win32":
            worker.process.send_signal(signal.SIGTERM)
            return
        if self.send_shutdown is not None:
            try:
                self.send_shutdown(worker.name, worker.slot.redis_url)
                return
            except Exception as exc:  # Redis unreachable: fall back to the console event
                log.warning("could not send worker %s a shutdown command (%s)", worker.slot.label, exc)
        try:
            # The worker is its own process group (CREATE_NEW_PROCESS_GROUP): the event goes to it alone.
            os.kill(worker.process.pid, signal.CTRL_BREAK_EVENT)
        except OSError as exc:
            # No console to carry the event (a service without one; Wine): waiting cannot help.
            log.warning("could not send CTRL_BREAK_EVENT to worker %s (%s): terminating it", worker.slot.label, exc)
            worker.process.kill()


def _new_process_group() -> dict[str, Any]:
    """Popen arguments that start the child in a process group of its own."""
    if sys.platform == "win32":
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
    return {"process_group": 0}

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
from ortq.pool.plan import WorkerSlot, worker_environment
from ortq.pool.restart import Action, Decision, ExitHistory, decide, describe_exit

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
        """Supervise until stopped; returns the pool's exit status (docs/pool.md)."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._supervise()
        finally:
            clean = self._shutdown()
        if self._stopping:
            return 0 if clean else 1
        # Nothing left to run: every worker finished its burst, or the pool gave up on it.
        gave_up = [w.slot.label for w in self._workers if w.history.configuration_errors]
        if gave_up:
            log.error("no workers left to run: gave up on %s", ", ".join(gave_up))
            return 2
        log.info("every worker has finished")
        return 0

    # ------------------------------------------------------------------ the loop

    def _supervise(self) -> None:
        while not self._stopping:
            now = time.monotonic()
            for worker in self._workers:
                if worker.process is not None and (code := worker.process.poll()) is not None:
                    self._exited(worker, code, now)
                if worker.process is None and worker.next_start is not None and now >= worker.next_start:
                    self._start(worker)
            if all(w.process is None and w.next_start is None for w in self._workers):
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
        self._decided(worker, pid, uptime, decide(self.policy, worker.history, code, uptime, worker.slot.burst), code)

    def _decided(self, worker: _Worker, pid: int, uptime: float, decision: Decision, code: int = 1) -> None:
        worker.process = None
        worker.history = decision.history
        self.exits.append(ExitRecord(worker.slot.label, pid, code, uptime, decision))
        what = f"worker {worker.slot.label} (pid {pid}) {describe_exit(code)} after {uptime:.1f} s: {decision.reason}"
        if decision.action is Action.FINISHED:
            worker.next_start = None
            log.info("%s; not restarted", what)
        elif decision.action is Action.GIVE_UP:
            worker.next_start = None
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

    def _shutdown(self) -> bool:
        """Ask every running worker to stop, wait up to the grace period, kill the rest; True when
        all of them exited 0 by themselves."""
        running = [w for w in self._workers if w.process is not None and w.process.poll() is None]
        for worker in self._workers:
            worker.next_start = None
        for worker in running:
            self._send_stop(worker)
        deadline = time.monotonic() + self.grace_seconds
        while not self._force and time.monotonic() < deadline:
            if all(w.process is None or w.process.poll() is not None for w in running):
                break
            time.sleep(POLL_SECONDS)
        clean = True
        for worker in self._workers:
            process = worker.process
            if process is None:
                continue
            if process.poll() is None:
                why = "a second stop request" if self._force else f"the {self.grace_seconds:g} s grace period"
                log.warning("worker %s (pid %d) still running after %s: killing it", worker.slot.label,
                            process.pid, why)  # fmt: skip
                process.kill()
                process.wait()
                clean = False
            elif process.returncode != 0:
                log.warning("worker %s (pid %d) %s while stopping", worker.slot.label, process.pid,
                            describe_exit(process.returncode))  # fmt: skip
                clean = False
            else:
                log.info("worker %s (pid %d) stopped", worker.slot.label, process.pid)
            self._finish_relay(worker)
            worker.process = None
        return clean

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

"""Stop signals seen at once, even while the main thread is inside ``session.run``.

Python runs a signal handler only when the main thread next runs Python bytecode: a worker whose
main thread is in a long ``Run`` (native code) would not see SIGTERM until the run ends, and
Kubernetes, which sends SIGTERM and stops routing once /ready says 503, would keep it in service
meanwhile. So the handlers here do nothing themselves; what counts is that one is installed: the
interpreter's C-level handler then writes the signal's number to the wakeup socket
(``signal.set_wakeup_fd``) at once, in whichever thread the signal arrives (on Windows, the thread
the system starts for a console event), and a thread of ours reads it and calls ``on_signal``.
A socket pair, not a pipe: on Windows the wakeup descriptor must be a socket.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable

log = logging.getLogger("ortq.worker")

#: The signals that ask a worker to stop (SIGBREAK: CTRL_BREAK_EVENT on Windows).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGBREAK") if hasattr(signal, name))


def handled_by_the_watch(signum: int, frame: object) -> None:
    """The Python-level handler of a stop signal: nothing; the watch thread acts on it (see the
    module's doc)."""


class StopSignals:
    """Calls ``on_signal(signum)`` on its own thread as soon as a stop signal arrives. Installed from
    the main thread (only it may set handlers and the wakeup descriptor)."""

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)  # the C-level handler must never block writing to it
        self._thread = threading.Thread(target=self._watch, name="ortq-signals", daemon=True)

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, handled_by_the_watch)
        signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            try:
                received = self._reader.recv(64)
            except OSError:
                return
            if not received:
                return
            for signum in received:
                if signum in STOP_SIGNALS:
                    try:
                        self._on_signal(signum)
                    except Exception:  # the watch goes on: a later signal must still be seen
                        log.exception("handling signal %d failed", signum)

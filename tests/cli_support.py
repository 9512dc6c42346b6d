"""``ortq`` commands run in the test's own process (issue 28: each ``python -m ortq`` costs 1-2 s of
interpreter start and imports on the CI VM), as ``python -m ortq`` would run them.

``invoke("info", "--redis-url", url)`` runs what ``python -m ortq`` runs, ``ortq.cli.run`` (click's
``main`` with every error made one line and an exit status), under click's ``CliRunner``, and
returns the exit status, stdout and stderr the process would have had:

- an exception that ``run`` lets escape is a traceback on stderr and exit status 1, as the
  interpreter prints it (``Result.exception``, not a SystemExit; ``Result.no_traceback()``);
- logging is configured afresh by the command (``ortq.cli.main``'s ``basicConfig``, on stderr), not
  swallowed by pytest's handlers: the log lines a process would print are in ``stderr``;
- warnings are shown as the interpreter's default filters show them (pytest records them instead);
- what is written to file descriptors 1 and 2 below Python (ONNX Runtime's own log, child
  processes) is captured too, after what Python wrote;
- the working directory is the repository's (the subprocesses ran with ``cwd=REPO``), and
  ``os.environ``, the root logger and the stop signals' handlers are put back afterwards.

What needs a process of its own stays ``python -m ortq``: a worker or pool that serves and is
stopped, signals, the real interpreter's exit status and tracebacks (checked at least once per kind
of error), variables read at start-up, and anything that loads an ONNX Runtime session or library
into the process.

``env`` overrides variables (``None`` removes one) for the command's duration. Works with click 8.1
(``CliRunner(mix_stderr=False)`` keeps stderr apart) and 8.2+ (always apart, no ``mix_stderr``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import click
from click.testing import CliRunner

from ortq.cli import run

REPO = Path(__file__).resolve().parent.parent

#: The stop signals a command could take over (a worker's or pool's handlers): put back after each.
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGBREAK") if hasattr(signal, name))


@dataclass(frozen=True)
class Result:
    """What ``python -m ortq ARGS`` would have ended with."""

    exit_code: int
    stdout: str
    stderr: str
    #: click's: the SystemExit of a non-zero status, or the exception that escaped ``ortq.cli.run``
    #: (whose traceback the interpreter would have printed: it is in ``stderr``), else None.
    exception: BaseException | None

    @property
    def returncode(self) -> int:
        """subprocess.CompletedProcess's name for ``exit_code``."""
        return self.exit_code

    def no_traceback(self) -> bool:
        """True unless an exception escaped ``ortq.cli.run`` (a traceback, from a process)."""
        return self.exception is None or isinstance(self.exception, SystemExit)


class _EntryPoint(click.Command):
    """``ortq.cli.run``, what ``python -m ortq`` runs, as a command ``CliRunner.invoke`` calls."""

    def main(self, args: Any = None, prog_name: str | None = None, **extra: Any) -> Any:
        try:
            with mock.patch.object(sys, "argv", ["ortq", *(args or ())]):
                run()  # reads sys.argv, as under python -m ortq
        finally:  # as the interpreter does at exit (click 8.1's runner does not flush stderr)
            sys.stdout.flush()
            sys.stderr.flush()


_ENTRY_POINT = _EntryPoint("ortq")


def _runner() -> CliRunner:
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:  # click < 8.2
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    return CliRunner()  # click >= 8.2: stderr is always apart


def invoke(*args: str, env: Mapping[str, str | None] | None = None, input: str | None = None) -> Result:
    """``python -m ortq ARGS`` in this process (see the module's docstring)."""
    with (
        contextlib.chdir(REPO),
        _state_put_back(),
        _fresh_root_logger(),
        _interpreter_warnings(),
        _captured_fds() as below_python,
    ):
        done = _runner().invoke(_ENTRY_POINT, list(args), input=input, env=env, catch_exceptions=True)
    stderr = done.stderr + below_python.get("stderr", "")
    if done.exception is not None and not isinstance(done.exception, SystemExit) and done.exc_info is not None:
        stderr += "".join(traceback.format_exception(*done.exc_info))  # as the interpreter prints it
    return Result(done.exit_code, done.stdout + below_python.get("stdout", ""), stderr, done.exception)


@contextlib.contextmanager
def _state_put_back() -> Iterator[None]:
    """os.environ and the stop signals' handlers as they were (a command may set either: a worker
    sets CUDA_DEVICE_ORDER, a serving one installs handlers)."""
    environ = dict(os.environ)
    main_thread = threading.current_thread() is threading.main_thread()
    handlers = {signum: signal.getsignal(signum) for signum in _SIGNALS} if main_thread else {}
    try:
        yield
    finally:
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)
        for signum, handler in handlers.items():
            if signal.getsignal(signum) is not handler and handler is not None:
                signal.signal(signum, handler)


@contextlib.contextmanager
def _fresh_root_logger() -> Iterator[None]:
    """A root logger without handlers, as in a new process: ``ortq.cli.main``'s basicConfig then
    logs to the command's stderr. pytest's handlers and the level are put back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    for handler in handlers:
        root.removeHandler(handler)
    try:
        yield
    finally:
        for handler in root.handlers[:]:  # basicConfig's, on the runner's stderr (gone now)
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


def _show_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def _interpreter_warnings() -> Iterator[None]:
    """The interpreter's default warning filters (no -W), shown on stderr."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        warnings.showwarning = _show_warning
        yield


@contextlib.contextmanager
def _captured_fds() -> Iterator[dict[str, str]]:
    """Whatever reaches file descriptors 1 and 2 meanwhile (not Python's sys.stdout/stderr, which
    the runner replaces): ONNX Runtime's C++ log, the output of child processes."""
    captured: dict[str, str] = {}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        spools = {"stdout": (1, out), "stderr": (2, err)}
        saved: dict[str, int] = {}
        try:
            for name, (fd, spool) in spools.items():
                saved[name] = os.dup(fd)
                os.dup2(spool.fileno(), fd)
            yield captured
        finally:
            for name, original in saved.items():
                fd, spool = spools[name]
                os.dup2(original, fd)
                os.close(original)
                spool.seek(0)
                captured[name] = spool.read().decode("utf-8", "replace").replace("\r\n", "\n")

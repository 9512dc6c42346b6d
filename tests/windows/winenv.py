"""Running Windows CPython under Wine from the Linux side (the environment tests/windows/setup.sh builds).

    env = WineEnvironment.find()            # None when setup.sh has not run (missing_reason() says why)
    with WineSession(env, log_dir) as wine:  # starts Xvfb and a wineserver for env's prefix
        done = wine.run(["-c", "import sys; print(sys.platform)"], timeout=120)
        worker = wine.start(["-m", "ortq", "worker", ...], name="worker")
        worker.wait_for("serving model", timeout=60)
    # leaving the block stops every process it started, by PID, then `wineserver -k` for its prefix

Facts this encodes (tests/windows/README.md has the list):

* Windows CPython's stdout/stderr must be pipes: with Wine 8.0 a regular file as a std handle makes
  CPython die in ``init_sys_streams`` ("[WinError 6]"). The shell recipe is ``wine python.exe ... 2>&1 |
  tr -d '\\r'``; here the pipe is read by a thread that drops the ``\\r`` and writes the log file.
* DXGI needs a display, else DirectML is silently not there: an Xvfb per session (or ORTQ_WINE_DISPLAY).
* Wine's Direct3D must run on Vulkan (vkd3d -> lavapipe): set in the prefix's registry by setup.sh and
  here again as ``WINE_D3D_CONFIG``.
* Wine maps ``/`` to drive ``Z:``: the checkout goes on the Windows PYTHONPATH as ``Z:\\...``, so the
  code under test is the working tree, never an installed copy.
* A Linux SIGINT sent to a Wine process arrives as CTRL_C_EVENT (Wine's signal handler runs the
  process's console control handlers). GenerateConsoleCtrlEvent in Wine 8 delivers CTRL_C_EVENT only,
  and only inside a real console; :data:`LAUNCHER` delivers CTRL_BREAK_EVENT the way Windows' console
  host does, by starting ``kernelbase!CtrlRoutine`` in the target process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

#: Where setup.sh builds the environment unless ORTQ_WINE_ROOT says otherwise.
DEFAULT_ROOT = Path("/var/cache/ortq-wine")
#: The checkout this file belongs to; it goes on the Windows PYTHONPATH.
REPO = Path(__file__).resolve().parents[2]
#: The recipe version of setup.sh this helper understands.
RECIPE = 1

#: Variables of the Linux environment that must not reach the Windows python.
_DROPPED = re.compile(r"^(PYTHON\w*|VIRTUAL_ENV|PIP_\w+|CONDA\w*|LD_PRELOAD)$")


def wine_root() -> Path:
    """The cache directory setup.sh builds: ``$ORTQ_WINE_ROOT`` or :data:`DEFAULT_ROOT`."""
    return Path(os.environ.get("ORTQ_WINE_ROOT") or DEFAULT_ROOT)


def windows_path(path: Path | str) -> str:
    """The Windows name of a Linux path, through Wine's ``Z:`` drive (which maps ``/``)."""
    posix = PurePosixPath(os.path.abspath(path))
    return "Z:" + str(posix).replace("/", "\\")


@dataclass(frozen=True)
class WineEnvironment:
    """A finished setup.sh build: a Wine prefix with Windows CPython and ortq's deps."""

    root: Path
    prefix: Path
    python_dir: Path
    ready: Mapping[str, Any]

    @property
    def python_exe(self) -> Path:
        return self.python_dir / "python.exe"

    @property
    def versions(self) -> Mapping[str, str]:
        """Distribution name -> version of the Windows site-packages."""
        versions: Mapping[str, str] = self.ready.get("versions", {})
        return versions

    @staticmethod
    def missing_reason(root: Path | None = None) -> str | None:
        """Why there is no usable environment under ``root``, or None when there is one."""
        root = root or wine_root()
        ready_file = root / "ready.json"
        if not ready_file.is_file():
            return f"no Wine environment: {ready_file} is missing (run: bash tests/windows/setup.sh)"
        try:
            ready = json.loads(ready_file.read_text())
        except (OSError, ValueError) as exc:
            return f"{ready_file} is unreadable ({exc}); run bash tests/windows/setup.sh again"
        if ready.get("recipe") != RECIPE:
            return f"{ready_file} is from setup.sh recipe {ready.get('recipe')}, expected {RECIPE}: run setup.sh again"
        python = Path(ready.get("python_dir", "")) / "python.exe"
        if not python.is_file():
            return f"{python} is missing; run bash tests/windows/setup.sh again"
        for tool in ("wine", "wineserver", "Xvfb"):
            if shutil.which(tool) is None:
                return f"{tool} is not on PATH; run bash tests/windows/setup.sh"
        return None

    @classmethod
    def find(cls, root: Path | None = None) -> WineEnvironment | None:
        """The environment under ``root`` (default :func:`wine_root`), or None if it is not usable."""
        root = root or wine_root()
        if cls.missing_reason(root) is not None:
            return None
        ready = json.loads((root / "ready.json").read_text())
        return cls(root=root, prefix=Path(ready["prefix"]), python_dir=Path(ready["python_dir"]), ready=ready)


class OutputPump:
    """Reads a process's combined stdout/stderr pipe until EOF: drops ``\\r``, appends to a log file
    and keeps the text for :meth:`wait_for` (the ``| tr -d '\\r'`` of the shell recipe)."""

    def __init__(self, pipe: Any, log_path: Path) -> None:
        self.log_path = log_path
        self._pipe = pipe
        self._chunks: list[str] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._pump, name=f"pump-{log_path.name}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        with open(self.log_path, "ab") as log:
            fd = self._pipe.fileno()
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    break
                # No \r; and no NULs: onnxruntime writes its warnings to stderr as UTF-16.
                data = data.replace(b"\r", b"").replace(b"\x00", b"")
                log.write(data)
                log.flush()
                with self._cond:
                    self._chunks.append(data.decode("utf-8", errors="replace"))
                    self._cond.notify_all()
        self._pipe.close()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def text(self) -> str:
        with self._cond:
            return "".join(self._chunks)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str] | None:
        """The first match of regex ``pattern`` in the output, waiting up to ``timeout`` s; None if the
        output ended or the time passed without one."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        with self._cond:
            while True:
                found = regex.search("".join(self._chunks))
                if found or self._closed:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.5))

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


@dataclass
class WindowsProcess:
    """One ``wine python.exe ...`` process. Its PID is the Linux PID of the Windows process itself
    (``wine`` execs the program), so Linux signals reach it."""

    name: str
    args: list[str]
    popen: subprocess.Popen[bytes]
    output: OutputPump
    #: For processes started through LAUNCHER: the file it reads its commands from.
    control_path: Path | None = None
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def log_path(self) -> Path:
        return self.output.log_path

    def text(self) -> str:
        return self.output.text()

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float) -> int:
        """Exit status, waiting up to ``timeout`` s (subprocess.TimeoutExpired after that)."""
        code = self.popen.wait(timeout)
        self.output.join(1)
        return code

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first match of ``pattern`` in the output; AssertionError (with the log) if none comes."""
        found = self.output.wait_for(pattern, timeout)
        if found is None:
            code = self.poll()
            state = f"exited with {code}" if code is not None else "still running"
            raise AssertionError(f"{self.name}: no {pattern!r} after {timeout} s ({state}); output:\n{self.text()}")
        return found

    def send_line(self, line: str) -> None:
        """Give a LAUNCHER process one command (appended to its control file).

        Not through stdin: under Wine (as on Windows) a thread blocked reading a synchronous pipe
        blocks the process's other calls on that handle, and Python's start-up and imports make some.
        """
        assert self.control_path is not None, f"{self.name} was not started through the launcher"
        with open(self.control_path, "a") as control:
            control.write(line + "\n")

    def send_sigint(self) -> None:
        """Linux SIGINT, which Wine delivers as CTRL_C_EVENT to the Windows process."""
        self.popen.send_signal(signal.SIGINT)

    def stop(self, grace: float = 5.0) -> int:
        """SIGTERM (Wine terminates the process), then SIGKILL after ``grace`` s; returns the status.
        A launcher is first told to kill its child, so that no worker outlives its test."""
        if self.control_path is not None and self.popen.poll() is None:
            self.send_line("kill")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(grace)
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                # A killed wine always ends, but on a loaded machine (the suite beside stress-ng
                # --cpu 2) it took over 30 s: a bound on a hang only (tests/conftest.py's
                # PROCESS_SAFETY_SECONDS), not a timing.
                self.popen.wait(REAP_SAFETY_SECONDS)
        self.output.join(1)
        return self.popen.returncode


#: How long a killed wine process may take to be reaped before that counts as a hang.
REAP_SAFETY_SECONDS = 240.0


@dataclass(frozen=True)
class Completed:
    """What :meth:`WineSession.run` returns."""

    args: list[str]
    returncode: int
    output: str

    def check(self) -> Completed:
        if self.returncode != 0:
            raise AssertionError(f"windows python {self.args} exited with {self.returncode}:\n{self.output}")
        return self


class WineSession:
    """Xvfb + a persistent wineserver for one prefix, and the Windows python processes started in it.

    Everything it starts is stopped by :meth:`close` (and on leaving a ``with`` block): its python
    processes by PID, then ``wineserver -k`` (which ends whatever else runs in its prefix: the
    launcher's children, winedevice.exe, ...), then its Xvfb by PID.
    """

    def __init__(
        self,
        env: WineEnvironment,
        log_dir: Path,
        pythonpath: Iterable[Path] = (REPO,),
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.env = env
        self.log_dir = log_dir
        self.pythonpath = [Path(p) for p in pythonpath]
        self.extra_env = dict(extra_env or {})
        self.display: str | None = None
        self.processes: list[WindowsProcess] = []
        self._xvfb: subprocess.Popen[bytes] | None = None
        self._wineserver: subprocess.Popen[bytes] | None = None
        self._count = 0
        self._lock: Any = None
        log_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ start and stop

    def __enter__(self) -> WineSession:
        self.start_services()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def start_services(self, timeout: float = 30.0, lock_timeout: float | None = None) -> None:
        """Take the prefix (waiting up to ``lock_timeout`` s, default $ORTQ_WINE_LOCK_TIMEOUT or 180,
        for another session or setup.sh to let go of it), start (or reuse, with ORTQ_WINE_DISPLAY) the
        X display, a wineserver for the prefix, and Wine's own services."""
        if lock_timeout is None:
            lock_timeout = float(os.environ.get("ORTQ_WINE_LOCK_TIMEOUT", "180"))
        try:
            self._lock_prefix(lock_timeout)
            self._start_display(timeout)
            self._start_wineserver()
            self._start_wine_services()
        except BaseException:
            self.close()
            raise

    def _lock_prefix(self, timeout: float) -> None:
        # One wineserver per prefix, and `wineserver -k` ends all of its processes: two sessions on one
        # prefix would kill each other's workers. setup.sh takes the same lock.
        self._lock = open(self.env.root / ".lock", "a")  # noqa: SIM115  (held until close)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"another test session or setup.sh has held {self._lock.name} for {timeout:g} s"
                    ) from None
                time.sleep(0.5)
        # Under the lock, a wineserver still running for the prefix is a leftover: end it and its processes.
        subprocess.run(["wineserver", "-k"], env=self.environ(), timeout=30, check=False, capture_output=True)

    def _start_display(self, timeout: float) -> None:
        reuse = os.environ.get("ORTQ_WINE_DISPLAY")
        if reuse:
            self.display = reuse
            return
        # -displayfd: Xvfb picks a free display number itself and writes it to the pipe once it is ready.
        read_fd, write_fd = os.pipe()
        try:
            self._xvfb = subprocess.Popen(
                ["Xvfb", "-displayfd", str(write_fd), "-screen", "0", "1024x768x24", "-nolisten", "tcp", "-noreset"],
                stdin=subprocess.DEVNULL,
                stdout=open(self.log_dir / "xvfb.log", "wb"),  # noqa: SIM115  (closed with the process)
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        finally:
            os.close(write_fd)
        deadline = time.monotonic() + timeout
        number = b""
        with os.fdopen(read_fd, "rb", buffering=0) as reader:
            os.set_blocking(reader.fileno(), False)
            while not number.endswith(b"\n"):
                if self._xvfb.poll() is not None:
                    raise RuntimeError(f"Xvfb exited with {self._xvfb.returncode}: {self._read('xvfb.log')}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Xvfb did not report a display within {timeout} s")
                try:
                    number += reader.read(16) or b""
                except BlockingIOError:
                    time.sleep(0.05)
        self.display = ":" + number.decode().strip()

    def _start_wineserver(self) -> None:
        # A persistent server for the session: every `wine` start then skips the server's start-up.
        self._wineserver = subprocess.Popen(
            ["wineserver", "--foreground", "--persistent"],
            env=self.environ(),
            stdin=subprocess.DEVNULL,
            stdout=open(self.log_dir / "wineserver.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _start_wine_services(self) -> None:
        # Wine starts services.exe, winedevice.exe, explorer.exe /desktop ... from the first process
        # that needs them, and they inherit its stdout: that pipe would then never reach EOF. So the
        # first process is this throwaway one (its output pump just stays open until close()).
        warm = self.start(["-c", "import ctypes; ctypes.windll.user32.GetDesktopWindow(); print('ok')"], name="warm-up")
        try:
            warm.popen.wait(120)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"Wine's first process did not finish within 120 s:\n{warm.text()}") from None
        if warm.popen.returncode != 0:
            raise RuntimeError(f"Wine's first process exited with {warm.popen.returncode}:\n{warm.text()}")

    def close(self) -> None:
        """Stop everything this session started (by PID), then the prefix's wineserver, then Xvfb,
        then let go of the prefix."""
        for process in self.processes:
            with contextlib.suppress(Exception):  # keep stopping the others
                process.stop(grace=3)
        env = self.environ()
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            subprocess.run(["wineserver", "-k"], env=env, timeout=30, check=False, capture_output=True)
        for service in (self._wineserver, self._xvfb):
            if service is None or service.poll() is not None:
                continue
            service.terminate()
            try:
                service.wait(10)
            except subprocess.TimeoutExpired:
                service.kill()
                service.wait(10)
        self._wineserver = self._xvfb = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    # ------------------------------------------------------------------ running Windows python

    def environ(self) -> dict[str, str]:
        """The Linux environment for ``wine``: Wine's settings plus what the Windows python sees."""
        env = {k: v for k, v in os.environ.items() if not _DROPPED.match(k)}
        env.update(
            WINEPREFIX=str(self.env.prefix),
            WINEARCH="win64",
            WINEDEBUG="-all",
            WINEDLLOVERRIDES="mscoree,mshtml,winemenubuilder.exe=d",
            WINE_D3D_CONFIG="renderer=vulkan",
            VKD3D_DEBUG="none",
            VKD3D_SHADER_DEBUG="none",
            XDG_RUNTIME_DIR=str(self.env.root / "xdg"),
            PYTHONPATH=";".join(windows_path(p) for p in self.pythonpath),
            PYTHONUNBUFFERED="1",
            # Compiled files of the checkout go to the cache, not into the working tree.
            PYTHONPYCACHEPREFIX=windows_path(self.env.root / "pycache"),
            PYTHONUTF8="1",
        )
        if self.display:
            env["DISPLAY"] = self.display
        env.update(self.extra_env)
        return env

    def start(
        self,
        args: Sequence[str],
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        control_path: Path | None = None,
    ) -> WindowsProcess:
        """Start ``python.exe ARGS`` (Windows python) in the background; its output goes to a log file."""
        self._count += 1
        name = name or f"python-{self._count}"
        log_path = self.log_dir / f"{self._count:02d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.log"
        popen = subprocess.Popen(
            ["wine", str(self.env.python_exe), *args],
            env={**self.environ(), **(env or {})},
            cwd=self.env.python_dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,  # a pipe, never a file (see the module docstring)
            stderr=subprocess.STDOUT,
        )
        process = WindowsProcess(
            name=name,
            args=list(args),
            popen=popen,
            output=OutputPump(popen.stdout, log_path),
            control_path=control_path,
        )
        self.processes.append(process)
        return process

    def run(self, args: Sequence[str], timeout: float = 120.0, name: str | None = None) -> Completed:
        """Run ``python.exe ARGS`` to completion (killed after ``timeout`` s)."""
        process = self.start(args, name=name)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.stop(grace=2)
            raise AssertionError(f"windows python {list(args)} ran past {timeout} s:\n{process.text()}") from None
        return Completed(list(args), code, process.text())

    def python_json(self, code: str, timeout: float = 120.0) -> Any:
        """Run a snippet that prints one JSON document as its last line; returns it decoded."""
        done = self.run(["-c", code], timeout=timeout).check()
        lines = [line for line in done.output.splitlines() if line.strip()]
        if not lines:
            raise AssertionError(f"snippet printed nothing:\n{code}")
        return json.loads(lines[-1])

    def write_launcher(self) -> Path:
        """Write :data:`LAUNCHER` next to the logs and return its path."""
        path = self.log_dir / "launcher.py"
        if not path.exists():
            path.write_text(LAUNCHER)
        return path

    def start_launched(
        self, args: Sequence[str], mode: str = "child", name: str | None = None, new_group: bool = True
    ) -> WindowsProcess:
        """Start ``python.exe ARGS`` through :data:`LAUNCHER`; the returned process is the launcher,
        and :meth:`WindowsProcess.send_line` gives it its commands (through a control file).

        ``mode="child"``: ARGS runs as a child process (in a new process group unless ``new_group`` is
        False), to which the commands ``ctrl-break`` / ``ctrl-c`` send that console event.
        ``mode="in-process"``: ARGS (``-m MODULE ...`` or ``SCRIPT ...``) runs in the launcher's own
        process, and the commands ``sigbreak`` / ``sigint`` raise that signal through the C runtime.
        """
        if mode not in ("child", "in-process"):
            raise ValueError(f"unknown launcher mode {mode!r}")
        self._count += 1
        control = self.log_dir / f"{self._count:02d}-launcher.ctl"
        control.write_text("")
        options = [f"--{mode}", "--control", windows_path(control), *([] if new_group else ["--same-group"])]
        return self.start([windows_path(self.write_launcher()), *options, "--", *args], name=name, control_path=control)

    def _read(self, log_name: str) -> str:
        try:
            return (self.log_dir / log_name).read_text(errors="replace")
        except OSError:
            return ""


#: A Windows-side launcher,
#: ``python.exe launcher.py (--child [--same-group] | --in-process) --control FILE -- ARGS``.
#: It reads commands, one per line, appended to FILE (not stdin: see WindowsProcess.send_line), and
#: reports on stdout in lines starting ``LAUNCHER``.
#:
#: ``--child``: starts ``python.exe ARGS`` with CREATE_NEW_PROCESS_GROUP (as a service manager does, so
#: that CTRL_BREAK can be aimed at it), prints ``LAUNCHER child-pid=N``; ``ctrl-break`` / ``ctrl-c`` send
#: that console event to the child, ``kill`` terminates it; when the child exits it prints
#: ``LAUNCHER child-exit=N`` and exits with the child's status. The event goes first through
#: ``os.kill(pid, CTRL_BREAK_EVENT)``, i.e. GenerateConsoleCtrlEvent, as on Windows; when that fails
#: (it does under Wine 8), the way Windows' console host itself delivers a console event: a thread
#: started in the child at ``kernelbase!CtrlRoutine(event)``, which runs the child's console handlers.
#:
#: ``--in-process``: runs ARGS (``-m MODULE ...``, ``-c CODE ...`` or ``SCRIPT ...``) in this very process, as
#: ``python.exe ARGS`` would, after starting a thread that takes ``sigbreak`` / ``sigint`` and calls
#: ``signal.raise_signal`` (the C runtime's ``raise``), which runs the handler the program installed.
LAUNCHER = r"""
import ctypes
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from ctypes import wintypes

kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
kernel32.OpenProcess.restype = wintypes.HANDLE
kernel32.OpenProcess.argtypes = (wintypes.DWORD, wintypes.BOOL, wintypes.DWORD)
kernel32.GetModuleHandleW.restype = wintypes.HMODULE
kernel32.GetProcAddress.restype = ctypes.c_void_p
kernel32.GetProcAddress.argtypes = (wintypes.HMODULE, ctypes.c_char_p)
kernel32.CreateRemoteThread.restype = wintypes.HANDLE
kernel32.CreateRemoteThread.argtypes = (wintypes.HANDLE, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                        ctypes.c_void_p, wintypes.DWORD, ctypes.c_void_p)
kernel32.WaitForSingleObject.argtypes = (wintypes.HANDLE, wintypes.DWORD)
kernel32.GetExitCodeThread.argtypes = (wintypes.HANDLE, ctypes.POINTER(wintypes.DWORD))
kernel32.CloseHandle.argtypes = (wintypes.HANDLE,)
EVENTS = {"ctrl-c": signal.CTRL_C_EVENT, "ctrl-break": signal.CTRL_BREAK_EVENT}
SIGNALS = {"sigint": signal.SIGINT, "sigbreak": signal.SIGBREAK}


def say(text):
    sys.stdout.write("LAUNCHER " + text + "\n")
    sys.stdout.flush()


def ctrl_routine(pid, event):
    # kernelbase is mapped at the same address in every process, so our CtrlRoutine is the child's.
    routine = kernel32.GetProcAddress(kernel32.GetModuleHandleW("kernelbase"), b"CtrlRoutine")
    if not routine:
        raise ctypes.WinError(ctypes.get_last_error())
    access = 0x0002 | 0x0008 | 0x0010 | 0x0020 | 0x0400  # CREATE_THREAD, VM_OPERATION/READ/WRITE, QUERY_INFORMATION
    process = kernel32.OpenProcess(access, False, pid)
    if not process:
        raise ctypes.WinError(ctypes.get_last_error())
    try:
        thread = kernel32.CreateRemoteThread(process, None, 0, routine, ctypes.c_void_p(event), 0, None)
        if not thread:
            raise ctypes.WinError(ctypes.get_last_error())
        kernel32.WaitForSingleObject(thread, 10000)
        code = wintypes.DWORD()
        kernel32.GetExitCodeThread(thread, ctypes.byref(code))
        kernel32.CloseHandle(thread)
        return code.value  # 1: the handlers were run; 0: the process ignores console events
    finally:
        kernel32.CloseHandle(process)


def send_event(child, what):
    event = EVENTS[what]
    try:
        os.kill(child.pid, event)  # GenerateConsoleCtrlEvent(event, the child's process group)
        say(f"sent {what} via GenerateConsoleCtrlEvent")
    except OSError as exc:
        handled = ctrl_routine(child.pid, event)
        say(f"sent {what} via CtrlRoutine, which returned {handled} (GenerateConsoleCtrlEvent failed: {exc})")


def commands(path):
    # Lines appended to the control file, as they come.
    pending = b""
    with open(path, "rb") as control:
        while True:
            data = control.read()
            if not data:
                time.sleep(0.05)
                continue
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.decode().strip()


def child_commands(child, path):
    for what in commands(path):
        if what in EVENTS:
            try:
                send_event(child, what)
            except OSError as exc:
                say(f"could not send {what}: {exc}")
        elif what == "kill":
            break
    if child.poll() is None:
        say("terminating the child")
        child.kill()


def in_process_commands(path):
    for what in commands(path):
        if what in SIGNALS:
            signal.raise_signal(SIGNALS[what])
            say(f"raised {what}")
        elif what == "kill":
            os._exit(137)


def main():
    options, args = sys.argv[1:sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1:]
    control = options[options.index("--control") + 1]
    if "--in-process" in options:
        threading.Thread(target=in_process_commands, args=(control,), daemon=True).start()
        say(f"in-process pid={os.getpid()}")
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = args
            runpy.run_path(args[0], run_name="__main__")
        return
    flags = 0 if "--same-group" in options else subprocess.CREATE_NEW_PROCESS_GROUP
    child = subprocess.Popen([sys.executable, *args], creationflags=flags, stdin=subprocess.DEVNULL)
    say(f"child-pid={child.pid}")
    threading.Thread(target=child_commands, args=(child, control), daemon=True).start()
    code = child.wait()
    say(f"child-exit={code}")
    sys.exit(code)


main()
"""

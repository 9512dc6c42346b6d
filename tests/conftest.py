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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from ortq import keys
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


#: The bound on a wait for a process that neither says what it was waited for nor exits: a hang's
#: bound, never a timing. Every wait for a process below ends as soon as the process reports (its
#: ready line, its record) or exits, however loaded the machine; this only ends one whose process
#: says nothing for minutes. Below pytest-timeout's 300 s a test (pyproject.toml), so that such a
#: hang fails saying what was waited for, with the process's last lines, not with a stack dump.
PROCESS_SAFETY_SECONDS = 240.0


def last_lines(path: Path, count: int = 40) -> str:
    """The last ``count`` lines of a process's log (all of it when shorter), for a failure message."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"(no log at {path})"
    shown = "\n".join(lines[-count:])
    return shown if len(lines) <= count else f"(last {count} of {len(lines)} lines)\n{shown}"


def wait_for_process(
    process: subprocess.Popen[Any],
    log_path: Path,
    what: str,
    reported: Callable[[], bool],
    safety: float = PROCESS_SAFETY_SECONDS,
) -> None:
    """Wait until ``reported()`` (what the process says: a line in its log, a record it writes) or
    the process exits. Exiting first fails, and so does ``safety`` seconds of neither (a hang, see
    PROCESS_SAFETY_SECONDS); both failures name ``what`` was waited for and show the log's end."""
    deadline = time.monotonic() + safety
    while not reported():
        if process.poll() is not None:
            if reported():  # it reported just before it exited (a burst worker may end at once)
                return
            raise AssertionError(
                f"waited for {what}; the process (pid {process.pid}) exited with {process.returncode} first. "
                f"{log_path}:\n{last_lines(log_path)}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"waited for {what}; the process (pid {process.pid}) neither did so nor exited within "
                f"{safety:g} s (a hang). {log_path}:\n{last_lines(log_path)}"
            )
        time.sleep(0.05)


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
        """Start ``count`` workers and wait until each has published its record (read through
        ``watch_url`` when the workers' own user may not read them, as under an ACL)."""
        started = [self.start(model_path, name, redis_url, *extra) for _ in range(count)]
        with Producer(settings=Settings.from_url(watch_url or redis_url)) as producer:
            for process in started:
                self.wait_serving(process, name, producer)

    def wait_serving(self, process: subprocess.Popen[bytes], name: str, producer: Producer) -> None:
        """Wait until the worker ``process`` (started here) serves ``name``: its record, with its
        pid, is among ``producer``'s view of the model's workers, or its log has the line it
        writes just after publishing it ("worker ... serving model ..."); fails if it exits first."""
        log_path = next(path for started, path in self.processes if started is process)
        line = f" serving model {name!r} on "

        def reported() -> bool:
            if line in log_path.read_text(errors="replace"):
                return True
            return any(record.get("pid") == process.pid for record in producer.workers(name))

        wait_for_process(
            process, log_path, f"worker pid {process.pid} to publish its record for model {name!r}", reported
        )

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


def eventually(check: object, timeout: float = 10.0, what: str = "") -> None:
    """Wait for ``check()`` to become true: RQ's bookkeeping lands just after the reply (reply first).
    ``what``: the condition in words, for the failure message."""
    assert callable(check)
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {timeout} s: {what or check}")
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

    def wait(self, timeout: float = PROCESS_SAFETY_SECONDS) -> int:
        """Its exit status, once it exits (``timeout``: a hang's bound, PROCESS_SAFETY_SECONDS)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"waited for the pool (pid {self.process.pid}) to exit; it did not within {timeout:g} s. "
                f"{self.log}:\n{last_lines(self.log)}"
            ) from None


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


def reply_stream_of(client: redis.Redis, model: str, job_id: str) -> str | None:
    """The reply stream job ``job_id`` of ``model`` is answered in (wire protocol 4: its producer's,
    named by the job hash's ``ortq_reply``), or None when its hash names none (or is gone)."""
    name = client.hget(keys.job_key(job_id), "ortq_reply")
    if name is None or keys.reply_keep(name) is None:
        return None
    return keys.reply_key(model, keys.as_text(name))


def _entries(client: redis.Redis, key: str, first: bytes | str = "-", last: bytes | str = "+") -> list[Any]:
    """XRANGE's (entry id, fields) pairs, fields as bytes (the client decodes nothing)."""
    return list(client.xrange(key, first, last) or [])


def _frame_of(client: redis.Redis, model: str, job_id: str, frame: bytes) -> bytes:
    """An entry's frame; an empty one is a large answer's, read from the job's own stream."""
    if frame:
        return frame
    entries = _entries(client, keys.large_reply_key(model, job_id))
    assert len(entries) == 1, (job_id, entries)
    return bytes(entries[0][1][keys.REPLY_FRAME_FIELD])


def answers_of(client: redis.Redis, model: str, job_id: str) -> list[bytes]:
    """Every response frame answering ``job_id`` in its reply stream, as read from Redis (the
    entries whose ``id`` is the job's; a large one's frame read from its own stream): one for a job
    answered once, none for one not answered (yet), or whose hash names no reply stream."""
    return answers_of_many(client, model, [job_id])[job_id]


def answers_of_many(client: redis.Redis, model: str, job_ids: list[str]) -> dict[str, list[bytes]]:
    """``answers_of`` for each of ``job_ids``, each reply stream they name read once."""
    with client.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(keys.job_key(job_id), "ortq_reply")
        names = pipe.execute()
    out: dict[str, list[bytes]] = {job_id: [] for job_id in job_ids}
    stream_of = {
        job_id: keys.reply_key(model, keys.as_text(name))
        for job_id, name in zip(job_ids, names, strict=True)
        if name is not None and keys.reply_keep(name) is not None
    }
    for stream in sorted(set(stream_of.values())):
        for _, fields in _entries(client, stream):
            job_id = keys.as_text(fields.get(keys.REPLY_ID_FIELD, b""))
            if stream_of.get(job_id) == stream:
                out[job_id].append(_frame_of(client, model, job_id, fields.get(keys.REPLY_FRAME_FIELD, b"")))
    return out


def answer_of(client: redis.Redis, model: str, job_id: str) -> bytes | None:
    """The response frame of job ``job_id``'s answer as read from Redis, as a reader that did not
    follow the stream finds it (docs/wire-format.md, section 4.1): the entry its hash's
    ``ortq_answer`` names, in the stream its ``ortq_reply`` names, which must answer that job; None
    until it is answered."""
    name, entry = client.hmget(keys.job_key(job_id), "ortq_reply", "ortq_answer")
    if name is None or entry is None:
        return None
    found = _entries(client, keys.reply_key(model, keys.as_text(name)), entry, entry)
    assert len(found) == 1, (job_id, entry, found)
    fields = found[0][1]
    assert fields.get(keys.REPLY_ID_FIELD) == job_id.encode(), (job_id, fields)
    return _frame_of(client, model, job_id, fields.get(keys.REPLY_FRAME_FIELD, b""))

"""A stop ends an idle worker's blocking read at once (ortq.worker.unblock): CLIENT UNBLOCK from a
connection of its own, to the id read at the blocked connection's last connect. Real Redis, a real
worker process."""

from __future__ import annotations

import logging
import signal
import threading
import uuid
from pathlib import Path

import pytest
import redis

from ortq.settings import Settings
from ortq.worker.unblock import Unblocker
from tests.conftest import PROCESS_SAFETY_SECONDS, WorkerProcesses, eventually, last_lines
from tests.test_transport_security import WORKER_RULES


def _blocked_read(
    client: redis.Redis, unblocker: Unblocker, source: str, timeout: float
) -> tuple[threading.Thread, list[object]]:
    """A thread in BLMOVE on ``client``, marked as blocking as the intake marks it; its reply in the list."""
    replies: list[object] = []

    def read() -> None:
        unblocker.blocking.set()
        try:
            replies.append(client.blmove(source, source + ":to", timeout))  # type: ignore[arg-type]
        finally:
            unblocker.blocking.clear()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, replies


def _is_blocked(admin: redis.Redis, client_id: int | None) -> bool:
    return any(int(c["id"]) == client_id and "b" in c["flags"] for c in admin.client_list())


def test_a_stop_ends_the_blocked_read_of_a_reconnected_client(redis_url: str, connection: redis.Redis) -> None:
    settings = Settings.from_url(redis_url)
    client = settings.connect(check=False)
    unblocker = Unblocker(client, settings, window=1.0)
    client.ping()
    first = unblocker.client_id
    assert first is not None and first == int(client.client_info()["id"])
    # Redis drops the connection: redis-py connects again at the next command, with a new id
    connection.client_kill_filter(_id=first)
    eventually(lambda: client.ping() and unblocker.client_id != first, 30, "the client reconnected")
    source = f"test-unblock:{uuid.uuid4().hex}"
    thread, replies = _blocked_read(client, unblocker, source, 0)  # 0: it would block for ever
    eventually(lambda: _is_blocked(connection, unblocker.client_id), 60, "the read blocked in Redis")
    unblocker.unblock()
    thread.join(PROCESS_SAFETY_SECONDS)
    assert not thread.is_alive(), "the read was not ended by the stop"
    assert replies == [None]  # ended as a timeout ends it: no job moved, no error
    assert connection.exists(source, source + ":to") == 0
    client.close()


def test_without_client_unblock_in_the_rule_the_read_ends_by_itself_and_the_worker_says_so_once(
    redis_url: str, connection: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    user, password = f"test-unblock-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    rules = WORKER_RULES.replace("+client|unblock ", "")
    assert rules != WORKER_RULES
    connection.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", *rules.split())
    try:
        host, port = (
            connection.connection_pool.connection_kwargs["host"],
            connection.connection_pool.connection_kwargs["port"],
        )
        settings = Settings.from_url(f"redis://{user}:{password}@{host}:{port}/0")
        client = settings.connect(check=False)
        unblocker = Unblocker(client, settings, window=1.0)
        client.ping()
        caplog.set_level(logging.WARNING, "ortq.worker")
        for _ in range(2):
            thread, replies = _blocked_read(client, unblocker, f"rq:test-unblock:{uuid.uuid4().hex}", 1)
            eventually(lambda: _is_blocked(connection, unblocker.client_id), 60, "the read blocked in Redis")
            unblocker.unblock()
            thread.join(PROCESS_SAFETY_SECONDS)
            assert replies == [None]  # its own timeout
        eventually(lambda: any("lacks +client|unblock" in r.getMessage() for r in caplog.records), 60, "the warning")
        assert sum("lacks +client|unblock" in r.getMessage() for r in caplog.records) == 1
        client.close()
    finally:
        connection.execute_command("ACL", "DELUSER", user)


def test_an_idle_worker_stops_without_waiting_out_its_read(
    tiny_path: Path, model_name: str, redis_url: str, workers: WorkerProcesses
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    process, log_path = workers.processes[0]
    process.send_signal(signal.SIGTERM)
    assert process.wait(PROCESS_SAFETY_SECONDS) == 0, last_lines(log_path)
    text = log_path.read_text(errors="replace")
    assert "the stop ended the idle read at once (CLIENT UNBLOCK)" in text, last_lines(log_path)

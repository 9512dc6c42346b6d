"""``ortq info``'s WORKERS column counts the live workers only (issue 35, "What a new user met": it
said 3 where the exporter said 2 alive), and shows a gone worker apart. Real Redis, real worker
processes: one of two killed with SIGKILL, whose records stay behind until they expire."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import redis

from ortq import exporter
from ortq.info import GONE, collect
from ortq.shards import ShardMap
from tests.cli_support import invoke
from tests.conftest import PROCESS_SAFETY_SECONDS, WorkerProcesses, eventually

pytestmark = pytest.mark.timeout(300)

BEAT = 0.5  # the workers' heartbeat interval (s): gone after GONE_AFTER_BEATS of them without one


def workers_column(redis_url: str, model_name: str) -> str:
    """The WORKERS cell of the model's row in ``ortq info``'s models table."""
    done = invoke("info", "--redis-url", redis_url)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.split("\n\n")[0].splitlines()
    [row] = [r for r in rows if r.startswith(model_name + " ")]
    start = header.index("WORKERS")
    end = header.index("INPUTS")
    return row[start:end].strip()


def alive_series(redis_url: str, connection: redis.Redis, model_name: str) -> float:
    """What the exporter says: its workers-alive gauge for the model."""
    collector = exporter.QueueCollector({redis_url: connection}, ShardMap(redis_url), BEAT)
    [family] = [f for f in collector.collect() if f.name == exporter.WORKERS_ALIVE]
    [value] = [s.value for s in family.samples if s.labels["model"] == model_name]
    return float(value)


def test_the_workers_column_counts_live_workers_and_shows_gone_ones_apart(
    workers: WorkerProcesses,
    redis_url: str,
    model_name: str,
    tiny_path: Path,
    connection: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", str(BEAT))  # the workers' interval and the reader's
    workers.serve(tiny_path, model_name, redis_url, 2)
    assert workers_column(redis_url, model_name) == "2"
    killed, _ = workers.processes[0]
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(PROCESS_SAFETY_SECONDS) == -signal.SIGKILL

    def states() -> list[str]:
        [model] = [m for m in collect(connection, BEAT)["models"] if m["model"] == model_name]
        return sorted(str(w["state"]) for w in model["workers"])

    # Gone once GONE_AFTER_BEATS intervals pass without a heartbeat; the bound is a hang's, not a timing.
    eventually(lambda: GONE in states(), timeout=PROCESS_SAFETY_SECONDS, what="the killed worker shown as gone")
    assert len(states()) == 2  # its records are still there: it is listed, as gone
    assert workers_column(redis_url, model_name) == "1 (+1 gone)"
    assert alive_series(redis_url, connection, model_name) == 1.0  # the exporter's count agrees

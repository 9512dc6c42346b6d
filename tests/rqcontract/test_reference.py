"""RQ's own worker, run by reference.py, leaves the records RQ documents: the harness sees them all.

These facts hold on every supported RQ series; where the series differ, the test says which
writes what, so that a new RQ release that changes its writes fails here first.
"""

from __future__ import annotations

import pytest
import redis
import rq

from tests.rqcontract import reference
from tests.rqcontract.classify import Value
from tests.rqcontract.snapshot import Snapshot, diff

pytestmark = pytest.mark.rqcompat

RQ3 = int(rq.__version__.split(".")[0]) >= 3


def lit(text: str) -> Value:
    return Value("literal", text)


def job_fields(snap: Snapshot, job: str = "<job>") -> dict[str, Value]:
    record = snap[f"rq:job:{job}"]
    assert record.type == "hash"
    return record.fields


def assert_running(snap: Snapshot, job: str = "<job>") -> None:
    """A started job: RQ's started registry, execution records and busy worker all name it."""
    fields = job_fields(snap, job)
    assert fields["status"] == lit("started")
    assert fields["worker_name"] == Value("placeholder", "<worker>")
    assert fields["started_at"] == fields["last_heartbeat"] == Value("iso-utc")
    assert snap[f"rq:job:{job}"].ttl == "none"  # persisted while it runs
    assert snap["rq:wip:<queue>"].scores == {f"{job}:<exec>": "now+job_timeout+60"}
    execution = snap[f"rq:execution:{job}:<exec>"]
    assert execution.fields["created_at"] == Value("epoch-float")
    assert execution.fields["worker_name"] == Value("placeholder", "<worker>")
    assert snap[f"rq:executions:{job}"].scores == {"<exec>": "now+job_timeout+120"}
    worker = snap["rq:worker:<worker>"].fields
    assert worker["state"] == lit("busy")
    if RQ3:  # RQ 3 indexes a worker's executions in a set instead of a current_job field
        assert "current_job" not in worker
        assert snap["rq:worker:<worker>:executions"].members == (f"{job}:<exec>",)
        assert execution.fields["job_id"] == Value("placeholder", job)
    else:
        assert worker["current_job"] == Value("placeholder", job)
        assert "rq:worker:<worker>:executions" not in snap


def assert_no_execution_left(snap: Snapshot, job: str = "<job>") -> None:
    assert f"rq:execution:{job}:<exec>" not in snap
    assert f"rq:executions:{job}" not in snap
    wip = snap.records.get("rq:wip:<queue>")
    assert wip is None or f"{job}:<exec>" not in wip.scores
    assert "current_job" not in snap["rq:worker:<worker>"].fields


def test_success(contract_connection: redis.Redis) -> None:
    stages = reference.success(contract_connection)
    queued = stages["queued"]
    assert job_fields(queued)["status"] == lit("queued")
    assert queued["rq:job:<job>"].ttl == "ttl"
    assert queued["rq:queue:<queue>"].members == ("<job>",)
    assert queued["rq:queues"].members == ("rq:queue:<queue>",) and queued["rq:queues"].partial
    assert_running(stages["started"])
    assert stages["started"]["rq:worker:<worker>"].ttl == "job_timeout+60"
    beat = stages["heartbeat"]
    assert_running(beat)
    assert beat["rq:worker:<worker>"].ttl == "job_monitoring_interval+60"
    if RQ3:
        assert beat["rq:worker:<worker>:executions"].ttl == "job_monitoring_interval+60"

    ended = stages["ended"]
    fields = job_fields(ended)
    assert fields["status"] == lit("finished") and fields["ended_at"] == Value("iso-utc")
    assert ended["rq:job:<job>"].ttl == "result_ttl"
    assert ended["rq:finished:<queue>"].scores == {"<job>": "now+result_ttl"}
    [result] = ended["rq:results:<job>"].entries
    assert ended["rq:results:<job>"].ttl == "result_ttl"
    assert result["type"] == Value("int", "1")
    assert result["execution_id"] == Value("placeholder", "<exec>")
    assert result["return_value"] == Value(
        "base64", 'msgpack({"outputs":{"y":["float32",[1,4]]},"value":3})'
    )  # fmt: skip
    assert_no_execution_left(ended)
    worker = ended["rq:worker:<worker>"]
    assert worker.fields["state"] == lit("idle") and worker.fields["successful_job_count"] == Value("int", "1")
    assert worker.ttl == "worker_ttl+60"


def test_failure(contract_connection: redis.Redis) -> None:
    stages = reference.failure(contract_connection)
    assert_running(stages["started"])
    ended = stages["ended"]
    assert job_fields(ended)["status"] == lit("failed")
    assert ended["rq:job:<job>"].ttl == "failure_ttl"
    assert ended["rq:failed:<queue>"].scores == {"<job>": "now+failure_ttl"}
    [result] = ended["rq:results:<job>"].entries
    assert result["type"] == Value("int", "2")
    assert result["exc_string"] == Value("base64", "zlib(traceback)")
    assert "return_value" not in result
    assert_no_execution_left(ended)
    assert ended["rq:worker:<worker>"].fields["failed_job_count"] == Value("int", "1")


def test_retry_now(contract_connection: redis.Redis) -> None:
    stages = reference.retry_now(contract_connection)
    assert job_fields(stages["queued"])["retries_left"] == Value("int", "2")
    assert_running(stages["started"])
    ended = stages["ended"]
    fields = job_fields(ended)
    assert fields["status"] == lit("queued") and fields["retries_left"] == Value("int", "1")
    assert fields["retry_intervals"] == Value("json", "[0]")
    assert ended["rq:queue:<queue>"].members == ("<job>",)
    assert "rq:failed:<queue>" not in ended and "rq:results:<job>" not in ended  # a retry leaves no result
    assert_no_execution_left(ended)


def test_retry_later(contract_connection: redis.Redis) -> None:
    stages = reference.retry_later(contract_connection)
    assert_running(stages["started"])
    ended = stages["ended"]
    fields = job_fields(ended)
    assert fields["status"] == lit("scheduled") and fields["retries_left"] == Value("int", "1")
    assert fields["retry_intervals"] == Value("json", "[300,600]")
    assert ended["rq:scheduled:<queue>"].scores == {"<job>": "now+retry_interval"}
    assert "rq:queue:<queue>" not in ended and "rq:failed:<queue>" not in ended
    assert_no_execution_left(ended)


def test_worker_records(contract_connection: redis.Redis) -> None:
    stages = reference.worker(contract_connection)
    birth = stages["birth"]
    born = birth["rq:worker:<worker>"]
    assert born.ttl == "worker_ttl+60"
    assert born.fields["birth"] == born.fields["last_heartbeat"] == Value("iso-utc")
    assert born.fields["queues"] == Value("placeholder", "<queue>")
    assert born.fields["pid"] == Value("volatile") and "death" not in born.fields
    assert birth["rq:workers"].members == ("rq:worker:<worker>",)
    assert birth["rq:workers:<queue>"].members == ("rq:worker:<worker>",)
    assert_running(stages["busy"], "<job1>")

    idle = stages["idle"]["rq:worker:<worker>"].fields
    assert idle["successful_job_count"] == idle["failed_job_count"] == Value("int", "1")
    assert idle["total_working_time"] == Value("float") and idle["state"] == lit("idle")
    assert ("current_job_working_time" in idle) is not RQ3

    death = stages["death"]
    dead = death["rq:worker:<worker>"]
    assert dead.fields["death"] == Value("iso-utc") and dead.ttl == "<=60s"
    assert "rq:workers" not in death and "rq:workers:<queue>" not in death


def test_scenarios_use_fresh_ids(contract_connection: redis.Redis) -> None:
    """Two runs of one scenario never see each other's keys, and RQ writes the same both times."""
    first = reference.success(contract_connection)
    second = reference.success(contract_connection)
    assert first["ended"].ids.keys().isdisjoint(second["ended"].ids.keys())
    for stage in ("queued", "started", "heartbeat", "ended"):
        assert diff(second[stage], first[stage]) == []

"""A lost GPU: the worker puts its jobs back and exits with EXIT_DEVICE_LOST for its supervisor.

No device can be pulled out here, so the loss is a real ``session.run`` error (an out-of-range
Gather index) that the worker is told to read as one with ``--device-lost-pattern``, the option an
operator would use for a driver whose message ortq does not know. What DirectML and CUDA really
print is checked against the matcher on recorded messages.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys
from ortq.errors import EXIT_DEVICE_LOST, InferenceFailed
from ortq.producer import Producer
from ortq.settings import Settings
from ortq.worker.devicelost import DeviceLostMatcher
from tests import onnx_models
from tests.conftest import Pool, WorkerProcesses, eventually

# Messages as ONNX Runtime reports them (from its issue tracker and driver logs).
LOST = [
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running Conv node. "
    "Name:'conv1' Status Message: D:\\a\\_work\\1\\s\\onnxruntime\\core\\providers\\dml\\"
    "DmlExecutionProvider\\src\\MLOperatorAuthorImpl.cpp(2557)\\onnxruntime_pybind11_state.pyd!00007FFB: "
    "(caller: 00007FFB) Exception(3) tid(2f8) 887A0005 The GPU device instance has been suspended.",
    "[ONNXRuntimeError] : 1 : FAIL : DXGI_ERROR_DEVICE_REMOVED",
    "Exception(1) tid(1f4c) 887A0006 The GPU will not respond to more commands (DXGI_ERROR_DEVICE_HUNG)",
    "[ONNXRuntimeError] : 1 : FAIL : CUDA failure 700: an illegal memory access was encountered ; "
    "GPU=0 ; hostname=node1 ; file=cuda_call.cc ; line=129 ; expr=cudaStreamSynchronize(stream);",
    "CUDA error cudaErrorLaunchFailure:unspecified launch failure",
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : CUDA failure 100: no CUDA-capable device is detected",
]
NOT_LOST = [
    "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: x",
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running Gather node. "
    "Name:'g' Status Message: indices element out of data bounds, idx=9 must be within the inclusive range [-4,3]",
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Exiting due to terminate flag being set to true.",
    "CUDA failure 2: out of memory ; GPU=0",
]


@pytest.mark.parametrize("message", LOST)
def test_device_loss_messages_are_recognised(message: str) -> None:
    assert DeviceLostMatcher()(RuntimeError(message))


@pytest.mark.parametrize("message", NOT_LOST)
def test_ordinary_run_errors_are_not_device_loss(message: str) -> None:
    assert not DeviceLostMatcher()(RuntimeError(message))


def test_an_operator_pattern_extends_the_list() -> None:
    assert DeviceLostMatcher("out of data bounds")(RuntimeError(NOT_LOST[1]))


def test_a_lost_device_requeues_the_job_and_exits_75(
    workers: WorkerProcesses, producer: Producer, connection: redis.Redis, model_name: str, models_dir: Path
) -> None:
    path = onnx_models.gather_model(models_dir / "gather.onnx")
    redis_url = producer.settings.redis_url
    lost = workers.start(path, model_name, redis_url, "--device-lost-pattern", "out of data bounds")
    producer.wait_for_workers(model_name)
    doomed = producer.submit(model_name, {"idx": np.array([9], np.int64)})
    assert lost.wait(60) == EXIT_DEVICE_LOST, workers.logs()
    # Back at the head of the queue, still queued, and counted as taken back once.
    assert [keys.as_text(i) for i in connection.lrange(keys.queue_key(model_name), 0, -1)] == [doomed.id]
    assert doomed.status() == "queued"
    assert connection.hget(keys.job_key(doomed.id), "ortq_recoveries") == b"1"
    assert "lost its device" in workers.logs() or "device is lost" in workers.logs()
    assert producer.workers(model_name) == []  # its record went with it

    # A fresh worker (the supervisor's restart) runs it: here it is an ordinary bad run.
    workers.start(path, model_name, redis_url)
    producer.wait_for_workers(model_name)
    with pytest.raises(InferenceFailed) as failed:
        doomed.result(timeout=30)
    assert "out of data bounds" in failed.value.remote_message
    idx = np.array([0, 3, -1], np.int64)
    direct = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"idx": idx})[0]
    assert producer.infer(model_name, {"idx": idx})["y"].tolist() == direct.tolist()


def test_a_hung_run_hands_its_jobs_on_and_the_pool_starts_a_fresh_worker(
    tmp_path: Path, models_dir: Path, model_name: str, redis_url: str, pools: list[Pool]
) -> None:
    """A run that never returns (tests/onnx_models.hang_model: no timeout on it, as a hung driver):
    past ``stall_seconds`` the worker stops beating, requeues what it holds and exits 75; the pool
    starts a fresh one at once. The job that hangs every worker ends as WorkerLost after its two
    recoveries; the job behind it is answered."""
    hang = onnx_models.hang_model(models_dir / "hang.onnx")
    config = tmp_path / "pool.toml"
    config.write_text(
        textwrap.dedent(f"""
        [pool]
        measure_memory = false
        grace_seconds = 5
        [pool.restart]
        backoff_initial_seconds = 0.5
        [pool.env]
        ORTQ_HEARTBEAT_SECONDS = 0.5
        [[model]]
        name = "{model_name}"
        path = "{hang}"
        provider = "cpu"
        threads = 1
        stall_seconds = 2
        job_timeout = 1
        [[model.workers]]
        count = 1
        """)
    )
    pools.append(pool := Pool(config, redis_url))
    session = ort.InferenceSession(str(hang), providers=["CPUExecutionProvider"])
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        producer.wait_for_workers(model_name, 1, timeout=60)
        # A run stopped by the worker's --job-timeout (its Loop checks RunOptions.terminate)...
        with pytest.raises(InferenceFailed, match="JobTimeout"):
            producer.infer(model_name, {"x": np.full((1, 4), 2000, np.float32)}, timeout=30)
        # ... and one that no timeout stops: a job whose own timeout is longer than stall_seconds.
        poison = producer.submit(model_name, {"x": np.full((1, 4), 2000, np.float32)}, job_timeout=3600)
        fine = producer.submit(model_name, {"x": np.ones((2, 4), np.float32)})
        with pytest.raises(InferenceFailed, match="WorkerLost") as failed:
            poison.result(timeout=120)
        assert "stalled" in str(failed.value), pool.text()
        x = np.ones((2, 4), np.float32)
        np.testing.assert_array_equal(fine.result(timeout=60)["y"], session.run(None, {"x": x})[0])
        assert poison.status() == "failed"
    # The poison job's three runs, each by a fresh worker; none taken back for a stale heartbeat.
    eventually(lambda: pool.text().count("exit 75 (device lost)") == 3, 30)
    # Each exit was the watchdog's, at --stall-seconds 2 (it notices on a heartbeat tick: "for 2 s", or
    # "for 3 s" on a loaded machine).
    assert len(re.findall(r"no run has ended for \d+ s \(--stall-seconds 2\)", pool.text())) == 3, pool.text()
    assert "stopped sending heartbeats" not in pool.text() and "intermediate list" not in pool.text()

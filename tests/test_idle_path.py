"""One request at a time (issue 34, item 6): an idle worker's feeder takes, checks, runs and answers
a lone request itself (ortq.worker.overlap.Feeder._alone), with no hand-over to the main thread;
a backlog is still handed over and overlapped as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortq.producer import Producer
from ortq.settings import Settings
from ortq.worker.serve import WorkerConfig, build_worker
from tests import onnx_models
from tests.conftest import WorkerProcesses
from tests.test_prefetch import _high_water
from tests.test_worker_inprocess import Serving


@pytest.fixture(scope="module")
def conv_path(models_dir: Path) -> Path:
    return onnx_models.conv_model(models_dir / "idle_conv.onnx")


def test_a_worker_process_serving_one_request_at_a_time_answers_as_a_direct_session_run(
    workers: WorkerProcesses, conv_path: Path, model_name: str, redis_url: str
) -> None:
    workers.serve(conv_path, model_name, redis_url)
    session = ort.InferenceSession(str(conv_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(34)
    with Producer(settings=Settings.from_url(redis_url)) as producer:
        for _ in range(20):
            image = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
            outputs = producer.infer(model_name, {"image": image}, timeout=30)
            np.testing.assert_array_equal(outputs["logits"], session.run(None, {"image": image})[0])
    assert workers.processes[0][0].poll() is None, workers.logs()


def test_lone_requests_run_on_the_feeder_and_a_backlog_still_overlaps(
    tiny_path: Path, model_name: str, redis_url: str
) -> None:
    settings = Settings.from_url(redis_url, heartbeat_seconds=0.5)
    worker = build_worker(WorkerConfig(tiny_path, model_name, threads=1), settings)
    threads = worker.threads
    seen = _high_water(threads.slots)
    serving = Serving(worker)
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(6)
    try:
        with Producer(settings=settings) as producer:
            producer.wait_for_workers(model_name, 1, timeout=30)
            for _ in range(30):  # one at a time: each taken, run and answered by the feeder alone
                x = rng.standard_normal((1, 4)).astype(np.float32)
                outputs = producer.infer(model_name, {"x": x}, timeout=10)
                np.testing.assert_array_equal(outputs["y"], session.run(None, {"x": x})[0])
            assert (threads.ran_alone, threads.handed, seen[0]) == (30, 0, 1)
            # A backlog: handed to the main thread, the next batch taken while one runs.
            xs = [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(300)]
            responses = producer.results_of(producer.submit_many(model_name, [{"x": x} for x in xs]), timeout=120)
        for x, response in zip(xs, responses, strict=True):
            assert response.ok, response.error
            np.testing.assert_array_equal(response.outputs["y"], session.run(None, {"x": x})[0])
    finally:
        assert serving.stop() == 0
    assert threads.handed > 0 and seen[0] >= 2, (threads.handed, seen[0])
    assert worker.ledger.defects == 0 and not worker.ledger.held()

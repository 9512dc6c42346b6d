"""A real worker's /metrics and /ready (ortq.metrics wired into the worker, scraped over HTTP)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ortq.errors import InferenceFailed
from ortq.localredis import free_port
from ortq.producer import Producer
from tests import onnx_models
from tests.conftest import WorkerProcesses, eventually

pytestmark = pytest.mark.rqcompat  # also in the second pass: the oldest prometheus-client allowed


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("worker", "le")))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "le" not in s.labels
    }


def test_worker_metrics_and_readiness(
    workers: WorkerProcesses, producer: Producer, model_name: str, tiny_path: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = workers.start(tiny_path, model_name, producer.settings.redis_url, "--metrics-port", str(port))
    eventually(lambda: _get(base + "/ready")[0] == 200, timeout=60)
    assert producer.workers(model_name), "ready before its record was published"

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for _ in range(3):
        producer.infer(model_name, {"x": x})
    producer_unchecked = Producer(settings=producer.settings, validate=False)
    with pytest.raises(InferenceFailed):
        producer_unchecked.infer(model_name, {"wrong": x})
    labels = (("adapter", "cpu"), ("model", model_name), ("provider", "CPUExecutionProvider"))

    def scraped() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, text = _get(base + "/metrics")
        assert status == 200
        return _samples(text)

    failed = ("ortq_inference_request_failure_total", (*labels, ("reason", "InvalidInput")))
    # The worker counts a job after writing its answer, so the producer can see an answer
    # before the counter moves: wait for both counters, then check the rest.
    eventually(
        lambda: (now := scraped()).get(("ortq_inference_request_success_total", labels)) == 3 and now.get(failed) == 1
    )
    samples = scraped()
    assert samples[failed] == 1
    assert samples[("ortq_inference_compute_duration_seconds_count", labels)] == 3
    assert samples[("ortq_batch_size_count", labels)] == 3
    assert samples[("ortq_worker_ready", labels)] == 1
    assert samples[("ortq_queue_depth", labels)] == 0

    process.terminate()
    assert process.wait(30) == 0
    assert _get(base + "/ready")[0] != 200


#: Until ortq/worker/serve.py opens the port before building the worker (open_metrics_port, then
#: attach: see ortq/metrics.py), the port opens only once the model is warm. Remove the marker then.
def test_worker_answers_live_and_not_ready_while_its_model_loads(
    workers: WorkerProcesses, producer: Producer, model_name: str, models_dir: Path
) -> None:
    slow = onnx_models.slow_model(models_dir / "metrics-slow.onnx", loops=8000)  # a warm-up of seconds
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = workers.start(slow, model_name, producer.settings.redis_url, "--metrics-port", str(port))
    eventually(lambda: _get(base + "/live")[0] == 200, timeout=60)
    # Seen while loading: the start-up gauge only (no adapter or provider yet), not ready, no record.
    assert _get(base + "/ready")[0] == 503
    _, text = _get(base + "/metrics")
    starting = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert [(s.name, s.labels["adapter"], s.value) for s in starting] == [("ortq_worker_ready", "", 0)], text
    eventually(lambda: _get(base + "/ready")[0] == 200, timeout=60)
    assert producer.workers(model_name)
    process.terminate()
    assert process.wait(30) == 0
    assert _get(base + "/live")[0] == 0  # closed at exit


def test_worker_with_its_metrics_port_taken_stops_before_loading_the_model(
    workers: WorkerProcesses, producer: Producer, model_name: str, tiny_path: Path
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        process = workers.start(tiny_path, model_name, producer.settings.redis_url, "--metrics-port", port)
        assert process.wait(60) == 2
    log = workers.logs()
    assert "already uses this --metrics-port" in log
    assert "loaded on" not in log, log  # refused before the session was created


def test_sigterm_turns_ready_503_at_once_while_the_job_in_hand_finishes(
    workers: WorkerProcesses, producer: Producer, model_name: str, models_dir: Path
) -> None:
    """Kubernetes sends SIGTERM and stops routing by /ready: it must answer 503 at once, not when
    the worker has finished its job and gone, and the log must say what the worker does now."""
    slow = onnx_models.timed_slow_model(models_dir / "sigterm-ready-slow.onnx", 3.0)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = workers.start(slow, model_name, producer.settings.redis_url, "--metrics-port", str(port))
    eventually(lambda: _get(base + "/ready")[0] == 200, timeout=60)
    x = np.full((1, 256), 0.01, np.float32)
    job = producer.submit(model_name, {"x": x})
    eventually(lambda: job.status() == "started")
    process.terminate()
    eventually(lambda: _get(base + "/ready")[0] == 503, timeout=2)
    assert process.poll() is None  # still finishing its job
    assert job.result(timeout=60)["y"].shape == (1, 256)
    assert process.wait(30) == 0
    assert "SIGTERM: worker" in workers.logs() and "/ready answers 503 from now" in workers.logs()

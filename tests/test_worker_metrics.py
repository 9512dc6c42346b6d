"""A real worker's /metrics and /ready (ortq.metrics wired into the worker, scraped over HTTP)."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ortq.errors import InferenceFailed
from ortq.localredis import free_port
from ortq.producer import Producer
from tests.conftest import WorkerProcesses, eventually


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

    eventually(lambda: scraped().get(("ortq_inference_request_success_total", labels)) == 3)
    samples = scraped()
    assert samples[("ortq_inference_request_failure_total", (*labels, ("reason", "InvalidInput")))] == 1
    assert samples[("ortq_inference_compute_duration_seconds_count", labels)] == 3
    assert samples[("ortq_batch_size_count", labels)] == 3
    assert samples[("ortq_worker_ready", labels)] == 1
    assert samples[("ortq_queue_depth", labels)] == 0

    process.terminate()
    assert process.wait(30) == 0
    assert _get(base + "/ready")[0] != 200

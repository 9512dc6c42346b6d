"""ortq.metrics over real HTTP: a real redis-server behind ortq_queue_depth, scrapes parsed with
prometheus_client's own parser."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from ortq.errors import ConfigurationError
from ortq.localredis import LocalRedis
from ortq.metrics import (
    DURATION_BUCKETS,
    METRIC_NAMES,
    QUEUE_BUCKETS,
    MetricsServer,
    WorkerMetrics,
    open_metrics_port,
)

pytestmark = pytest.mark.rqcompat  # also in the second pass: the oldest prometheus-client allowed

LABELS = {"model": "digits", "adapter": "NVIDIA H200", "provider": "CUDAExecutionProvider", "worker": "w1"}


def get(server: MetricsServer, path: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(server.url + path, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def scrape(server: MetricsServer) -> list[Sample]:
    status, content_type, body = get(server, "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain")
    return [s for family in text_string_to_metric_families(body) for s in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """The one sample called ``name`` whose labels include ``labels``."""
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]


def list_length(client: redis.Redis, key: str) -> Callable[[], int]:
    """What the worker passes as queue_depth: LLEN of its queue's list."""
    return lambda: int(client.llen(key))  # type: ignore[arg-type]  # redis-py's sync/async union


@pytest.fixture
def queue_key(connection: redis.Redis, model_name: str) -> Iterator[str]:
    key = f"rq:queue:ortq:{model_name}"
    yield key
    connection.delete(key)


@pytest.fixture
def metrics(connection: redis.Redis, queue_key: str) -> WorkerMetrics:
    return WorkerMetrics(**LABELS, queue_depth=list_length(connection, queue_key))


@pytest.fixture
def server(metrics: WorkerMetrics) -> Iterator[MetricsServer]:
    with metrics.serve("127.0.0.1", 0) as running:
        yield running


def test_observations_are_scraped_with_labels_counts_and_sums(metrics: WorkerMetrics, server: MetricsServer) -> None:
    metrics.job_succeeded({"queue": 0.5, "batch_wait": 0.1, "decode": 0.001, "run": 0.02, "encode": 0.003})
    metrics.job_succeeded({"queue": 1.5, "run": 0.04})  # decode/encode missing: not observed
    metrics.job_failed("InvalidInput", {"queue": 2.0, "decode": 0.5})
    metrics.job_failed("JobTimeout", {})
    metrics.job_failed("InvalidInput", {})
    metrics.batch_ran(3)
    metrics.batch_ran(1)
    metrics.batch_ran(200)

    samples = scrape(server)
    for sample in samples:
        assert LABELS.items() <= sample.labels.items(), sample
    assert value(samples, "ortq_inference_request_success_total") == 2
    assert value(samples, "ortq_inference_request_failure_total", reason="InvalidInput") == 2
    assert value(samples, "ortq_inference_request_failure_total", reason="JobTimeout") == 1
    assert value(samples, "ortq_inference_queue_duration_seconds_count") == 3
    assert value(samples, "ortq_inference_queue_duration_seconds_sum") == pytest.approx(4.0)
    # The failed job's decode time is not mixed into the decode of answered jobs.
    assert value(samples, "ortq_inference_decode_duration_seconds_count") == 1
    assert value(samples, "ortq_inference_decode_duration_seconds_sum") == pytest.approx(0.001)
    assert value(samples, "ortq_inference_compute_duration_seconds_count") == 2
    assert value(samples, "ortq_inference_compute_duration_seconds_sum") == pytest.approx(0.06)
    assert value(samples, "ortq_inference_encode_duration_seconds_count") == 1
    assert value(samples, "ortq_inference_encode_duration_seconds_sum") == pytest.approx(0.003)
    assert value(samples, "ortq_batch_size_count") == 3
    assert value(samples, "ortq_batch_size_sum") == 204
    # Buckets are cumulative: le=1 holds the run of 1, le=4 also the run of 3, le=256 all three.
    assert value(samples, "ortq_batch_size_bucket", le="1.0") == 1
    assert value(samples, "ortq_batch_size_bucket", le="2.0") == 1
    assert value(samples, "ortq_batch_size_bucket", le="4.0") == 2
    assert value(samples, "ortq_batch_size_bucket", le="128.0") == 2
    assert value(samples, "ortq_batch_size_bucket", le="256.0") == 3
    assert value(samples, "ortq_inference_compute_duration_seconds_bucket", le="0.025") == 1
    assert value(samples, "ortq_inference_compute_duration_seconds_bucket", le="0.05") == 2


def test_durations_recorded_a_batch_at_a_time_read_as_prometheus_clients_own_histograms(
    metrics: WorkerMetrics, server: MetricsServer
) -> None:
    """The per-job duration histograms take a batch's jobs at once (WorkerMetrics.jobs_succeeded);
    a scrape reads the same buckets, counts and sums as prometheus_client's Histogram fed the same
    values one at a time, values on a bucket's bound included (le: less than or equal)."""
    runs = [0.0, 0.0001, 0.00010001, 0.025, 0.05, 59.9, 60.0, 61.0, 1e9, *[0.003 * i for i in range(40)]]
    batch = [{"queue": 2 * run, "run": run, "decode": run / 2, "encode": run} for run in runs]
    metrics.jobs_succeeded(batch[:10])
    metrics.jobs_succeeded(batch[10:])
    metrics.jobs_succeeded([])
    reference = CollectorRegistry()
    for name, key, buckets in (
        ("ortq_inference_queue_duration_seconds", "queue", QUEUE_BUCKETS),
        ("ortq_inference_compute_duration_seconds", "run", DURATION_BUCKETS),
        ("ortq_inference_decode_duration_seconds", "decode", DURATION_BUCKETS),
        ("ortq_inference_encode_duration_seconds", "encode", DURATION_BUCKETS),
    ):
        histogram = Histogram(name, "reference", registry=reference, buckets=buckets)
        for timings in batch:
            histogram.observe(timings[key])
    expected: dict[tuple[str, str | None], float] = {}
    for family in text_string_to_metric_families(generate_latest(reference).decode()):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                expected[(sample.name, sample.labels.get("le"))] = sample.value
    got = {(s.name, s.labels.get("le")): s.value for s in scrape(server) if (s.name, s.labels.get("le")) in expected}
    assert len(expected) == 4 * 2 + 3 * (len(DURATION_BUCKETS) + 1) + len(QUEUE_BUCKETS) + 1  # sums, counts, buckets
    assert got.keys() == expected.keys()
    for key, count in expected.items():
        assert got[key] == pytest.approx(count), key
    assert value(scrape(server), "ortq_inference_request_success_total") == len(runs)


def exposed_names(server: MetricsServer) -> set[str]:
    """Sample names of a scrape, less prometheus_client's ``_created`` timestamps."""
    return {s.name for s in scrape(server) if not s.name.endswith("_created")}


def test_metric_names_are_exactly_what_a_scrape_exposes(metrics: WorkerMetrics, server: MetricsServer) -> None:
    """METRIC_NAMES (what the Grafana dashboard may query) is exactly what a scrape exposes,
    every series but the failure counter (which needs a reason) from the very first scrape."""
    first = exposed_names(server)
    metrics.job_failed("InvalidInput", {})
    exposed = exposed_names(server)
    histograms = {n.removesuffix("_bucket") for n in exposed if n.endswith("_bucket")}
    assert histograms == {n for n in METRIC_NAMES if "_duration_" in n} | {"ortq_batch_size"}
    expected = {n for n in METRIC_NAMES if n not in histograms}
    expected |= {h + suffix for h in histograms for suffix in ("_bucket", "_sum", "_count")}
    assert exposed == expected
    assert first == expected - {"ortq_inference_request_failure_total"}
    assert min(DURATION_BUCKETS) < 0.001 and max(DURATION_BUCKETS) >= 10


def test_ready_flips_and_live_always_answers(metrics: WorkerMetrics, server: MetricsServer) -> None:
    assert get(server, "/ready")[0] == 503
    assert get(server, "/live")[::2] == (200, "live\n")
    assert value(scrape(server), "ortq_worker_ready") == 0
    metrics.set_ready(True)
    assert get(server, "/ready")[::2] == (200, "ready\n")
    assert value(scrape(server), "ortq_worker_ready") == 1
    metrics.set_ready(False)
    assert get(server, "/ready")[0] == 503
    assert get(server, "/live")[0] == 200
    assert value(scrape(server), "ortq_worker_ready") == 0
    assert get(server, "/nothing-here")[0] == 404


def test_queue_depth_is_read_from_redis_at_each_scrape(
    server: MetricsServer, connection: redis.Redis, queue_key: str
) -> None:
    assert value(scrape(server), "ortq_queue_depth") == 0
    connection.lpush(queue_key, "a", "b", "c")
    assert value(scrape(server), "ortq_queue_depth") == 3
    connection.lpush(queue_key, "d", "e")
    assert value(scrape(server), "ortq_queue_depth", **LABELS) == 5
    connection.delete(queue_key)
    assert value(scrape(server), "ortq_queue_depth") == 0


def test_scrape_succeeds_without_queue_depth_while_redis_is_down() -> None:
    with LocalRedis() as own_redis:
        client = redis.Redis.from_url(own_redis.url, socket_timeout=2, socket_connect_timeout=2)
        client.lpush("q", "x", "y")
        metrics = WorkerMetrics(**LABELS, queue_depth=list_length(client, "q"))
        with metrics.serve("127.0.0.1", 0) as server:
            metrics.job_succeeded({"run": 0.01})
            assert value(scrape(server), "ortq_queue_depth") == 2
            own_redis.stop()
            samples = scrape(server)
            assert not [s for s in samples if s.name == "ortq_queue_depth"]
            assert value(samples, "ortq_inference_request_success_total") == 1
            assert get(server, "/live")[0] == 200
            assert scrape(server)  # the server thread is still there after a failed read


def test_a_raising_queue_depth_callable_only_drops_its_sample() -> None:
    def broken() -> int:
        raise RuntimeError("no queue")

    metrics = WorkerMetrics(**LABELS, queue_depth=broken)
    with metrics.serve("127.0.0.1", 0) as server:
        names = {s.name for s in scrape(server)}
        assert "ortq_queue_depth" not in names
        assert "ortq_worker_ready" in names


def test_instances_in_one_process_do_not_clash() -> None:
    first, second = WorkerMetrics(**LABELS), WorkerMetrics(**LABELS)
    first.job_succeeded({})
    with first.serve("127.0.0.1", 0) as one, second.serve("127.0.0.1", 0) as two:
        assert value(scrape(one), "ortq_inference_request_success_total") == 1
        assert value(scrape(two), "ortq_inference_request_success_total") == 0
        assert "ortq_queue_depth" not in {s.name for s in scrape(one)}  # no callable, no gauge


def test_port_in_use_is_a_configuration_error_and_close_frees_it() -> None:
    metrics = WorkerMetrics(**LABELS)
    server = metrics.serve("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigurationError, match=rf"127\.0\.0\.1:{server.port}.*--metrics-port"):
            WorkerMetrics(**LABELS).serve("127.0.0.1", server.port)
    finally:
        server.close()
    with metrics.serve("127.0.0.1", server.port) as again:  # the closed server's port is free again
        assert get(again, "/live")[0] == 200
    with pytest.raises(ConfigurationError, match=r"192\.0\.2\.1:0: .*an address of this machine"):
        metrics.serve("192.0.2.1", 0)  # TEST-NET-1: never a local address
    with pytest.raises(ConfigurationError, match="0-65535"):
        metrics.serve("127.0.0.1", 70000)


def test_the_port_opens_before_the_metrics_exist_and_follows_the_worker_to_its_exit(
    metrics: WorkerMetrics, connection: redis.Redis, queue_key: str
) -> None:
    """The worker's sequence (docs/operations.md): open at start-up, attach once the session is up,
    ready while serving, not ready once asked to stop, closed at exit; every step over HTTP."""
    server = open_metrics_port("127.0.0.1", 0, model="digits", worker="w1")
    try:
        # Start-up: alive, not ready, and only the readiness gauge, at 0, for what is known.
        assert get(server, "/live")[::2] == (200, "live\n")
        assert get(server, "/ready")[::2] == (503, "not ready\n")
        [sample] = scrape(server)
        assert sample.name == "ortq_worker_ready" and sample.value == 0
        assert sample.labels == {"model": "digits", "adapter": "", "provider": "", "worker": "w1"}

        server.attach(metrics)  # the session is up: every series, still not ready
        assert get(server, "/ready")[0] == 503
        connection.lpush(queue_key, "a")
        samples = scrape(server)
        assert value(samples, "ortq_worker_ready", **LABELS) == 0
        assert value(samples, "ortq_queue_depth", **LABELS) == 1
        assert not [s for s in samples if s.labels.get("adapter") == ""]

        metrics.set_ready(True)  # its record is out: serving
        assert get(server, "/ready")[::2] == (200, "ready\n")
        assert value(scrape(server), "ortq_worker_ready") == 1
        metrics.set_ready(False)  # asked to stop: finishing its job
        assert get(server, "/ready")[0] == 503
        assert get(server, "/live")[0] == 200
    finally:
        server.close()
    with pytest.raises(urllib.error.URLError):  # exited: the port is closed
        urllib.request.urlopen(server.url + "/live", timeout=5)


def test_opening_fails_at_once_for_a_port_in_use() -> None:
    with open_metrics_port("127.0.0.1", 0) as first:
        with pytest.raises(ConfigurationError, match=rf"127\.0\.0\.1:{first.port}: .*already uses this --metrics-port"):
            open_metrics_port("127.0.0.1", first.port, model="m", worker="w")
        assert get(first, "/ready")[0] == 503  # the first one is untouched

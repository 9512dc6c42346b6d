"""Prometheus metrics of one worker, and the small HTTP server that exposes them.

Each :class:`WorkerMetrics` owns its own ``CollectorRegistry`` (not prometheus_client's
global one), so that several can live in one process (the tests) without clashing. Every
series carries the labels ``model``, ``adapter``, ``provider`` and ``worker``; the names and
endpoints are fixed in the interface notes (and docs) and the Grafana dashboard in
deploy/grafana/ queries exactly :data:`METRIC_NAMES`.

The HTTP side is :class:`MetricsServer`, a threaded WSGI server in a daemon thread answering
``GET /metrics`` (prometheus_client's own WSGI app and text exposition), ``GET /ready`` (200
while the worker serves its queue, 503 otherwise) and ``GET /live`` (200). A worker opens it at
start-up, before its model loads (:func:`open_metrics_port`: /ready 503, /metrics only
``ortq_worker_ready 0``), hands it its :class:`WorkerMetrics` once it knows its adapter and
provider (:meth:`MetricsServer.attach`), flips readiness with :meth:`WorkerMetrics.set_ready`
(true once it serves, false as soon as it is asked to stop) and closes it at exit.
:meth:`WorkerMetrics.serve` does the first two steps at once.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from socketserver import ThreadingMixIn
from types import TracebackType
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ortq.errors import ConfigurationError

log = logging.getLogger("ortq.metrics")

SUCCESS = "ortq_inference_request_success"
FAILURE = "ortq_inference_request_failure"
QUEUE_DURATION = "ortq_inference_queue_duration_seconds"
COMPUTE_DURATION = "ortq_inference_compute_duration_seconds"
DECODE_DURATION = "ortq_inference_decode_duration_seconds"
ENCODE_DURATION = "ortq_inference_encode_duration_seconds"
BATCH_SIZE = "ortq_batch_size"
WORKER_READY = "ortq_worker_ready"
QUEUE_DEPTH = "ortq_queue_depth"

#: The metric names as PromQL sees them (prometheus_client adds ``_total`` to counters;
#: histograms add ``_bucket``, ``_sum`` and ``_count``). prometheus_client also exposes a
#: ``<name>_created`` gauge per counter and for ``ortq_batch_size``, which ortq does not rely on.
METRIC_NAMES: tuple[str, ...] = (
    SUCCESS + "_total",
    FAILURE + "_total",
    QUEUE_DURATION,
    COMPUTE_DURATION,
    DECODE_DURATION,
    ENCODE_DURATION,
    BATCH_SIZE,
    WORKER_READY,
    QUEUE_DEPTH,
)

LABELS = ("model", "adapter", "provider", "worker")

#: Seconds, from a small model's sub-millisecond run to a large one's tens of seconds.
DURATION_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
#: A job may wait in a backed-up queue far longer than any run takes.
QUEUE_BUCKETS = (*DURATION_BUCKETS, 120.0, 300.0, 600.0)
#: Jobs per session.run: dynamic batching takes up to --max-batch of them.
BATCH_BUCKETS = tuple(float(2**i) for i in range(9))  # 1, 2, 4, ..., 256


class _QueueDepthCollector(Collector):
    """``ortq_queue_depth`` read at scrape time; a failing read drops the sample, not the scrape."""

    def __init__(self, read: Callable[[], int], labels: Mapping[str, str]) -> None:
        self._read = read
        self._labels = dict(labels)

    def collect(self) -> Iterable[Metric]:
        try:
            depth = self._read()
        except Exception as exc:  # Redis down or slow: the other metrics still matter most then
            log.debug("queue depth not read for this scrape: %s: %s", type(exc).__name__, exc)
            return []
        family = GaugeMetricFamily(QUEUE_DEPTH, "Jobs waiting in the model's queue, read at scrape.", labels=LABELS)
        family.add_metric([self._labels[name] for name in LABELS], float(depth))
        return [family]


class _Tally:
    """One histogram's bucket counts and sum, for :class:`_Durations`."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, bounds
        # The le labels as prometheus_client writes its own histograms' (1.0, 0.0001, +Inf).
        self.les = [floatToGoString(bound) for bound in (*bounds, float("inf"))]  # type: ignore[no-untyped-call]
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def add(self, values: Sequence[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1  # the first bucket whose bound (le) is >= value
        self.sum += sum(values)

    def family(self, label_values: list[str]) -> HistogramMetricFamily:
        buckets, total = [], 0
        for le, count in zip(self.les, self.counts, strict=True):
            total += count
            buckets.append((le, float(total)))
        family = HistogramMetricFamily(self.name, self.doc, labels=LABELS)
        family.add_metric(label_values, buckets, self.sum)
        return family


class _Durations(Collector):
    """The per-job duration histograms, recorded a batch of jobs at a time: prometheus_client's
    Histogram takes one observation a call, each under its own lock (~1 µs; four a job made the
    metrics a sixth of a digits job's cost in the worker, docs/performance.md). Exposed as
    prometheus_client's histograms are (``_bucket``, ``_sum``, ``_count``), less ``_created``."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        self._labels = [labels[name] for name in LABELS]
        self._lock = threading.Lock()
        #: Which timing each histogram records; the queue's first (the only one of a failed job).
        self._by_timing = (
            ("queue", _Tally(QUEUE_DURATION, "Seconds from enqueue to start, per job.", QUEUE_BUCKETS)),
            ("decode", _Tally(DECODE_DURATION, "Seconds decoding and checking a job's request.", DURATION_BUCKETS)),
            (
                "run",
                _Tally(
                    COMPUTE_DURATION,
                    "Seconds of the session.run that computed the job (its whole batch).",
                    DURATION_BUCKETS,
                ),
            ),
            ("encode", _Tally(ENCODE_DURATION, "Seconds encoding a job's response.", DURATION_BUCKETS)),
        )

    def add(self, timings: Iterable[Mapping[str, float]], only_queue: bool = False) -> None:
        """Record each job's ``timings`` that are present (``only_queue``: its queue time alone)."""
        timings = list(timings)
        with self._lock:
            for key, tally in self._by_timing[:1] if only_queue else self._by_timing:
                tally.add([t[key] for t in timings if key in t])

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            return [tally.family(self._labels) for _, tally in self._by_timing]


class WorkerMetrics:
    """The metrics one worker process exposes, with the methods its job path calls."""

    def __init__(
        self,
        model: str,
        adapter: str,
        provider: str,
        worker: str,
        queue_depth: Callable[[], int] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.labels = {"model": model, "adapter": adapter, "provider": provider, "worker": worker}
        self._ready = False

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            # Labelled once here, so every series is exposed (at zero) from the first scrape.
            return Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets).labels(**self.labels)

        self._success = Counter(SUCCESS, "Jobs answered with a result.", LABELS, registry=self.registry).labels(
            **self.labels
        )
        self._failure = Counter(
            FAILURE, "Jobs answered with an error, by error class name.", (*LABELS, "reason"), registry=self.registry
        )
        self._durations = _Durations(self.labels)
        self.registry.register(self._durations)
        self._batch = histogram(BATCH_SIZE, "Jobs per session.run.", BATCH_BUCKETS)
        self._ready_gauge = Gauge(
            WORKER_READY, "1 while the worker serves its queue, else 0.", LABELS, registry=self.registry
        ).labels(**self.labels)
        self._ready_gauge.set(0)
        if queue_depth is not None:
            self.registry.register(_QueueDepthCollector(queue_depth, self.labels))

    # ----------------------------------------------------------- what the worker calls

    def job_succeeded(self, timings: Mapping[str, float]) -> None:
        """Count a job answered with a result and record its ``timings`` (seconds; keys
        ``queue``, ``decode``, ``run``, ``encode``, any of which may be missing)."""
        self.jobs_succeeded([timings])

    def jobs_succeeded(self, timings: Sequence[Mapping[str, float]]) -> None:
        """job_succeeded for each of a batch's answered jobs, at once."""
        if timings:
            self._success.inc(len(timings))
            self._durations.add(timings)

    def job_failed(self, reason: str, timings: Mapping[str, float]) -> None:
        """Count a job answered with an error; ``reason`` is the error's class name. Only its
        queue time is recorded: the other durations describe jobs that produced a result."""
        self._failure.labels(**self.labels, reason=reason).inc()
        self._durations.add([timings], only_queue=True)

    def batch_ran(self, size: int) -> None:
        """Record one session.run over ``size`` jobs."""
        self._batch.observe(size)

    def set_ready(self, ready: bool) -> None:
        """Say whether the worker is serving its queue (``/ready`` and ``ortq_worker_ready``)."""
        self._ready = ready
        self._ready_gauge.set(1 if ready else 0)

    @property
    def ready(self) -> bool:
        return self._ready

    # ----------------------------------------------------------- HTTP

    def serve(self, host: str, port: int) -> MetricsServer:
        """:func:`open_metrics_port` with these metrics attached at once."""
        server = open_metrics_port(host, port, model=self.labels["model"], worker=self.labels["worker"])
        server.attach(self)
        return server


def open_metrics_port(host: str, port: int, *, model: str = "", worker: str = "") -> MetricsServer:
    """Serve /live, /ready and /metrics on ``host:port`` from a daemon thread, before the worker's
    metrics exist (``port`` 0: any free one, see :attr:`MetricsServer.port`). Until
    :meth:`MetricsServer.attach`, /ready answers 503 and /metrics holds only ``ortq_worker_ready``
    0, labelled with ``model`` and ``worker`` (adapter and provider are not known yet: empty).

    A port in use or a host that cannot be bound raises ConfigurationError, so a worker that opens
    the port first fails at once, not after loading its model."""
    if not 0 <= port <= 65535:
        raise ConfigurationError(f"metrics port must be 0-65535, got {port}")
    starting = CollectorRegistry()
    Gauge(WORKER_READY, "1 while the worker serves its queue, else 0.", LABELS, registry=starting).labels(
        model=model, adapter="", provider="", worker=worker
    ).set(0)
    endpoints = _Endpoints(starting)
    try:
        # IPv4 or IPv6, whichever the host is (wsgiref's server is IPv4 only by default).
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

        class Server(_ThreadingWSGIServer):
            address_family = family

        httpd = make_server(host, port, endpoints, Server, handler_class=_QuietHandler)
    except OSError as exc:
        hint = (
            "another process (a second worker?) already uses this --metrics-port"
            if exc.errno == errno.EADDRINUSE
            else "is --metrics-host an address of this machine?"
        )
        raise ConfigurationError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; {hint}") from exc
    return MetricsServer(httpd, endpoints)


class _Endpoints:
    """The WSGI application: /metrics from the attached registry (the start-up one before that),
    /ready from the attached metrics' readiness, /live always. Attaching swaps one reference, which
    the server's threads read per request."""

    def __init__(self, starting: CollectorRegistry) -> None:
        self.metrics: WorkerMetrics | None = None
        self._exposition = make_wsgi_app(starting)

    def attach(self, metrics: WorkerMetrics) -> None:
        self._exposition = make_wsgi_app(metrics.registry)
        self.metrics = metrics

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            body: Iterable[bytes] = self._exposition(environ, start_response)
            return body
        if path == "/live":
            return _text(start_response, "200 OK", "live")
        if path == "/ready":
            if self.metrics is not None and self.metrics.ready:
                return _text(start_response, "200 OK", "ready")
            return _text(start_response, "503 Service Unavailable", "not ready")
        return _text(start_response, "404 Not Found", "not found; try /metrics, /ready or /live")


class MetricsServer:
    """The running server of :func:`open_metrics_port`; ``attach()`` gives it the worker's metrics,
    ``close()`` stops it and frees the port."""

    def __init__(self, httpd: WSGIServer, endpoints: _Endpoints) -> None:
        self._httpd = httpd
        self._endpoints = endpoints
        self.host: str = str(httpd.server_address[0])
        self.port: int = int(httpd.server_address[1])
        # serve_forever looks for close()'s shutdown request every poll interval (0.5 s by default).
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="ortq-metrics", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def attach(self, metrics: WorkerMetrics) -> None:
        """Serve ``metrics`` from now on: its series on /metrics, its readiness
        (:meth:`WorkerMetrics.set_ready`) on /ready."""
        self._endpoints.attach(metrics)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    # A scrape that hangs on a slow Redis must not hold up /ready or /live, nor the process's exit.
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes come every few seconds: logging each would drown the worker's log."""


def _text(start_response: StartResponse, status: str, text: str) -> Iterator[bytes]:
    body = (text + "\n").encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
    yield body

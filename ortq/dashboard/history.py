"""The dashboard's charts: what it sampled of each Redis over the last hours, drawn as SVG on the
server (no script, no external asset: the page's content security policy allows neither).

A thread samples every :data:`SAMPLE_SECONDS` (and the first page view samples at once): per model
its queue depth, its jobs answered a second (the rise of its workers' RQ counters of finished and
failed jobs: a worker that leaves takes its counts along, so a fall counts as nothing), the p50 and
p99 of queue-to-answer time over its latest :data:`LATENCY_JOBS` finished jobs (RQ's
``enqueued_at`` and ``ended_at``), and per pool adapter the memory its elastic workers hold
(ortq.pool.status). Samples live in this process only, :data:`KEPT_SAMPLES` of them (6 hours):
a restarted dashboard starts its charts again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis

from ortq import keys
from ortq.info import collect
from ortq.rqcompat import layout
from ortq.rqjob import parse_rq_time

log = logging.getLogger(__name__)

SAMPLE_SECONDS = 10.0
KEPT_SAMPLES = 6 * 3600 // int(SAMPLE_SECONDS)
#: Finished jobs read a sample and model for its latency percentiles.
LATENCY_JOBS = 50
#: The most lines a series keeps (memory bounded whatever names come and go) ...
MOST_LABELS = 200
#: ... and the most a chart draws (those with the highest values; the legend says so).
MOST_LINES = 8
#: Colours of the lines, in order.
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
WIDTH, HEIGHT = 560, 150
#: Pixels kept clear at each edge, so that a point on it is seen whole.
PAD = 6


@dataclass(frozen=True)
class Chart:
    """One chart as the template draws it: its lines' SVG points (numbers only) and legends."""

    title: str
    unit: str
    #: (legend, colour, points "x,y x,y ...", latest value) per line.
    lines: tuple[tuple[str, str, str, float], ...]
    #: Each line's latest point (x, y), marked on the chart (a single sample draws no line).
    marks: tuple[tuple[str, float, float], ...]
    top: float
    span_seconds: float
    left_out: int = 0


class History:
    """Samples of each Redis's models and pools, kept for the charts."""

    def __init__(self, connections: Mapping[str, redis.Redis], heartbeat_seconds: float) -> None:
        self._connections = dict(connections)
        self._heartbeat_seconds = heartbeat_seconds
        self._lock = threading.Lock()
        #: series name -> (label -> deque of (monotonic time, value)).
        self._series: dict[str, dict[str, deque[tuple[float, float]]]] = {}
        self._counts: dict[str, tuple[float, int]] = {}  # model -> (time, answered jobs then)
        self._sampled_at: float | None = None

    def start(self, stop: threading.Event) -> threading.Thread:
        """Sample every SAMPLE_SECONDS in a daemon thread until ``stop`` is set."""

        def loop() -> None:
            while not stop.is_set():
                self.sample()
                stop.wait(SAMPLE_SECONDS)

        thread = threading.Thread(target=loop, name="dashboard-history", daemon=True)
        thread.start()
        return thread

    def sample(self, now: float | None = None) -> None:
        """One sample of every Redis; a Redis that cannot be read adds nothing this time."""
        now = time.monotonic() if now is None else now
        for url, connection in self._connections.items():
            try:
                self._sample(connection, now, prefix="" if len(self._connections) == 1 else f"{url} ")
            except Exception as exc:  # down, or records ortq cannot read: the page says which
                log.debug("no history sample of %s: %s", url, exc)
        with self._lock:
            self._sampled_at = now

    def _sample(self, connection: redis.Redis, now: float, prefix: str) -> None:
        info = collect(connection, self._heartbeat_seconds)
        latencies = _latencies(connection, [m["model"] for m in info["models"]])
        for model in info["models"]:
            label = prefix + model["model"]
            self._add("queued", label, now, float(model["queued"]))
            answered = sum(
                int(w.get("successful_jobs") or 0) + int(w.get("failed_jobs") or 0) for w in model["workers"]
            )
            with self._lock:
                before = self._counts.get(label)
                self._counts[label] = (now, answered)
            if before is not None and now > before[0]:
                self._add("jobs_per_s", label, now, max(0, answered - before[1]) / (now - before[0]))
            if (seen := latencies.get(model["model"])) is not None:
                self._add("p50", label, now, seen[0])
                self._add("p99", label, now, seen[1])
        for pool in info["pools"]:
            for adapter in pool["adapters"]:
                self._add("memory", f"{prefix}{adapter['adapter']}", now, adapter["used_bytes"] / 2**20)

    def _add(self, series: str, label: str, now: float, value: float) -> None:
        """One point of ``label``'s line. A series keeps MOST_LABELS lines: models come and go
        (their names from what producers may write, among others), so a new one replaces the line
        seen last longest ago, and its counts go with it."""
        with self._lock:
            lines = self._series.setdefault(series, {})
            if label not in lines and len(lines) >= MOST_LABELS:
                stale = min(lines, key=lambda name: lines[name][-1][0])
                del lines[stale]
                self._counts.pop(stale, None)
            lines.setdefault(label, deque(maxlen=KEPT_SAMPLES)).append((now, value))

    def charts(self, now: float | None = None) -> list[Chart]:
        """The charts to draw now. The sampling thread keeps them fresh; a page view samples itself
        only when nothing was sampled yet or the last sample is twice its interval old (no thread
        runs: an app made without serve())."""
        now = time.monotonic() if now is None else now
        if self._sampled_at is None or now - self._sampled_at >= 2 * SAMPLE_SECONDS:
            self.sample(now)
        with self._lock:
            series = {
                name: {label: list(points) for label, points in lines.items()} for name, lines in self._series.items()
            }
        specs = [("queued", "Queue depth", "jobs"), ("jobs_per_s", "Jobs answered a second", "jobs/s"),
                 ("p50", "Queue to answer, p50", "s"), ("p99", "Queue to answer, p99", "s"),
                 ("memory", "Memory held by pools' elastic workers", "MiB")]  # fmt: skip
        return [_chart(title, unit, series.get(name, {}), now) for name, title, unit in specs if series.get(name)]


def _chart(title: str, unit: str, lines: Mapping[str, list[tuple[float, float]]], now: float) -> Chart:
    """Lines scaled into WIDTH x HEIGHT less a margin of PAD: time from the oldest sample (at
    least SAMPLE_SECONDS back) to ``now`` left to right, 0 to the highest value bottom to top."""
    ranked = sorted(lines.items(), key=lambda item: -max(v for _, v in item[1]))
    shown, left_out = ranked[:MOST_LINES], max(0, len(ranked) - MOST_LINES)
    start = min(t for _, points in shown for t, _ in points)
    span = max(now - start, SAMPLE_SECONDS)
    top = max(max(v for _, v in points) for _, points in shown) or 1.0
    inner_w, inner_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD
    drawn, marks = [], []
    for n, (label, points) in enumerate(shown):
        scaled = [(PAD + inner_w * (1 - (now - t) / span), PAD + inner_h * (1 - v / top)) for t, v in points]
        colour = PALETTE[n % len(PALETTE)]
        drawn.append((label, colour, " ".join(f"{x:.1f},{y:.1f}" for x, y in scaled), points[-1][1]))
        marks.append((colour, *scaled[-1]))
    return Chart(title, unit, tuple(drawn), tuple(marks), top, span, left_out)


def _latencies(connection: redis.Redis, models: list[str]) -> dict[str, tuple[float, float]]:
    """Per model, the p50 and p99 seconds from enqueue to answer of its latest finished jobs."""
    with connection.pipeline(transaction=False) as pipe:
        for model in models:
            pipe.zrevrange(layout.QueueKeys.of(keys.queue_name(model)).finished, 0, LATENCY_JOBS - 1)
        listed = pipe.execute(raise_on_error=False)
    jobs = {model: cast("list[bytes]", ids) for model, ids in zip(models, listed, strict=True) if isinstance(ids, list)}
    with connection.pipeline(transaction=False) as pipe:  # every model's jobs in one round trip
        for ids in jobs.values():
            for job_id in ids:
                pipe.hmget(keys.job_key(keys.as_text(job_id)), ["enqueued_at", "ended_at"])
        times = iter(pipe.execute(raise_on_error=False))
    found: dict[str, tuple[float, float]] = {}
    for model, ids in jobs.items():
        waits = sorted(w for pair in [next(times) for _ in ids] if (w := _wait(pair)) is not None)
        if waits:
            found[model] = (waits[len(waits) // 2], waits[min(len(waits) - 1, round(0.99 * (len(waits) - 1)))])
    return found


def _wait(pair: Any) -> float | None:
    if not isinstance(pair, list) or len(pair) != 2:
        return None
    enqueued, ended = (parse_rq_time(v) if isinstance(v, bytes) and len(v) <= 64 else None for v in pair)
    if enqueued is None or ended is None:
        return None
    return max(0.0, (ended - enqueued).total_seconds())

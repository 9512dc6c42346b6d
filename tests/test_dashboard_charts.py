"""The dashboard's charts over time and its pools table (ortq/dashboard/history.py): sampled from a
real Redis served by a real worker, drawn as server-side SVG, and rendered by a real Chromium
(a screenshot kept in $ORTQ_ARTIFACTS when set)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis

from ortq import keys
from ortq.dashboard.app import create_app
from ortq.dashboard.history import HEIGHT, MOST_LABELS, MOST_LINES, WIDTH, History
from ortq.localredis import LocalRedis
from ortq.pool import status
from ortq.producer import Producer
from ortq.settings import Settings
from tests.conftest import WorkerProcesses, eventually
from tests.dashboard_support import chromium, need_chromium, start_dashboard

X = np.ones((1, 4), np.float32)


@dataclass
class Served:
    url: str
    connection: redis.Redis
    producer: Producer
    model: str
    idle: str


@pytest.fixture(scope="module")
def served(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A Redis of this module's own (its pool record must be the only one), a tiny model's worker
    that has answered 3 jobs, and a model with 2 queued jobs and no worker."""
    with LocalRedis() as server:
        group = WorkerProcesses(tmp_path_factory.mktemp("charts"))
        model, idle = f"chart-tiny-{os.getpid()}", f"chart-idle-{os.getpid()}"
        producer = Producer(settings=Settings.from_url(server.url), validate=False, allow_unknown_models=True)
        try:
            group.serve(tiny_path, model, server.url)
            for outputs in producer.results(producer.submit_many(model, [{"x": X}] * 3), timeout=60):
                np.testing.assert_array_equal(outputs["y"], X * 2 + 1)
            producer.submit_many(idle, [{"x": X}] * 2)
            yield Served(server.url, producer.connection, producer, model, idle)
        finally:
            group.stop_all()
            producer.close()


def test_samples_give_depth_rate_and_latency(served: Served) -> None:
    history = History({served.url: served.connection}, Settings.heartbeat_seconds)
    history.sample(now=100.0)
    jobs = served.producer.submit_many(served.model, [{"x": X}] * 6)
    served.producer.results(jobs, timeout=60)
    # RQ's counters land just after the answers: sampled once the worker's count says 9
    worker = f"rq:worker:{served.producer.workers(served.model)[0]['name']}"
    eventually(lambda: served.connection.hget(worker, "successful_job_count") == b"9", what="RQ's count of 9 jobs")
    history.sample(now=110.0)
    charts = {c.title: c for c in history.charts(now=110.0)}
    assert set(charts) >= {"Queue depth", "Jobs answered a second", "Queue to answer, p50", "Queue to answer, p99"}
    rate = {label: latest for label, _, _, latest in charts["Jobs answered a second"].lines}
    assert rate[served.model] == pytest.approx(0.6)  # 6 jobs in 10 s
    depth = {label: latest for label, _, _, latest in charts["Queue depth"].lines}
    assert depth == {served.model: 0.0, served.idle: 2.0}
    p50 = {label: latest for label, _, _, latest in charts["Queue to answer, p50"].lines}
    p99 = {label: latest for label, _, _, latest in charts["Queue to answer, p99"].lines}
    assert 0 <= p50[served.model] <= p99[served.model] < 60
    for chart in charts.values():  # every point inside the drawing
        for _, _, points, _ in chart.lines:
            for x, y in (map(float, p.split(",")) for p in points.split()):
                assert 0 <= x <= WIDTH and 0 <= y <= HEIGHT, (chart.title, points)


def test_the_page_draws_the_charts_and_the_pools(served: Served) -> None:
    record = status.PoolStatus("host.1").record({"cpu (test)": 100 * 2**20}, [
        status.WorkerNow("m.0", served.model, "cpu (test)", "serving", 60 * 2**20, "it has waiting jobs"),
    ])  # fmt: skip
    served.connection.set(status.pool_key("host.1"), json.dumps(record))
    served.connection.sadd(status.POOLS_SET, "host.1")
    try:
        client = create_app(Settings.from_url(served.url)).test_client()
        html = client.get("/").get_data(as_text=True)
    finally:
        served.connection.delete(status.pool_key("host.1"))
        served.connection.srem(status.POOLS_SET, "host.1")
    assert re.search(r'<figure class="chart" data-chart="Queue depth">', html), html
    assert re.search(r'<polyline fill="none" stroke="#[0-9a-f]{6}" stroke-width="1.5"\s+points="[\d., ]+"/>', html)
    assert f"{served.idle} 2" in html  # the legend's latest value
    row = re.search(r'<tr class="pool" data-pool="host.1" data-adapter="cpu \(test\)">(.*?)</tr>', html, re.S)
    assert row is not None, html
    assert '<td data-field="budget">100 MiB</td>' in row.group(1) and '<td data-field="used">60 MiB</td>' in row.group(
        1
    )
    assert f'<td data-field="resident">{served.model}</td>' in row.group(1)


def test_chromium_renders_the_charts(served: Served, tmp_path: Path) -> None:
    need_chromium()
    dashboard = start_dashboard(served.url, tmp_path)
    try:
        artifacts = Path(os.environ.get("ORTQ_ARTIFACTS") or tmp_path)
        artifacts.mkdir(parents=True, exist_ok=True)
        screenshot = artifacts / "dashboard-charts.png"
        dom = chromium(f"--screenshot={screenshot}", "--window-size=1280,1400", "--dump-dom", dashboard.url,
                       user_data_dir=tmp_path / "c")  # fmt: skip
        dashboard.check_no_pickle()
    finally:
        dashboard.stop()
    assert 'data-chart="Queue depth"' in dom and "<polyline" in dom, dom[:4000]
    assert keys.queue_name(served.idle) in dom
    assert screenshot.stat().st_size > 10_000 and screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_series_keeps_a_bounded_number_of_lines() -> None:
    """Model names come and go (a producer may make queues of any name): past MOST_LABELS lines a
    series forgets the one seen last longest ago, so hours of new names hold bounded memory."""
    history = History({}, Settings.heartbeat_seconds)
    for n in range(MOST_LABELS + 500):
        history._add("queued", f"junk-{n}", float(n), 1.0)
    [chart] = history.charts(now=float(MOST_LABELS + 500))
    assert len(chart.lines) == MOST_LINES and chart.left_out == MOST_LABELS - MOST_LINES
    assert all(int(label.split("-")[1]) >= 500 for label, _, _, _ in chart.lines)  # the newest kept

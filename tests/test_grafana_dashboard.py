"""deploy/grafana/ortq-dashboard.json: a well-formed dashboard whose PromQL only names metrics
that ortq.metrics (the workers) and ortq.exporter (``ortq exporter``) expose, so that renaming a
metric without the dashboard fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ortq import exporter
from ortq.metrics import METRIC_NAMES, WorkerMetrics
from ortq.pool import status

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "ortq-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}

# PromQL words that look like identifiers but are not metric names.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
# Clauses whose parentheses hold label names, not expressions.
_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    aggregations, keywords, label names or Grafana variables."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # string literals ("$model", regexes)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery windows
    expr = _LABEL_LISTS.sub("", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables ($__rate_interval)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if not expr[match.end() :].lstrip().startswith("(") and match.group() not in _KEYWORDS:
            names.add(match.group())
    return names


def exposed_series() -> set[str]:
    """Every name PromQL may use: METRIC_NAMES, plus _bucket/_sum/_count of the histograms
    (their types read from a live WorkerMetrics registry, not assumed from the names), and the
    exporter's gauges (tests/test_exporter.py scrapes them from a real ``ortq exporter``)."""
    metrics = WorkerMetrics("m", "cpu", "CPUExecutionProvider", "w", queue_depth=lambda: 0)
    types = {family.name: family.type for family in metrics.registry.collect()}
    series = set(METRIC_NAMES)
    for name in METRIC_NAMES:
        assert name in types or name.removesuffix("_total") in types, f"{name} is not registered"
        if types.get(name) == "histogram":
            series |= {name + "_bucket", name + "_sum", name + "_count"}
    return series | set(exporter.METRIC_NAMES)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_metric_name_extraction() -> None:
    """The extractor finds renamed metrics and foreign ones, and nothing else."""
    expr = (
        'histogram_quantile(0.95, sum by (model, le) (rate(ortq_renamed_bucket{model=~"$model", a="b{c}"}[5m])))'
        " / on(model) group_left(worker) up offset 5m and bool max without (x) (node_load1[$__rate_interval])"
    )
    assert metric_names(expr) == {"ortq_renamed_bucket", "up", "node_load1"}
    assert "ortq_renamed_bucket" not in exposed_series()
    assert "ortq_batch_size_bucket" in exposed_series()
    assert "ortq_queue_depth_bucket" not in exposed_series()  # a gauge has no buckets


def test_dashboard_structure(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"] and dashboard["uid"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["model"]["type"] == "query" and variables["model"]["datasource"] == DATASOURCE
    panels = dashboard["panels"]
    assert len(panels) >= 6
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["type"] and panel["title"]
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")) and grid["x"] + grid["w"] <= 24
        assert panel["datasource"] == DATASOURCE
        targets = panel["targets"]
        assert targets, panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets)
        for target in targets:
            assert target["datasource"] == DATASOURCE
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_every_queried_metric_is_exposed(dashboard: dict[str, Any]) -> None:
    exposed = exposed_series()
    variable_queries = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used: set[str] = set()
    for query in variable_queries:
        selector = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
        assert selector, query
        used |= metric_names(selector.group(1))
    for expr in exprs(dashboard):
        names = metric_names(expr)
        assert names, expr
        assert names <= exposed, f"{expr} uses {names - exposed}, which ortq.metrics does not expose"
        used |= names
    # Every metric is on the dashboard somewhere.
    histograms = {n.removesuffix(s) for n in used for s in ("_bucket", "_sum", "_count") if n.endswith(s)}
    assert set(METRIC_NAMES) <= used | histograms
    assert set(exporter.METRIC_NAMES) <= used


#: The pool records' series that belong to a pool or an adapter, not a model.
POOL_WIDE = {status.POOL_BUDGET, status.POOL_USED, status.POOL_EVICTIONS, status.POOL_COLD_STARTS}


def test_every_selector_follows_the_model_variable(dashboard: dict[str, Any]) -> None:
    for expr in exprs(dashboard):
        for match in re.finditer(r"(ortq_\w+)(\{[^}]*\})?", expr):
            if match.group(1) == exporter.REDIS_UP:  # per Redis, of no model
                continue
            if match.group(1) in POOL_WIDE:  # per pool and adapter, of no model
                continue
            assert 'model=~"$model"' in (match.group(2) or ""), f"{match.group(1)} in {expr}"


def test_the_asked_for_panels(dashboard: dict[str, Any]) -> None:
    joined = "\n".join(exprs(dashboard))
    for histogram in ("ortq_inference_queue_duration_seconds", "ortq_inference_compute_duration_seconds"):
        for quantile in ("0.5", "0.95"):
            assert f"histogram_quantile({quantile}, sum by (model, le) (rate({histogram}_bucket{{" in joined
    assert "sum by (model, reason) (rate(ortq_inference_request_failure_total{" in joined
    assert "sum by (model, adapter) (ortq_worker_ready{" in joined
    # Every worker of a model reports the same queue: summing would multiply it by the workers.
    assert "max by (model) (ortq_queue_depth{" in joined
    assert "sum by (model) (ortq_queue_depth" not in joined


def test_the_queue_panels_use_the_exporter(dashboard: dict[str, Any]) -> None:
    """The queue is read from the exporter, whose series exist with no worker running (scaled to
    zero); the model variable too, so that a model with no worker can be chosen."""
    joined = "\n".join(exprs(dashboard))
    for gauge in (exporter.QUEUE_LENGTH, exporter.RUNNING, exporter.OLDEST_AGE, exporter.WORKERS_ALIVE):
        assert f"max by (model) ({gauge}{{" in joined, gauge  # one exporter per Redis: max, not sum
        assert f"sum by (model) ({gauge}" not in joined
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["model"]["query"]["query"] == f"label_values({exporter.QUEUE_LENGTH}, model)"
    [queue_panel] = [p for p in dashboard["panels"] if any(exporter.QUEUE_LENGTH in t["expr"] for t in p["targets"])]
    assert any("ortq_queue_depth" in t["expr"] for t in queue_panel["targets"]), "the workers' view beside it"

"""The ortq page: models, their workers (provider, adapter, ready state), queue depths, failures.

Everything comes from :func:`ortq.info.collect` plus each model's latest failures, read as
plain strings from RQ's failed registry and result stream: nothing here deserializes a job.
The page is server-rendered with no script and no external assets (the dashboard may run on a
machine without internet access); it reloads itself every few seconds. Whatever it shows from
Redis, Jinja escapes; a record it cannot read is shown as such (``problem``), not a 500.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, cast

import redis
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.results import Result

from ortq.dashboard.records import describe, exception_text, text
from ortq.info import collect, heartbeat_text, misplaced, served_versions, state_text
from ortq.redisurls import redacted_url
from ortq.settings import REDIS_DOWN
from ortq.shards import ShardMap

#: Failures listed per model, newest first.
FAILURES_SHOWN = 10
_REASON_CHARS = 300
#: RQ worker states in which a worker that has published its ortq record takes jobs.
READY_STATES = ("idle", "busy")


def _reason(exc_string: str) -> str:
    """The line that names the error: ortq's own ``Type: message``, or a traceback's last line."""
    lines = [line.strip() for line in exc_string.splitlines() if line.strip()]
    reason = lines[-1] if lines else "(no reason recorded)"
    return reason if len(reason) <= _REASON_CHARS else reason[: _REASON_CHARS - 1] + "…"


def recent_failures(connection: redis.Redis, queue: str, limit: int = FAILURES_SHOWN) -> list[dict[str, Any]]:
    """The latest failed jobs of ``queue``: id, when it ended and why, newest first."""
    registry_key = FailedJobRegistry(queue, connection=connection).key
    # Scores are expiry times (end + failure_ttl): the highest ended last when ttls are equal.
    job_ids = [text(i) or "" for i in cast("list[bytes]", connection.zrevrange(registry_key, 0, limit - 1))]
    with connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hmget(Job.key_for(job_id), ["ended_at", "exc_info"])
            pipe.xrevrange(cast("str", Result.get_key(job_id)), count=1)  # type: ignore[no-untyped-call]
        replies = pipe.execute(raise_on_error=False)  # a key of another type fails that job's line only
    failures = []
    for i, job_id in enumerate(job_ids):
        record, latest = replies[2 * i], replies[2 * i + 1]
        if isinstance(record, Exception) or isinstance(latest, Exception):
            wrong = record if isinstance(record, Exception) else latest
            failures.append({"job_id": job_id, "ended_at": None, "reason": f"cannot be read: {describe(wrong)}"})
            continue
        ended_at, exc_info = record
        exc_string = exception_text(latest[0][1].get(b"exc_string")) if latest else exception_text(exc_info)
        failures.append({"job_id": job_id, "ended_at": text(ended_at), "reason": _reason(exc_string)})
    return failures


def page_context(connections: Mapping[str, redis.Redis], shards: ShardMap, heartbeat_seconds: float) -> dict[str, Any]:
    """What :data:`TEMPLATE` renders: a section per Redis of the shard map (``connections``: URL ->
    client, the default first; one without a map), and the map's warnings (:func:`misplaced`).
    ``heartbeat_seconds``: the interval by which a worker whose record does not say is judged gone.

    A Redis that cannot be reached raises for a single Redis (the app's 503 page); with several,
    its section says so and the others are shown."""
    sections, warnings = [], []
    for index, (url, connection) in enumerate(connections.items()):
        try:
            section = _section(connection, heartbeat_seconds)
        except REDIS_DOWN as exc:
            if len(connections) == 1:
                raise
            section = {"models": [], "problem": f"cannot reach this Redis: {exc}"}
        section.update(index=index, url=redacted_url(url))
        sections.append(section)
        warnings += [warning for model in section["models"] if (warning := misplaced(model, url, shards))]
    return {
        "sections": sections,
        "warnings": warnings,
        "redis_urls": ", ".join(redacted_url(url) for url in connections),
        "now": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "ready_states": READY_STATES,
        "state_text": state_text,  # as `ortq info` words them
        "heartbeat_text": heartbeat_text,
    }


def _section(connection: redis.Redis, heartbeat_seconds: float) -> dict[str, Any]:
    """One Redis's models, with their latest failures. A record ortq cannot read fills ``problem``
    instead of failing the page: ``ortq info`` reads Redis as a whole, so one forged record hides
    the models."""
    section: dict[str, Any] = {"models": [], "problem": None, "pools": []}
    try:
        info = collect(connection, heartbeat_seconds)
        section["models"], section["pools"] = info["models"], info["pools"]
    except REDIS_DOWN:
        raise
    except Exception as exc:
        section["problem"] = (
            f"ortq's records in this Redis cannot be read ({describe(exc)}): something other than ortq wrote them"
        )
        return section
    for model in section["models"]:
        model["served_versions"] = served_versions(model)  # a parked version not among them waits for nothing
        try:
            model["recent_failures"] = recent_failures(connection, model["queue"]) if model["failed"] else []
        except REDIS_DOWN:
            raise
        except Exception as exc:
            model["recent_failures"] = [{"job_id": "?", "ended_at": None, "reason": f"cannot be read: {describe(exc)}"}]
    return section


TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="refresh" content="{{ refresh_seconds }}">
<title>ortq dashboard</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
header { display: flex; gap: 1.5em; align-items: baseline; border-bottom: 1px solid #ccc; }
h1 { font-size: 1.4em; margin: 0 0 .4em; }
h2 { font-size: 1.15em; margin: 1.4em 0 .4em; }
h3 { font-size: 1em; margin: .9em 0 .3em; }
.muted { color: #777; }
.counts { display: flex; gap: .8em; }
.counts div { border: 1px solid #ddd; border-radius: 4px; padding: .3em .8em; min-width: 5em; }
.counts dd { font-size: 1.5em; margin: 0; }
.counts dt a { color: #666; }
.nowrap { white-space: nowrap; }
table { border-collapse: collapse; margin: .3em 0; }
th, td { border-bottom: 1px solid #e5e5e5; padding: .25em .7em; text-align: left; vertical-align: top; }
th { background: #f5f5f5; }
.ready { color: #176f2c; font-weight: 600; }
.notready, .bad { color: #b3261e; font-weight: 600; }
code { font-size: .95em; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
figure.chart { margin: 0; }
figure.chart figcaption { font-weight: 600; }
.legend { margin: .2em 0; max-width: 560px; }
</style>
</head>
<body>
<header>
<h1>ortq dashboard</h1>
<span class="muted">Redis {{ redis_urls }}</span>
<span class="muted">updated {{ now }}, every {{ refresh_seconds }} s</span>
<a href="{{ rq_url }}">RQ queues, jobs, workers</a>
<a href="{{ url_for('api_info') }}">JSON</a>
</header>
{% for w in warnings %}<p class="bad warning">WARNING: {{ w }}</p>
{% endfor %}
{% if charts %}<section id="charts"><h2>Over time <span class="muted">(sampled by this dashboard every
{{ '%g' % sample_seconds }} s while it runs)</span></h2><div class="charts">
{% for c in charts %}<figure class="chart" data-chart="{{ c.title }}">
<figcaption>{{ c.title }} <span class="muted">(0 to {{ '%.3g' % c.top }} {{ c.unit }}, the last
{{ (c.span_seconds / 60) | round(1) }} min)</span></figcaption>
<svg viewBox="0 0 {{ chart_size[0] }} {{ chart_size[1] }}" width="{{ chart_size[0] }}" height="{{ chart_size[1] }}"
 role="img" aria-label="{{ c.title }}"><rect width="100%" height="100%" fill="#fafafa" stroke="#ddd"/>
<line x1="0" y1="{{ chart_size[1] / 2 }}" x2="{{ chart_size[0] }}" y2="{{ chart_size[1] / 2 }}" stroke="#eee"/>
{% for label, colour, points, latest in c.lines %}<polyline fill="none" stroke="{{ colour }}" stroke-width="1.5"
 points="{{ points }}"/>{% endfor %}
{% for colour, x, y in c.marks %}<circle cx="{{ '%.1f' % x }}" cy="{{ '%.1f' % y }}" r="3" fill="{{ colour }}"/>
{% endfor %}</svg>
<p class="legend">{% for label, colour, points, latest in c.lines %}<span class="nowrap"><span
 style="color: {{ colour }}">&#9632;</span> {{ label }} {{ '%.3g' % latest }}</span> {% endfor %}
{%- if c.left_out %}<span class="muted">({{ c.left_out }} more not drawn)</span>{% endif %}</p>
</figure>
{% endfor %}</div></section>{% endif %}
{% for r in sections %}
{% if sections | length > 1 %}<h2 class="redis" data-redis="{{ r.index }}">Redis {{ r.url }}</h2>{% endif %}
{% if r.problem %}<p id="problem" class="bad">{{ r.problem }}</p>
{% elif not r.models %}<p id="empty">No ortq models, queues or workers in this Redis.</p>{% endif %}
{% if r.pools %}<section id="pools"><h2>pools that follow their queues</h2>
<table>
<tr><th>pool</th><th>adapter</th><th>budget</th><th>held</th><th>resident models</th><th>workers</th><th>evictions</th>
<th>cold starts</th></tr>
{% for p in r.pools %}{% for a in p.adapters %}
<tr class="pool" data-pool="{{ p.pool }}" data-adapter="{{ a.adapter }}">
<td>{{ p.pool }}</td><td>{{ a.adapter }}</td>
<td data-field="budget">{{ '%.0f MiB' % (a.budget_bytes / 1048576) if a.budget_bytes is number else 'none' }}</td>
<td data-field="used">{{ '%.0f MiB' % (a.used_bytes / 1048576) }}</td>
<td data-field="resident">{{ (a.resident or []) | join(', ') or '-' }}</td>
<td data-field="workers">{% for w in a.workers %}<span class="nowrap">{{ w.model }} {{ w.state }}</span>
{%- if w.why %} <span class="muted">({{ w.why }})</span>{% endif %}{{ '; ' if not loop.last }}
{%- else %}-{% endfor %}</td>
<td data-field="evictions">{{ p.evictions }}</td><td data-field="cold_starts">{{ p.cold_starts }}</td>
</tr>
{% endfor %}{% endfor %}
</table></section>{% endif %}
{% for m in r.models %}
<section class="model" data-model="{{ m.model }}" data-redis="{{ r.index }}">
<h2>model <code>{{ m.model }}</code> <span class="muted">queue {{ m.queue }}</span></h2>
<dl class="counts">
{% for field in ("queued", "started", "finished", "failed") %}
<div><dd data-field="{{ field }}" class="{{ 'bad' if field == 'failed' and m[field] else '' }}">{{ m[field] }}</dd>
<dt><a href="{{ url_for('rq_dashboard.jobs_overview', instance_number=r.index, queue_name=m.queue, registry_name=field,
 per_page=8, order='asc', page=1) }}">{{ field }}</a></dt></div>
{% endfor %}
</dl>
{% if m.parked %}<p data-field="parked">parked: {% for version, count in m.parked.items() %}{{ count }}
{{- ' jobs' if count != 1 else ' job' }} pinned to version <code>{{ version }}</code>
{%- if version not in m.served_versions %} <span class="bad">(no worker serves it)</span>{% endif %}
{{- ', ' if not loop.last }}
{%- endfor %} <span class="muted">(taken off the queue by a worker of another version; a worker of
that version takes them first)</span></p>{% endif %}
{% if m.signature %}
{% if m.signature.version is string %}<p>current version <code data-field="version">{{ m.signature.version }}</code>
<span class="muted">(that of the worker that started last)</span></p>{% endif %}
<p>{% for kind in ("inputs", "outputs") %}{{ kind }}:
{% for s in m.signature[kind] %}<code>{{ s.name }}: {{ s.dtype }}
{%- if s.any_shape is sameas true %} (any shape){% else %}[
{%- for d in s.shape %}{{ '?' if d is none else d }}{{ ', ' if not loop.last }}{% endfor %}]{% endif %}</code>
{% endfor %}<br>{% endfor %}</p>
{% endif %}
<h3>workers ({{ m.workers | length }})</h3>
{% if m.workers %}
<table>
<tr><th>worker</th><th>version</th><th>ready</th><th>state</th><th>provider</th><th>adapter</th><th>host / pid</th>
<th>ok</th><th>failed</th><th>current job</th><th>last heartbeat</th></tr>
{% for w in m.workers %}
<tr class="worker" data-worker="{{ w.name }}">
<td data-field="name">{{ w.name }}</td>
<td data-field="version">{{ w.version or "?" }}</td>
{% if w.state in ready_states %}<td data-field="ready" class="ready">ready</td>
{% else %}<td data-field="ready" class="notready">not ready</td>{% endif %}
<td data-field="state"{% if w.state == "gone" %} class="bad"{% endif %}>{{ state_text(w) }}</td>
<td data-field="provider">{{ w.provider or "?" }}{% if w.fell_back_to_cpu %}
<span class="bad">(CPU fallback: {{ w.requested_provider or "?" }} was unavailable)</span>{% endif %}</td>
<td data-field="adapter">{% if w.adapter %}{{ w.adapter.name or w.adapter.spec }}
{%- elif w.provider == "CPUExecutionProvider" %}cpu{% else %}-{% endif %}
{% if w.device_id is not none %}<span class="muted">(device {{ w.device_id }})</span>{% endif %}</td>
<td data-field="host">{{ w.host or "?" }} / {{ "?" if w.pid is none else w.pid }}</td>
<td data-field="successful_jobs">{{ w.successful_jobs }}</td>
<td data-field="failed_jobs">{{ w.failed_jobs }}</td>
<td data-field="current_job">{% if w.current_job %}<a href="{{ job_url(w.current_job, r.index) }}">{{
 w.current_job }}</a>{% else %}-{% endif %}</td>
<td data-field="heartbeat" class="nowrap">{{ heartbeat_text(w) }}</td>
</tr>
{% endfor %}
</table>
{% elif m.queued %}<p class="bad" data-field="no_workers">no workers: {{ m.queued }}
{{- ' jobs wait' if m.queued != 1 else ' job waits' }} in the queue</p>
{% else %}<p class="muted" data-field="no_workers">no workers</p>{% endif %}
{% if m.recent_failures %}
<h3>latest failures</h3>
<table>
<tr><th>job</th><th>ended</th><th>reason</th></tr>
{% for f in m.recent_failures %}
<tr class="failure" data-job="{{ f.job_id }}">
<td class="nowrap"><a href="{{ job_url(f.job_id, r.index) }}">{{ f.job_id }}</a></td>
<td class="nowrap">{{ (f.ended_at or "-")[:19] | replace("T", " ") }}</td>
<td data-field="reason">{{ f.reason }}</td>
</tr>
{% endfor %}
</table>
{% endif %}
</section>
{% endfor %}
{% endfor %}
</body>
</html>
"""

UNREACHABLE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="{{ refresh_seconds }}">
<title>ortq dashboard: Redis unreachable</title></head>
<body><p>cannot reach Redis at {{ where }}: {{ error }}</p><p>Trying again every {{ refresh_seconds }} s.</p></body>
</html>
"""

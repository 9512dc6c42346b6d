"""ortq's versions of four rq-dashboard views, and a guard around all of them.

* ``job_info`` and ``list_workers`` (the JSON behind the job and workers pages) read each record
  leniently and add an ``unreadable`` line saying what of it could not be read; rq-dashboard's
  answered 500 on the first field RQ could not parse, a current job whose record had expired, or
  a ``meta`` that JSON cannot hold.
* ``requeue_job_view`` and ``requeue_all`` refuse ortq jobs, with the reason: an ortq job's request
  tensors are deleted when it ends, so a requeued copy could only fail again with RequestExpired.
* every rq-dashboard view runs inside :func:`guarded`: a job that does not exist is a 404, and
  anything else a page cannot be built from (say a registry that is not a sorted set) is logged
  and explained on the page (HTML: 200; JSON: 502, which the page's script shows) instead of a
  bare 500.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any

import redis
import rq.job
from flask import Flask, Response, current_app, jsonify, make_response, render_template_string, request, url_for
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.registry import FailedJobRegistry
from rq_dashboard import web
from werkzeug.exceptions import HTTPException

from ortq import keys
from ortq.dashboard.records import describe
from ortq.dashboard.rqdash import DashboardWorker, MetaEncoder, fetch, is_ortq_job, worker_keys
from ortq.errors import ConfigurationError

log = logging.getLogger(__name__)

#: The registries rq-dashboard's job lists know ("queued" is the queue itself).
REGISTRIES = frozenset({"queued", "scheduled", "deferred", "started", "finished", "failed", "canceled"})
#: Most jobs one page of a job list may ask for, and most dependencies a job page lists.
MAX_PER_PAGE = 1000

PROBLEM_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ortq dashboard: {{ title }}</title></head>
<body><h1>{{ title }}</h1><p id="problem">{{ message }}</p><p><a href="{{ back }}">RQ queues</a></p></body></html>
"""


def problem(status: int, message: str, html_status: int | None = None) -> Response:
    """Why a page or its data cannot be shown: JSON for the pages' scripts (``.json`` paths and
    actions), a short page otherwise."""
    if request.path.endswith(".json") or request.method == "POST":
        response = jsonify(status="ERROR", message=message)
        response.status_code = status
        return response
    title = "not found" if status == 404 else "cannot show this page"
    back = url_for("rq_dashboard.queues_overview")
    html = render_template_string(PROBLEM_PAGE, title=title, message=message, back=back)
    return make_response(html, html_status or status)


def refused(message: str) -> Response:
    response = jsonify(status="REFUSED", message=message)
    response.status_code = 409
    return response


def guarded(view: Callable[..., Any]) -> Callable[..., Any]:
    """``view``, answering what is wrong instead of raising (Redis down: the app's 503 page)."""

    @functools.wraps(view)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return view(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, HTTPException):
            raise
        except NoSuchJobError:
            job_id = kwargs.get("job_id")
            return problem(404, f"no job {job_id!r} in this Redis: it expired, was deleted or never existed")
        except Exception as exc:
            log.exception("%s %s: cannot be built from what Redis holds", request.method, request.path)
            return problem(502, f"this page cannot be built from what Redis holds: {describe(exc)}", html_status=200)

    return run


def check_arguments() -> Response | None:
    """Refuse (404) what rq-dashboard's views would fail on: a Redis instance this dashboard does
    not serve, an unknown registry, a page size or page number that is not a positive integer."""
    args = request.view_args or {}
    served = len(current_app.config["RQ_DASHBOARD_REDIS_URL"])
    if not 0 <= (instance := args.get("instance_number", 0)) < served:
        return problem(404, f"no Redis instance {instance}: this dashboard serves {served} (0 to {served - 1})")
    if "registry_name" in args and args["registry_name"] not in REGISTRIES:
        return problem(404, f"no registry {args['registry_name']!r}; there are {', '.join(sorted(REGISTRIES))}")
    for name, most in (("per_page", MAX_PER_PAGE), ("page", 10**9)):
        value = str(args.get(name, 1))
        if not (value.isascii() and value.isdigit() and len(value) < 10 and 1 <= int(value) <= most):
            return problem(404, f"{name} must be a whole number from 1 to {most}")
    return None


def job_info(instance_number: int, job_id: str) -> dict[str, Any]:
    """The job page's data: rq-dashboard's fields, plus ``unreadable``."""
    connection = current_app.redis_conn  # type: ignore[attr-defined]
    job = fetch(job_id, connection)
    latest = job.latest_result()
    info: dict[str, Any] = {
        "id": job.id,
        "created_at": web.serialize_date(job.created_at),
        "enqueued_at": web.serialize_date(job.enqueued_at),
        "started_at": web.serialize_date(job.started_at),
        "ended_at": web.serialize_date(job.ended_at),
        "origin": job.origin,
        "status": str(job.get_status().value),
        "result": _jsonable(job.return_value()),
        "exc_info": latest.exc_string if latest else (job.exc_text or None),
        "description": web.format_job_description(job),
        "metadata": _json_text(job.get_meta()),
    }
    try:
        dependencies = [keys.as_text(key).split(":")[-1] for key in job.dependency_ids][:MAX_PER_PAGE]
    except (TypeError, ValueError, redis.ResponseError) as exc:  # RQ 2.12 reads a set <job key>:dependencies
        job.note(f"the dependencies cannot be read ({describe(exc)})")
        dependencies = []
    if dependencies:
        info["depends_on"] = dependencies
        info["depends_on_status"] = [
            "active" if connection.exists(rq.job.Job.key_for(d)) else "expired" for d in dependencies
        ]
    if job.unreadable:
        info["unreadable"] = "; ".join(job.unreadable)
    if is_ortq_job(job):
        info["requeue_refused"] = True  # the patched page then shows no Requeue button (templates.py)
    return info


def _jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it (bytes by their size), else its repr."""
    try:
        return json.loads(_json_text(value, strict=True))
    except (TypeError, ValueError):
        return repr(value)[:1000]


def _json_text(value: Any, strict: bool = False) -> str:
    try:
        return json.dumps(value, cls=MetaEncoder, allow_nan=False)
    except (TypeError, ValueError) as exc:
        if strict:
            raise
        return json.dumps({"unreadable": f"cannot be shown as JSON ({describe(exc)}): {repr(value)[:300]}"})


def list_workers(instance_number: int) -> dict[str, Any]:
    """The workers page's data: rq-dashboard's fields, plus ``unreadable``."""
    connection = current_app.redis_conn  # type: ignore[attr-defined]
    rows: list[dict[str, Any]] = []
    for key, wrong in worker_keys(connection):
        if key is None:
            rows.append({"name": "?", "pid": None, "queues": [], "state": "?", "current_job": "idle",
                         "unreadable": wrong})  # fmt: skip
            continue
        worker = DashboardWorker.find_by_key(key, connection=connection)
        if isinstance(worker, DashboardWorker):
            rows.append(_worker_row(worker))
    rows.sort(key=lambda w: (w["state"], w["queues"], w["name"]))
    return {"workers": rows}


def _worker_row(worker: DashboardWorker) -> dict[str, Any]:
    notes = list(worker.unreadable)
    current: Any = "idle"
    try:
        job_id = worker.get_current_job_id()
    except Exception as exc:  # RQ 3 reads it from its execution records
        notes.append(f"the current job cannot be read ({describe(exc)})")
        job_id = None
    if job_id:
        current = {"job_id": job_id, "description": "(its record is gone)", "created_at": None, "call_string": job_id}
        try:
            job = fetch(job_id, worker.connection)
        except NoSuchJobError:
            pass
        else:
            try:
                call_string = job.get_call_string()
            except Exception:  # data ortq cannot decode: the description says what RQ was told
                call_string = job.description or job_id
            current.update(
                description=job.description, created_at=web.serialize_date(job.created_at), call_string=call_string
            )
    row = {
        "name": worker.name,
        "pid": worker.pid,
        "queues": [queue.name for queue in worker.queues],
        "state": str(worker.get_state()),
        "current_job": current,
        "last_heartbeat": worker.last_heartbeat,
        "birth_date": worker.birth_date,
        "successful_job_count": worker.successful_job_count,
        "failed_job_count": worker.failed_job_count,
        "total_working_time": worker.total_working_time,
        "version": getattr(worker, "version", ""),
        "python_version": getattr(worker, "python_version", ""),
    }
    if notes:
        row["unreadable"] = "; ".join(notes)
    return row


def requeue_refusal(job: rq.job.Job) -> str | None:
    """Why ``job`` must not be requeued, or None. ortq jobs (an ortq queue's, or naming ortq's
    job function) must not: their request tensors were deleted when they ended."""
    if not is_ortq_job(job):
        return None
    return (
        f"job {job.id} is an ortq job: its request tensors were deleted when it ended, so a requeued copy could "
        "only fail with RequestExpired. Submit it again from the producer (submit(..., retries=N) retries failures)."
    )


def requeue_job_view(job_id: str) -> Any:
    job = fetch(job_id, current_app.redis_conn)  # type: ignore[attr-defined]
    refusal = requeue_refusal(job)
    if refusal is not None:
        return refused(refusal)
    try:
        job.requeue()
    except InvalidJobOperation as exc:  # not in its queue's failed registry
        return refused(f"job {job_id} cannot be requeued: {exc}")
    return {"status": "OK"}


def requeue_all(queue_name: str) -> Any:
    if keys.model_from_queue_name(queue_name) is not None:
        return refused(
            f"queue {queue_name} is an ortq queue: nothing was requeued. Its jobs' request tensors were deleted "
            "when they failed, so requeued copies could only fail with RequestExpired; submit them again."
        )
    connection = current_app.redis_conn  # type: ignore[attr-defined]
    count = skipped = 0
    for job_id in FailedJobRegistry(queue_name, connection=connection).get_job_ids(cleanup=False):
        try:
            job = fetch(job_id, connection)
            if requeue_refusal(job) is None:
                job.requeue()
                count += 1
                continue
        except (NoSuchJobError, InvalidJobOperation):
            pass
        skipped += 1
    return {"status": "OK", "count": count, "skipped": skipped}


_VIEWS: dict[str, Callable[..., Any]] = {
    "job_info": job_info,
    "list_workers": list_workers,
    "requeue_job_view": requeue_job_view,
    "requeue_all": requeue_all,
}


def install_views(app: Flask) -> None:
    """Put ortq's views in place of rq-dashboard's (its blueprint registered on ``app``) and guard
    every one of them; refuse an rq-dashboard whose views are not the ones this was written for."""
    missing = [name for name in _VIEWS if f"{web.blueprint.name}.{name}" not in app.view_functions]
    if missing:
        raise ConfigurationError(f"rq-dashboard has no view {', '.join(missing)}: ortq was checked on rq-dashboard 0.9")
    for endpoint, view in list(app.view_functions.items()):
        blueprint, _, name = endpoint.partition(".")
        if blueprint == web.blueprint.name and name != "static":
            app.view_functions[endpoint] = guarded(_VIEWS.get(name, view))

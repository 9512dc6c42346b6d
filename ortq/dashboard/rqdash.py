"""rq-dashboard's blueprint, made to read Redis with ortq's serializer and job class only.

rq-dashboard (0.9) has one serializer setting, ``rq_dashboard.web.config.serializer`` (what its
own ``--json`` flag sets). It reaches the job lists and the job JSON, but not every path:

* the job page and "delete" call ``Job.fetch`` without a serializer, so RQ's pickle default
  restores the job's ``meta`` (a job hash anyone with Redis access can write);
* "requeue" goes through ``rq.requeue_job``, again with the pickle default;
* the workers page builds workers with ``Worker.all`` and asks each for its current job, whose
  ``data`` they decode with their own serializer: pickle.

Those are names in the module ``rq_dashboard.web``; :func:`install` points them at the classes
below, whose serializer is msgpack and whose job class is :class:`~ortq.rqjob.OrtqJob`, whatever
a caller passes. It also replaces ``from_url``, which rq-dashboard calls on every request for a
new client of its own, with the app's ortq client (ortq's timeouts and TLS checks, one pool).
Its registries are left as they are: rq-dashboard only counts and lists their ids
(``cleanup=False``), which decodes nothing. ``tests/test_dashboard.py`` serves every page
with ``pickle.loads`` made to raise, and shows that the unpatched rq-dashboard does unpickle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis
import redis_sentinel_url
import rq
import rq.job
import rq_dashboard
from flask import Blueprint, current_app
from rq_dashboard import web
from rq_dashboard.version import VERSION as RQ_DASHBOARD_VERSION

from ortq.errors import ConfigurationError
from ortq.rqjob import OrtqJob
from ortq.serializer import MsgpackSerializer
from ortq.settings import redacted_url

#: rq-dashboard's static files (its base template also asks the app for ``favicon.ico``).
STATIC_DIR = Path(rq_dashboard.__file__).parent / "static"


class DashboardJob(OrtqJob):
    """An :class:`OrtqJob` that decodes with msgpack whatever serializer its caller passes."""

    def __init__(self, id: str | None = None, connection: redis.Redis | None = None, serializer: Any = None) -> None:
        super().__init__(id, connection=connection, serializer=MsgpackSerializer)

    def get_meta(self, refresh: bool = True) -> dict[str, Any]:
        # A ``meta`` that is not msgpack was not written by ortq (RQ's restore tolerates it, its
        # get_meta raises): show that instead of failing the job's page.
        try:
            meta: dict[str, Any] = super().get_meta(refresh)
        except Exception:
            return {"unreadable": "meta is not msgpack: this job was not written by ortq"}
        return meta


class DashboardQueue(rq.Queue):
    """An RQ queue whose jobs are :class:`DashboardJob` (``Queue.all`` and ``fetch_job`` included)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.update(job_class=DashboardJob, serializer=MsgpackSerializer)
        super().__init__(*args, **kwargs)


class DashboardWorker(rq.Worker):
    """RQ's view of a worker (only ever read here) whose current job is a :class:`DashboardJob`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.update(job_class=DashboardJob, queue_class=DashboardQueue, serializer=MsgpackSerializer)
        super().__init__(*args, **kwargs)


def requeue_job(job_id: str, connection: redis.Redis, serializer: Any = None) -> rq.job.Job:
    """``rq.requeue_job`` with :class:`DashboardJob`.

    An ortq job's request tensors are deleted when it fails, so a requeued job fails again with
    ``RequestExpired``: resubmitting from the producer is what retries a job.
    """
    return DashboardJob.fetch(job_id, connection=connection).requeue()


_CONNECTION = "ortq.dashboard.connection"  # the app's ortq client, in ``app.extensions``


def app_client(url: str, **options: Any) -> tuple[None, redis.Redis]:
    """rq-dashboard's ``from_url`` (redis_sentinel_url's ``connect``): the app's ortq client."""
    return None, current_app.extensions[_CONNECTION]


# rq_dashboard.web's name -> (what it must be before install, what it becomes).
_REPLACEMENTS: dict[str, tuple[object, object]] = {
    "Job": (rq.job.Job, DashboardJob),
    "Queue": (rq.Queue, DashboardQueue),
    "Worker": (rq.Worker, DashboardWorker),
    "requeue_job": (rq.requeue_job, requeue_job),
    "from_url": (redis_sentinel_url.connect, app_client),
}


def install() -> Blueprint:
    """Make rq-dashboard pickle-free in this process and return its blueprint (idempotent).

    Refuses, rather than serving a half-covered dashboard, when rq-dashboard's module no longer
    names what this replaces (another rq-dashboard version than the 0.9 series it was checked on).
    """
    for name, (original, replacement) in _REPLACEMENTS.items():
        current = getattr(web, name, None)
        if current is not original and current is not replacement:
            raise ConfigurationError(
                f"rq-dashboard {RQ_DASHBOARD_VERSION}: rq_dashboard.web.{name} is not RQ's {name}; "
                "ortq cannot make this version pickle-free (it was checked on rq-dashboard 0.9)"
            )
        setattr(web, name, replacement)
    web.config.serializer = MsgpackSerializer
    blueprint: Blueprint = web.blueprint
    return blueprint


class MetaEncoder(json.JSONEncoder):
    """How the job page shows a job's ``meta``: bytes (what RQ keeps of a meta it could not
    decode) by their size, instead of failing the page."""

    def default(self, o: Any) -> Any:
        if isinstance(o, bytes | bytearray):
            return f"<{len(o)} undecoded bytes>"
        return super().default(o)


def connect_blueprint(app: Any, connection: redis.Redis, redis_url: str) -> None:
    """Make rq-dashboard's blueprint, registered on ``app``, read ``connection`` (of ``redis_url``)."""
    app.extensions[_CONNECTION] = connection
    app.redis_conn = connection  # what its views use (its before_request sets it again, through from_url)
    app.config["RQ_DASHBOARD_REDIS_URL"] = (redacted_url(redis_url),)  # shown on its pages
    app.config["RQ_DASHBOARD_JSON_ENCODER"] = MetaEncoder

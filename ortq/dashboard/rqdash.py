"""rq-dashboard's blueprint, made to read Redis with ortq's serializer and job class only, and to
read any record without failing.

rq-dashboard (0.9) has one serializer setting, ``rq_dashboard.web.config.serializer`` (what its
own ``--json`` flag sets). It reaches the job lists and the job JSON, but not every path:

* the job page and "delete" call ``Job.fetch`` without a serializer, so RQ's pickle default
  restores the job's ``meta`` (a job hash anyone with Redis access can write);
* "requeue" goes through ``rq.requeue_job``, again with the pickle default (ortq's own requeue
  views, :mod:`ortq.dashboard.rqviews`, no longer call it; it is replaced all the same);
* the workers page builds workers with ``Worker.all`` and asks each for its current job, whose
  ``data`` they decode with their own serializer: pickle.

Those are names in the module ``rq_dashboard.web``; :func:`install` points them at the classes
below, whose serializer is msgpack and whose job class is :class:`DashboardJob`, whatever a
caller passes. It also replaces ``from_url``, which rq-dashboard calls on every request for a
new client of its own, with the app's ortq client (ortq's timeouts and TLS checks, one pool),
and ``serialize_job`` (a row of a job list) with one that says what of the job cannot be read.
Its registries are left as they are: rq-dashboard only counts and lists their ids
(``cleanup=False``), which decodes nothing. ``tests/test_dashboard.py`` serves every page
with ``pickle.loads`` made to raise, and shows that the unpatched rq-dashboard does unpickle.

The classes are also lenient where RQ is not (:mod:`ortq.dashboard.records`): RQ raises on the
first field of a record it cannot parse, and rq-dashboard then answered 500 (a failed job with a
fractional ``job_timeout`` left its list on "Loading..."). Here what cannot be read is left out
and listed in the record's ``unreadable`` notes, which the pages show.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import redis
import redis_sentinel_url
import rq
import rq.job
import rq_dashboard
from flask import Blueprint, current_app
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import JobStatus
from rq.results import Result
from rq_dashboard import web
from rq_dashboard.version import VERSION as RQ_DASHBOARD_VERSION

from ortq import keys
from ortq.dashboard.records import (
    JOB_FIELDS,
    MAX_FIELDS,
    bounded_fields,
    describe,
    exception_text,
    integer,
    rq_time,
    shown,
    text,
    unreadable_fields,
)
from ortq.errors import ConfigurationError
from ortq.redisurls import redacted_url
from ortq.rqjob import OrtqJob
from ortq.serializer import MsgpackSerializer

log = logging.getLogger(__name__)

#: rq-dashboard's static files (its base template also asks the app for ``favicon.ico``).
STATIC_DIR = Path(rq_dashboard.__file__).parent / "static"


class DashboardJob(OrtqJob):
    """An :class:`OrtqJob` that decodes with msgpack whatever serializer its caller passes, and
    reads any job hash: what RQ cannot parse is left out and described in :attr:`unreadable`."""

    def __init__(self, id: str | None = None, connection: redis.Redis | None = None, serializer: Any = None) -> None:
        super().__init__(id, connection=connection, serializer=MsgpackSerializer)
        #: What of this job's record could not be read, one line each (empty: all of it).
        self.unreadable: list[str] = []
        #: The hash's own ``exc_info`` (bounded), shown when the job has no result stream.
        self.exc_text = ""

    def note(self, line: str) -> None:
        if line not in self.unreadable:
            self.unreadable.append(line)

    def refresh(self) -> None:
        key = text(self.key) or ""
        try:
            count = self.connection.hlen(self.key)
        except redis.ResponseError as exc:  # WRONGTYPE: not a hash
            self.restore({})
            self.unreadable.insert(0, f"{key} is not a hash ({describe(exc)})")
            return
        if not count:
            raise NoSuchJobError(f"No such job: {key}")
        if count <= MAX_FIELDS:
            self.restore(self.connection.hgetall(self.key))
            return
        values = self.connection.hmget(self.key, list(JOB_FIELDS))
        self.restore({name.encode(): v for name, v in zip(JOB_FIELDS, values, strict=True) if v is not None})
        self.note(f"the record has {count} fields; only the usual ones were read")

    def restore(self, raw_data: Any) -> Any:
        notes: list[str] = []
        fields = bounded_fields(raw_data, notes)
        self.exc_text = exception_text(raw_data.get(b"exc_info"))
        if b"data" not in fields:
            notes.append("the record has no data field")
            fields[b"data"] = b""
        try:
            super().restore(fields)
        except Exception:  # the first field RQ could not parse: find every one, show the rest
            bad = unreadable_fields(self._restores, fields)
            notes += [f"{text(name)} = {shown(fields[name])} cannot be read" for name in bad]
            try:
                super().restore({name: value for name, value in fields.items() if name not in bad})
            except Exception as exc:
                notes.append(f"RQ cannot read this record: {describe(exc)}")
                super().restore({b"data": fields[b"data"]})
        self.unreadable = notes

    def _restores(self, fields: dict[bytes, bytes]) -> bool:
        """Whether RQ's own reader takes ``fields``."""
        try:
            rq.job.Job(self.id, connection=self.connection, serializer=MsgpackSerializer).restore(fields)
        except Exception:
            return False
        return True

    def get_status(self, refresh: bool = True) -> JobStatus:
        try:
            return super().get_status(refresh)
        except (ValueError, InvalidJobOperation, redis.ResponseError) as exc:  # unknown, missing, not a hash
            if not any(line.startswith("status") for line in self.unreadable):
                self.note(f"status cannot be read ({describe(exc)})")
            return super().get_status(refresh=False)

    def get_meta(self, refresh: bool = True) -> dict[str, Any]:
        # A ``meta`` that is not msgpack was not written by ortq (RQ's restore tolerates it, its
        # get_meta raises): show that instead of failing the job's page.
        try:
            meta: dict[str, Any] = super().get_meta(refresh)
        except Exception as exc:
            return {"unreadable": f"meta cannot be read ({describe(exc)}): this job was not written by ortq"}
        return meta

    def latest_result(self, timeout: int = 0) -> Result | None:
        """The job's latest result, read leniently and with bounded inflation (RQ's reader raises on
        a forged entry and inflates its exception text without a limit)."""
        try:
            entries = self.connection.xrevrange(Result.get_key(self.id), "+", "-", count=1)  # type: ignore[no-untyped-call]
        except redis.ResponseError as exc:
            self.note(f"the result stream cannot be read ({describe(exc)})")
            return None
        if not entries:
            return None
        result_id, payload = cast("tuple[bytes, dict[bytes, bytes]]", entries[0])
        try:
            kind = Result.Type(int(payload.get(b"type", b"")))
        except ValueError:
            self.note(f"the latest result's type {shown(payload.get(b'type', b''))} cannot be read")
            kind = Result.Type.FAILED
        value = None
        if kind == Result.Type.SUCCESSFUL and payload.get(b"return_value") is not None:
            try:
                value = MsgpackSerializer.loads(base64.b64decode(payload[b"return_value"]))
            except Exception as exc:
                self.note(f"the return value cannot be read ({describe(exc)})")
        exc_string = exception_text(payload.get(b"exc_string")) or None
        return Result(self.id, kind, self.connection, id=text(result_id), return_value=value, exc_string=exc_string,
                      serializer=MsgpackSerializer)  # fmt: skip


def fetch(job_id: str, connection: redis.Redis) -> DashboardJob:
    """``Job.fetch`` for a :class:`DashboardJob` (NoSuchJobError when it has no record)."""
    job = DashboardJob(job_id, connection=connection)
    job.refresh()
    return job


class DashboardQueue(rq.Queue):
    """An RQ queue whose jobs are :class:`DashboardJob` (``Queue.all`` and ``fetch_job`` included)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.update(job_class=DashboardJob, serializer=MsgpackSerializer)
        super().__init__(*args, **kwargs)

    @classmethod
    def all(
        cls, connection: redis.Redis, job_class: Any = None, serializer: Any = None, death_penalty_class: Any = None
    ) -> list[rq.Queue]:
        """Every queue named in RQ's set of queues; a member that is not a queue key is logged and
        left out (RQ's ``Queue.all`` raises, and every page that lists queues answered 500)."""
        queues: list[rq.Queue] = []
        prefix = cls.redis_queue_namespace_prefix
        for member in connection.smembers(cls.redis_queues_keys):
            key = text(member) or ""
            if not key.startswith(prefix) or "\ufffd" in key:
                log.warning("%s holds %s, which is not a queue key: left out", cls.redis_queues_keys, shown(member))
                continue
            queues.append(cls(key[len(prefix) :], connection=connection))
        return queues

    def fetch_job(self, job_id: str) -> rq.job.Job | None:
        """RQ's ``fetch_job``, except that a job whose record is damaged is listed (saying what is
        wrong) even when its origin cannot be read."""
        try:
            job = fetch(job_id, self.connection)
        except NoSuchJobError:
            self.remove(job_id)
            return None
        return job if job.origin == self.name or job.unreadable else None


class DashboardWorker(rq.Worker):
    """RQ's view of a worker (only ever read here) whose current job is a :class:`DashboardJob`,
    and whose record is read leniently (see :meth:`refresh`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.update(job_class=DashboardJob, queue_class=DashboardQueue, serializer=MsgpackSerializer)
        super().__init__(*args, **kwargs)
        #: What of this worker's record could not be read (empty: all of it).
        self.unreadable: list[str] = []
        self._state_read: str | None = None

    def refresh(self) -> None:
        try:
            super().refresh()  # type: ignore[no-untyped-call]
        except Exception as exc:  # a field RQ cannot parse, bytes that are not UTF-8, not a hash
            self.unreadable = [f"RQ cannot read this worker's record ({describe(exc)}); shown: what ortq could read"]
            self._read_leniently()

    def _read_leniently(self) -> None:
        try:
            raw = self.connection.hgetall(self.key)
        except redis.ResponseError:
            raw = {}
        fields = {text(name): text(value) for name, value in raw.items()}
        self.hostname, self.pid = fields.get("hostname"), integer(fields.get("pid"))
        self.version, self.python_version = fields.get("version") or "", fields.get("python_version") or ""
        self._state_read = fields.get("state") or "?"
        self.birth_date, self.last_heartbeat = rq_time(fields.get("birth")), rq_time(fields.get("last_heartbeat"))
        self.successful_job_count = integer(fields.get("successful_job_count")) or 0
        self.failed_job_count = integer(fields.get("failed_job_count")) or 0
        self.queues = [DashboardQueue(name, connection=self.connection) for name in
                       (fields.get("queues") or "").split(",") if name]  # fmt: skip

    def get_state(self) -> str:
        return self._state_read if self._state_read is not None else super().get_state()

    @classmethod
    def all(
        cls,
        connection: redis.Redis | None = None,
        job_class: Any = None,
        queue_class: Any = None,
        queue: rq.Queue | None = None,
        serializer: Any = None,
    ) -> list[Any]:
        """Every worker whose key can be read; see :func:`worker_keys`."""
        assert connection is not None
        found = (cls.find_by_key(key, connection=connection) for key, _ in worker_keys(connection) if key)
        return [worker for worker in found if worker is not None]


def worker_keys(connection: redis.Redis) -> list[tuple[str | None, str | None]]:
    """(key, None) for each member of RQ's set of workers that names a worker, else (None, what
    is wrong with it): RQ's ``Worker.all`` raises on such a member."""
    members = connection.smembers(rq.worker_registration.REDIS_WORKER_KEYS)
    keys: list[tuple[str | None, str | None]] = []
    for member in sorted(members):
        key = text(member) or ""
        if key.startswith(DashboardWorker.redis_worker_namespace_prefix) and "\ufffd" not in key:
            keys.append((key, None))
        else:
            keys.append((None, f"{rq.worker_registration.REDIS_WORKER_KEYS} holds {shown(member)}, not a worker key"))
    return keys


def requeue_job(job_id: str, connection: redis.Redis, serializer: Any = None) -> rq.job.Job:
    """``rq.requeue_job`` with :class:`DashboardJob` (the dashboard's requeue views refuse ortq
    jobs before they get here: see :func:`ortq.dashboard.rqviews.requeue_refusal`)."""
    return fetch(job_id, connection).requeue()


def is_ortq_job(job: rq.job.Job) -> bool:
    """Whether ``job`` is ortq's (an ortq queue's, or naming ortq's job function), which is never
    requeued: its request tensors were deleted when it ended (ortq.dashboard.rqviews)."""
    if keys.model_from_queue_name(job.origin or "") is not None:
        return True
    try:
        return bool(job.func_name == keys.JOB_FUNC)
    except Exception:  # data ortq cannot decode: not an ortq job
        return False


def serialize_job(job: rq.job.Job) -> dict[str, Any]:
    """rq-dashboard's row of a job list, plus what of the job's record cannot be read, and
    ``requeue_refused`` for an ortq job (the patched row then shows no Requeue button)."""
    row: dict[str, Any] = _SERIALIZE_JOB(job)
    if isinstance(job, DashboardJob) and job.unreadable:
        row["unreadable"] = "; ".join(job.unreadable)
    if is_ortq_job(job):
        row["requeue_refused"] = True
    return row


_SERIALIZE_JOB = web.serialize_job
_CONNECTION = "ortq.dashboard.connection"  # the app's ortq client, in ``app.extensions``


def app_client(url: str, **options: Any) -> tuple[None, redis.Redis]:
    """rq-dashboard's ``from_url`` (redis_sentinel_url's ``connect``): the app's ortq client of
    that Redis (``url`` is one of the app's own, as connect_blueprint shows them)."""
    return None, current_app.extensions[_CONNECTION][url]


# rq_dashboard.web's name -> (what it must be before install, what it becomes).
_REPLACEMENTS: dict[str, tuple[object, object]] = {
    "Job": (rq.job.Job, DashboardJob),
    "Queue": (rq.Queue, DashboardQueue),
    "Worker": (rq.Worker, DashboardWorker),
    "requeue_job": (rq.requeue_job, requeue_job),
    "from_url": (redis_sentinel_url.connect, app_client),
    "serialize_job": (_SERIALIZE_JOB, serialize_job),
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


def connect_blueprint(app: Any, connections: Mapping[str, redis.Redis]) -> None:
    """Make rq-dashboard's blueprint, registered on ``app``, read ``connections`` (URL -> client):
    its instance N is the Nth, shown by its URL without the password."""
    shown = {redacted_url(url): connection for url, connection in connections.items()}
    app.extensions[_CONNECTION] = shown
    app.redis_conn = next(iter(shown.values()))  # what its views use (its before_request sets it, through from_url)
    app.config["RQ_DASHBOARD_REDIS_URL"] = tuple(shown)  # shown on its pages, and passed to from_url
    app.config["RQ_DASHBOARD_JSON_ENCODER"] = MetaEncoder

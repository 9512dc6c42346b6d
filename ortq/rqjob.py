"""ortq's one job function, how an ortq worker reads a job hash, and the RQ job class that
refuses every other callable.

RQ resolves a job's ``func_name`` (and its callback names) with ``import_attribute``: whoever can
write a job hash can make a worker import and call anything. An ortq worker runs no RQ code: it
reads each job hash itself (:class:`JobRecord`, from the fields start.lua returns) and runs a job
only if it names :data:`ortq.keys.JOB_FUNC` and no callback, importing nothing a hash names.
:class:`OrtqJob` applies the same rule where RQ's own code loads ortq jobs: the dashboard
(ortq.dashboard), and ``Job.fetch`` in tests and in users' RQ scripts.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rq.job import Job

from ortq.errors import InvalidJob, UnknownJobFunction
from ortq.keys import JOB_FUNC, as_text, reply_keep
from ortq.serializer import MsgpackSerializer


def infer(model: str) -> None:
    """The function every ortq job names. Its work is done by ``ortq worker`` itself, which reads
    the request tensors from their side key; a plain ``rq worker`` that picked the job up ends here.
    """
    raise RuntimeError(f"ortq jobs for model {model!r} must be run by `ortq worker`, not by a plain RQ worker")


_CALLBACK_FIELDS = ("success_callback_name", "failure_callback_name", "stopped_callback_name")


def _undecodable(exc: Exception) -> str:
    return f"job data cannot be decoded with ortq's msgpack serializer ({type(exc).__name__})"


def _reason(func_name: object, instance: object, callbacks: Mapping[str, object]) -> str | None:
    """Why a job must not run, in words of the worker's own: the reason reaches the job's producer,
    and a job record is anyone's to write (docs/security.md), so it quotes nothing from it."""
    if func_name != JOB_FUNC:
        return f"job names a function other than {JOB_FUNC}, the only one an ortq worker runs"
    if instance is not None:
        return "job names a bound method; an ortq worker only runs a plain function"
    for name, value in callbacks.items():
        if value:
            return f"job names a callback ({name}); ortq jobs have none"
    return None


@dataclass(slots=True)
class JobRecord:
    """What the worker needs of an RQ job hash, read without building an RQ ``Job`` (whose
    constructor and ``restore`` cost more than running a small model, and which trust the hash).
    Not frozen: the worker builds one a job, and a frozen dataclass's ``__init__`` costs five times
    as much."""

    job_id: str
    enqueued_at: datetime | None
    result_ttl: int | None
    failure_ttl: int | None
    timeout: int | None  # RQ's job timeout: seconds a run may take
    ttl: int | None  # seconds the job may wait in the queue
    #: RQ's retry fields: attempts left, and the waits before them (RQ's ``retry_intervals``).
    retries_left: int
    retry_intervals: tuple[int, ...]
    #: Why the job must not run (the same checks as OrtqJob.forbidden_reason), or None.
    forbidden: str | None
    #: The model its ``data`` names (the argument of ``ortq.rqjob.infer``), or None.
    model: str | None
    #: The reply stream its producer reads (its ``ortq_reply``: keys.reply_key), or None when the
    #: hash names none (the job cannot be answered), and the seconds that stream keeps an answer.
    reply: str | None = None
    reply_keep: int = 0

    @classmethod
    def parse(cls, job_id: str, job_hash: Mapping[bytes, bytes]) -> JobRecord:
        # Every job of a producer carries the same bytes in all but enqueued_at: what they say is
        # worked out once for them (the same way each time: a pure function of the exact bytes).
        key = tuple(map(job_hash.get, _SETTLED_KEYS))
        try:
            settled = _SETTLED[key]
        except KeyError:
            settled = _settled(job_hash)
            if len(_SETTLED) >= 64:  # forged jobs vary it at will: the cache stays small
                _SETTLED.clear()
            _SETTLED[key] = settled
        return cls(job_id, parse_rq_time(job_hash.get(b"enqueued_at")), *settled)

    def retry_interval(self) -> int:
        """Seconds before the next attempt, as RQ's ``Job.get_retry_interval`` picks it."""
        if not self.retries_left or not self.retry_intervals:
            return 0
        return self.retry_intervals[max(len(self.retry_intervals) - self.retries_left, 0)]


#: The most retries a job may ask for (RQ has no bound; a forged 10**9 would keep a bad job forever).
MAX_RETRIES = 100


def _intervals(raw: bytes | None) -> tuple[int, ...]:
    """RQ's ``retry_intervals`` (a JSON list of seconds), or () when absent or not such a list."""
    if not raw or len(raw) > 4096:
        return ()
    try:
        values = json.loads(raw)
    except (ValueError, RecursionError):
        return ()
    if not isinstance(values, list) or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return ()
    return tuple(max(0, min(int(v), MAX_SECONDS)) for v in values[:MAX_RETRIES] if math.isfinite(v))


_Settled = tuple[
    int | None, int | None, int | None, int | None, int, tuple[int, ...], str | None, str | None, str | None, int
]


def _settled(job_hash: Mapping[bytes, bytes]) -> _Settled:
    """JobRecord's fields after ``enqueued_at``, in its order, from the fields in _SETTLED_KEYS."""
    return (
        _int(job_hash.get(b"result_ttl")),
        _int(job_hash.get(b"failure_ttl")),
        _int(job_hash.get(b"timeout")),
        _int(job_hash.get(b"ttl")),
        max(0, min(_int(job_hash.get(b"retries_left")) or 0, MAX_RETRIES)),
        _intervals(job_hash.get(b"retry_intervals")),
        *_verdict(job_hash),
        *_reply(job_hash.get(b"ortq_reply")),
    )


def _reply(raw: bytes | None) -> tuple[str | None, int]:
    """The reply stream a job hash names and that stream's keep (keys.reply_keep), or (None, 0)."""
    keep = reply_keep(raw)
    return (None, 0) if keep is None or raw is None else (as_text(raw), keep)


#: Every field _settled reads.
_SETTLED_KEYS = (
    b"result_ttl",
    b"failure_ttl",
    b"timeout",
    b"ttl",
    b"retries_left",
    b"retry_intervals",
    b"data",
    *(name.encode() for name in _CALLBACK_FIELDS),
    b"ortq_reply",
)
_SETTLED: dict[tuple[bytes | None, ...], _Settled] = {}


def _verdict(job_hash: Mapping[bytes, bytes]) -> tuple[str | None, str | None]:
    """Why the job must not run (or None), and the model its ``data`` names (or None)."""
    try:
        func_name, instance, args, _kwargs = MsgpackSerializer.loads(job_data(job_hash))
    except Exception as exc:  # anything a forged hash holds
        return _undecodable(exc), None
    callbacks = {name: job_hash.get(name.encode()) for name in _CALLBACK_FIELDS}
    model = args[0] if isinstance(args, list | tuple) and len(args) == 1 and isinstance(args[0], str) else None
    return _reason(func_name, instance, callbacks), model


def parse_rq_time(raw: bytes | str | None) -> datetime | None:
    """A timestamp RQ wrote (``utcformat``), or None; much cheaper than RQ's own strptime. One
    without an offset is UTC, as RQ's are (not the worker host's local time)."""
    try:
        moment = datetime.fromisoformat(as_text(raw)) if raw else None  # trailing Z: Python >= 3.11
    except ValueError:
        return None
    return moment.replace(tzinfo=UTC) if moment is not None and moment.tzinfo is None else moment


#: The longest time (s) a job's own ttl, timeout or result ttl is taken at: a forged 1e20 must not
#: overflow a timer or make Redis refuse an EXPIRE.
MAX_SECONDS = 365 * 24 * 3600

#: The most a job's ``data`` may inflate to (an ortq job's is ~40 bytes): a zlib bomb is refused
#: after this much, not after it has filled memory.
MAX_DATA_BYTES = 64 * 1024


def _int(raw: bytes | None) -> int | None:
    """A whole number of seconds (a fraction rounds up), capped at a year either way; None when
    absent or not a finite number."""
    if raw is None:
        return None
    if raw.isdigit() and len(raw) < 8:  # what ortq's producers write: below the cap, no float to round
        return int(raw)
    try:
        value = float(raw) if raw else None
    except ValueError:
        return None
    if value is None or not math.isfinite(value):
        return None
    return max(-MAX_SECONDS, min(math.ceil(value), MAX_SECONDS))


def job_data(job_hash: Mapping[bytes, bytes]) -> bytes:
    """The job hash's ``data``, inflated if RQ compressed it, refused past MAX_DATA_BYTES."""
    raw = job_hash.get(b"data", b"")
    if len(raw) > MAX_DATA_BYTES:
        raise InvalidJob(f"job data is {len(raw)} bytes; an ortq job's is tiny (at most {MAX_DATA_BYTES})")
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(raw, MAX_DATA_BYTES)
    except zlib.error:
        return raw  # not compressed: ortq producers write it plain
    if inflater.unconsumed_tail or not inflater.eof:
        raise InvalidJob(f"job data inflates past {MAX_DATA_BYTES} bytes (a zlib bomb?)")
    return data


class OrtqJob(Job):
    """An RQ job that can only ever name :func:`infer`."""

    def forbidden_reason(self) -> str | None:
        """Why this job must not run, or None when it is a well-formed ortq job."""
        try:
            func_name, instance = self.func_name, self._instance
        except Exception as exc:  # RQ raises DeserializationError for undecodable data
            return _undecodable(exc)
        callbacks = {name: getattr(self, f"_{name}") for name in _CALLBACK_FIELDS}
        return _reason(func_name, instance, callbacks)

    @property
    def func(self) -> Any:
        reason = self.forbidden_reason()
        if reason is not None:
            raise UnknownJobFunction(reason)
        return infer

    # RQ would import these by name; an ortq job never has any.
    @property
    def success_callback(self) -> None:
        return None

    @property
    def failure_callback(self) -> None:
        return None

    @property
    def stopped_callback(self) -> None:
        return None

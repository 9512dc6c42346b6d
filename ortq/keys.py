"""Every Redis key ortq reads or writes, in one place.

docs/wire-format.md mirrors this module; a change here is a change to the wire format.
RQ's own keys (``rq:job:<id>``, ``rq:queue:<queue>``, registries) are named by RQ; the
ones ortq writes itself when enqueueing are spelled out here so that producers in any
language can write them too.
"""

from __future__ import annotations

import re
import secrets

from ortq.errors import ConfigurationError
from ortq.rqcompat import layout

PREFIX = "ortq:"

#: The version of the keys and commands docs/wire-format.md describes (the frame has its own,
#: ``wire.WIRE_VERSION``). Workers publish it in their model's signature record; producers refuse
#: to enqueue for workers of another.
PROTOCOL = 4

#: The dotted path every ortq RQ job names. A worker runs no other function.
JOB_FUNC = "ortq.rqjob.infer"

#: RQ's set of known queue keys (RQ writes and reads it; ortq producers add to it).
RQ_QUEUES_SET = layout.queues_key()

#: Set of worker names that published a record (members whose record expired are pruned on read).
WORKERS_SET = PREFIX + "workers"

#: Set of the signature records workers publish (``<model>`` and ``<model>@<version>``, as after
#: ``signature_key``'s prefix): how ``ortq info`` and the exporter find every model and version
#: without a SCAN of the keyspace. Members whose record expired stay (one per model version ever
#: served) and read as gone.
SIGNATURES_SET = PREFIX + "signatures"

#: The prefixes of ortq's per-job and per-version keys (the functions below add the model and id;
#: the worker's scripts build the same names from them: ortq/rqcompat/contract.py).
REQUEST_PREFIX = PREFIX + "req:"
REPLY_PREFIX = PREFIX + "reply:"
STAGE_PREFIX = PREFIX + "stage:"
PARKED_PREFIX = PREFIX + "parked:"

_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


def as_text(value: bytes | str) -> str:
    """A Redis reply as str (clients return bytes unless created with decode_responses)."""
    return value.decode() if isinstance(value, bytes) else value


def check_model_name(name: str) -> str:
    """Return ``name`` if it can name a model (and so a queue), else raise ConfigurationError."""
    if not isinstance(name, str) or not _MODEL_NAME.fullmatch(name):
        raise ConfigurationError(
            f"invalid model name {name!r}: use 1-64 characters from A-Z a-z 0-9 _ . -, starting with a letter or digit"
        )
    return name


def check_version_name(version: object) -> str:
    """Return ``version`` if it can name a model's version, else raise ConfigurationError."""
    if not isinstance(version, str) or not _MODEL_NAME.fullmatch(version):
        raise ConfigurationError(
            f"invalid model version {version!r}: use 1-64 characters from A-Z a-z 0-9 _ . -, "
            "starting with a letter or digit"
        )
    return version


def queue_name(model: str) -> str:
    """The RQ queue that carries jobs for ``model``; one queue per model name."""
    return PREFIX + model


def queue_key(model: str) -> str:
    """The Redis list behind :func:`queue_name` (RQ's ``rq:queue:<name>``)."""
    return layout.QueueKeys.of(queue_name(model)).queue


def job_key(job_id: str) -> str:
    """RQ's job hash."""
    return layout.job_key(job_id)


def request_key(model: str, job_id: str) -> str:
    """String holding the job's request frame; written with the enqueue, deleted when the job ends.
    Named by model, so that a per-model ACL rule covers it (docs/security.md)."""
    return REQUEST_PREFIX + model + ":" + job_id


#: A reply stream's name (the part after ``ortq:reply:<model>:``): its producer's token, a dot and
#: the seconds its entries are kept (docs/wire-format.md, section 4.1). No job id holds a dot, so no
#: reply stream is ever a large answer's key (:func:`large_reply_key`).
_REPLY_NAME = re.compile(r"([A-Za-z0-9_\-]{1,64})\.([1-9][0-9]{0,7})")
#: The most seconds a reply stream keeps its entries (a year: the longest ttl a job has).
MAX_REPLY_KEEP = 365 * 24 * 3600

#: The fields of a reply stream's entry: the job it answers and its response frame (empty when the
#: frame was large: then it is the one entry of the job's own stream, :func:`large_reply_key`).
REPLY_ID_FIELD = b"id"
REPLY_FRAME_FIELD = b"frame"


def new_reply_name(keep: int) -> str:
    """A new producer's reply stream name, its entries kept ``keep`` seconds (at most a year)."""
    return secrets.token_hex(16) + "." + str(max(1, min(int(keep), MAX_REPLY_KEEP)))


def reply_keep(name: bytes | str | None) -> int | None:
    """The seconds the reply stream ``name`` keeps its entries, or None when ``name`` is no reply
    stream's name (nothing a worker may answer to)."""
    if name is None:
        return None
    # Decoded with 'replace': bytes that are no UTF-8 (a forged field) then match no name.
    text = name.decode(errors="replace") if isinstance(name, bytes) else name
    found = _REPLY_NAME.fullmatch(text)
    if found is None:
        return None
    return min(int(found.group(2)), MAX_REPLY_KEEP)


def reply_key(model: str, reply_name: str) -> str:
    """The stream a producer reads its answers of ``model``'s jobs from: one entry a job (fields
    ``id`` and ``frame``), written by workers only; producers read it with XREAD, which writes
    nothing. Named by model, as the request, so that a per-model ACL rule covers it."""
    return REPLY_PREFIX + model + ":" + reply_name


def large_reply_key(model: str, job_id: str) -> str:
    """Stream holding one job's large response frame (its one entry's field ``frame``), when the
    entry in its reply stream has an empty frame: the worker moves it here whole, without copying
    it through Lua (:func:`answer_stage_key`)."""
    return REPLY_PREFIX + model + ":" + job_id


def answer_stage_key(job_id: str, execution_id: str) -> str:
    """Stream holding a large response frame for one execution of a job, written by its worker
    just before its finish script, which renames it to the job's large_reply_key if the execution still owns
    the job (the frame never enters Lua: Redis 7's Lua hashes every byte of a string) and deletes
    it otherwise; it expires with the answer's ttl if the worker dies in between."""
    return STAGE_PREFIX + job_id + ":" + execution_id


def last_high_key(model: str) -> str:
    """String naming the most recently enqueued high-priority job of ``model``: new high-priority
    jobs are inserted after it, so that they run before every normal one and in FIFO order."""
    return PREFIX + "last-high:" + model


def signature_key(model: str, version: str | None = None) -> str:
    """JSON record of the model's signature, with the version it is of. Without ``version``: the
    current one, that of the worker of ``model`` that started last (every worker writes it again if
    it is gone); with it: that version's, published by every worker serving that version. (Model
    and version names hold no ``@``: neither key can be taken for another.)"""
    return PREFIX + "signature:" + model + ("" if version is None else "@" + version)


def parked_key(model: str, version: str) -> str:
    """List of the ids of ``model``'s jobs pinned to ``version`` that a worker of another version
    took off the queue: the start script of a worker of that version takes them before the queue.
    Written by workers; a producer's cancel takes its job off it (docs/wire-format.md, 3.7)."""
    return PARKED_PREFIX + model + "@" + version


def parked_versions_key(model: str) -> str:
    """Set of the versions that have a parked list of ``model``'s, for readers that may not SCAN
    (start.lua writes it). Written by workers only."""
    return PARKED_PREFIX + model


def worker_key(worker_name: str) -> str:
    """JSON record of one worker (model, provider, device, host, pid); expires unless refreshed."""
    return PREFIX + "worker:" + worker_name


def model_from_queue_name(name: str) -> str | None:
    """The model a queue serves, or None when the queue is not an ortq queue."""
    return name[len(PREFIX) :] if name.startswith(PREFIX) else None

"""The contract between the Python side and the hot-path scripts (start, finish, fail), named once.

Each script's arguments, the job hash fields start.lua reads and the layout of start.lua's reply
are the tuples below; the scripts see them through a Lua prelude generated from those tuples
(:func:`prelude`): ``A.queue`` for an argument, ``F.origin`` for a field's place in ``FIELDS``,
``K.request`` for a key prefix from ``ortq.keys``. Adding a field or an argument is then a
one-line change here, and no position is written by hand in Lua; Python builds the argument list
by name (:func:`arguments`) and reads the reply by name (``START_JOB``).

The prelude is plain constants and one table of arguments per call: it costs the scripts nothing
per job.
"""

from __future__ import annotations

from collections.abc import Mapping

from ortq import keys

#: The job hash fields start.lua reads (HMGET, in this order) and hands back to the worker.
JOB_FIELDS = (
    "status",
    "data",
    "enqueued_at",
    "timeout",
    "ttl",
    "result_ttl",
    "failure_ttl",
    "retries_left",
    "retry_intervals",
    "success_callback_name",
    "failure_callback_name",
    "stopped_callback_name",
    "origin",
    "ortq_version",
    "ortq_reply",
)

#: The arguments every ortq script gets first (common.lua reads them).
COMMON_ARGS = ("rq_prefix", "records", "ortq_prefix", "worker_ttl")

#: Each hot-path script's own arguments, after COMMON_ARGS; a name ending in ``...`` is a list
#: that runs to the end (its first element's index is ``A.<name>_at``).
SCRIPT_ARGS: dict[str, tuple[str, ...]] = {
    # now: epoch seconds; now_iso: RQ's ISO form; default_ttl: a job's heartbeat TTL without a
    # timeout; more: how many to pop after `first` (b"": none, pop them all); inline: the largest
    # frame returned in the reply; executions: 32 hex digits per job this call may start, joined;
    # version: the model version served ('': none); parked_ttl: the most seconds a park makes a parked
    # list live (a request's ttl: each park raises its expiry to the parked job's request's, at most this).
    "start": (
        "queue",
        "worker",
        "now",
        "now_iso",
        "default_ttl",
        "more",
        "inline",
        "first",
        "executions",
        "version",
        "parked_ttl",
    ),
    # state: the worker's state afterwards ('' leaves it); count: jobs; moments: the batch's
    # (working seconds, started epoch) pairs, flat; then FINISH_JOB's values per job.
    "finish": ("queue", "worker", "state", "count", "ended_iso", "ended_at", "moment_count", "moments..."),
    "fail": (
        "queue",
        "worker",
        "state",
        "id",
        "execution",
        "error",
        "ttl",
        "exc_string",
        "now",
        "now_iso",
        "started_at",
        "working",
        "retry",
        "retry_at",
        "retries_left",
        "retry_ttl",
        "status",
    ),
}

#: finish.lua's values per job, after the moments: the job id, its execution id, its answer's ttl,
#: its moment (1-based, into the moments' pairs), RQ's return value (base64 msgpack; '' writes no
#: result stream entry), its response frame ('' when staged: its frame waits in its stage
#: stream, written beside the call, and is renamed to its large reply key), the name of the reply
#: stream it is answered in (its job hash's ``ortq_reply``, checked: keys.reply_keep) and the
#: seconds that stream keeps its entries.
FINISH_JOB = ("id", "execution", "ttl", "moment", "value", "frame", "reply", "keep")

#: start.lua's reply: LEFT (the queue's length afterwards: its backlog) and SKIPPED (how many
#: queue entries were not started) first, then SKIPPED pairs of (entry, reason), then per started
#: job START_JOB's values followed by ``value_count`` field values: all of JOB_FIELDS, or only
#: ``enqueued_at`` when every other value is the previous started job's (a producer's jobs differ
#: in that one), or none for a job with an oversized field.
START_HEAD = ("left", "skipped")
START_JOB = ("id", "execution", "ttl", "frame_size", "frame", "oversized", "value_count")

#: ortq's key prefixes the scripts build names from (``ortq.keys``).
KEY_PREFIXES = {
    "request": keys.REQUEST_PREFIX,
    "reply": keys.REPLY_PREFIX,
    "stage": keys.STAGE_PREFIX,
    "parked": keys.PARKED_PREFIX,
}


def _lua_string(text: str) -> str:
    if "'" in text or "\\" in text:
        raise ValueError(f"not a plain Lua string: {text!r}")
    return f"'{text}'"


def _table(entries: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{name} = {value}" for name, value in entries.items()) + "}"


def prelude(script: str) -> str:
    """The Lua constants ``script`` reads the contract through, one line each (so that a Redis
    error's line number still points into the script below them)."""
    lines = [
        "-- generated from ortq/rqcompat/contract.py: the arguments (A), job fields (FIELDS, F) and key prefixes (K)",
        "local FIELDS = {" + ", ".join(map(_lua_string, JOB_FIELDS)) + "}",
        "local F = " + _table({name: str(i) for i, name in enumerate(JOB_FIELDS, 1)}),
        "local K = " + _table({name: _lua_string(prefix) for name, prefix in KEY_PREFIXES.items()}),
        "local FINISH_JOB = " + str(len(FINISH_JOB)),
    ]
    names = SCRIPT_ARGS.get(script)
    if names is not None:
        entries: dict[str, str] = {}
        for i, name in enumerate(names, len(COMMON_ARGS) + 1):
            if name.endswith("..."):
                entries[name[:-3] + "_at"] = str(i)
            else:
                entries[name] = f"ARGV[{i}]"
        lines.append("local A = " + _table(entries))
    return "\n".join(lines) + "\n"


def arguments(script: str, values: Mapping[str, object], rest: list[object] | None = None) -> list[object]:
    """``script``'s own arguments in the contract's order from ``values`` by name, then ``rest``
    (a list argument's elements); a missing or unknown name is a KeyError, not a shifted argument."""
    names = _NAMED[script]
    if len(values) != len(names):
        raise KeyError(f"{script}.lua takes {names}, not {sorted(values)}")
    return [values[name] for name in names] + (rest or [])


_NAMED = {script: [n for n in names if not n.endswith("...")] for script, names in SCRIPT_ARGS.items()}

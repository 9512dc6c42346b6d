"""A job's reply, as a producer reads it, with no I/O of its own: XREAD's arguments for reply
streams and the frames in its answer, why a refused XREAD was refused, and the check that a
response answers its request (its proof), before its outputs are handed out
(``enqueue.outputs_of``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis

from ortq import keys, redisfaults, wire
from ortq.errors import CorruptRecord, OrtqError, ResponseMismatch, WireFormatError


def reply_streams(jobs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """XREAD's streams argument for waiting on the replies of these (model, job id) from the start."""
    return {keys.reply_key(model, job_id): "0-0" for model, job_id in jobs}


def frames_in(reply: Any) -> dict[str, bytes | CorruptRecord]:
    """Job id -> its response frame (or why there is none) in an XREAD reply: RESP2's
    ``[(stream, entries)]`` or RESP3's ``{stream: entries}``. (A reply key ends with its job id,
    after the last colon: ids have none.)"""
    found: dict[str, bytes | CorruptRecord] = {}
    streams = [(k, _unwrapped(v)) for k, v in reply.items()] if isinstance(reply, dict) else reply or []
    for stream, entries in streams:
        key = keys.as_text(stream)
        job_id = key.rpartition(":")[2]
        try:
            found[job_id] = frame_of(entries, key)
        except CorruptRecord as exc:
            found[job_id] = exc
    return found


def _unwrapped(entries: Any) -> Any:
    """A RESP3 XREAD reply's entries: redis-py wraps each stream's list of entries in one list more
    (``{stream: [[(id, fields), ...]]}``); an entry's first item is its id (bytes)."""
    if isinstance(entries, list) and len(entries) == 1 and isinstance(entries[0], list):
        inner = entries[0]
        if not inner or not isinstance(inner[0], bytes | str):
            return inner
    return entries


def read_refusal(exc: redis.RedisError) -> OrtqError | None:
    """What an XREAD of reply streams that Redis refused means, or None when a key was of the wrong
    type: then read each key alone (:func:`add_probe`) and :func:`wrong_reply` says which."""
    if redisfaults.is_wrong_type(exc):
        return None
    return redisfaults.failure(exc, "could not read replies")


def add_probe(pipe: Any, model: str, job_id: str) -> None:
    """Read one job's reply stream without blocking: after a refused XREAD of many, to find the key
    that is no stream (needs nothing but XREAD, which is all a producer may run on reply keys)."""
    pipe.xread({keys.reply_key(model, job_id): "0-0"}, count=1)


def wrong_reply(model: str, job_id: str, probe: Any) -> CorruptRecord | None:
    """CorruptRecord when the :func:`add_probe` of the job's reply found no stream there."""
    if not (isinstance(probe, redis.ResponseError) and redisfaults.is_wrong_type(probe)):
        return None
    key = keys.reply_key(model, job_id)
    return CorruptRecord(f"the reply key of job {job_id} ({key}) holds no stream: no ortq worker wrote it")


def frame_of(entries: Any, key: str) -> bytes:
    """The response frame in the XREAD entries ``[(id, {field: value})]`` of reply stream ``key``."""
    try:
        frame = entries[0][1][b"frame"]
    except (IndexError, KeyError, TypeError) as exc:
        raise CorruptRecord(f"the reply {key} has no frame") from exc
    if not isinstance(frame, bytes):
        raise CorruptRecord(f"the reply {key} is not a byte string")
    return frame


#: The errors a worker answers without having read the request (so with no proof), each in fixed
#: words of its own: the request was gone, too large or no string to read, or did not decode; the
#: job record was no hash; the job's worker died (twice taken back). A producer takes such an error
#: for its job's answer: nothing in it came from whoever replaced or removed the request.
UNPROVEN_ERRORS = frozenset({"RequestExpired", "PayloadTooLarge", "InvalidJob", "WireFormatError", "WorkerLost"})


def read_response(frame: bytes, job_id: str, proof: bytes | None, max_bytes: int) -> wire.Response:
    """Decode a response frame and check that it answers the request whose proof (JobHandle.proof)
    is ``proof`` (None: not checked)."""
    try:
        response = wire.decode_response(frame, max_bytes=max_bytes)
    except WireFormatError as exc:
        raise CorruptRecord(f"the reply of job {job_id} is no valid response frame: {exc}") from exc
    if proof is None or response.proof == proof:
        return response
    if response.proof is None and response.error is not None and response.error.type in UNPROVEN_ERRORS:
        return response  # the worker could not read the request: it says so, in its own words
    carries = "no proof" if response.proof is None else "the proof of another request or model"
    raise ResponseMismatch(
        f"the response to job {job_id} does not answer this request (it carries {carries}): its request frame "
        "was replaced, or the job run by a worker of another model, by someone with write access to Redis "
        "(docs/security.md); or its worker speaks another ortq protocol (upgrade producers and workers together)"
    )

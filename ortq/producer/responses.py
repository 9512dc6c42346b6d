"""A job's reply, as a producer reads it, with no I/O of its own: why a refused XREAD was refused,
and the check that a response answers its request (its proof), before its outputs are handed out
(``enqueue.outputs_of``). Where replies are read from: ``replybook`` and ``waiting``."""

from __future__ import annotations

import redis

from ortq import redisfaults, wire
from ortq.errors import CorruptRecord, OrtqError, ResponseMismatch, WireFormatError


def read_refusal(exc: redis.RedisError) -> OrtqError | None:
    """What an XREAD of reply streams that Redis refused means, or None when a key was of the wrong
    type: then each is read alone to find which (``waiting``)."""
    if redisfaults.is_wrong_type(exc):
        return None
    return redisfaults.failure(exc, "could not read replies")


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

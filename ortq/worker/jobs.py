"""One job through the worker's stages, without I/O: **check** a taken job (decode its request,
check it against the model), and **encode** its answer: the response of a successful run, or the
failure of a bad or failed one (with RQ's retry rules). The worker's threads call these; Redis is
written by ortq.rqcompat.book.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from ortq import keys, knownheaders, wire
from ortq.errors import (
    InvalidInput,
    InvalidJob,
    JobStopped,
    OrtqError,
    RequestExpired,
    UnknownJobFunction,
    WireFormatError,
)
from ortq.rqcompat.book import Finished, Retry, StartedJob
from ortq.rqjob import MAX_SECONDS, JobRecord
from ortq.serializer import MsgpackSerializer
from ortq.settings import Settings
from ortq.signature import ModelSignature
from ortq.worker.batch import BatchKey, Tensors, batch_key, concat
from ortq.worker.intake import Taken

log = logging.getLogger("ortq.worker")


@dataclass(slots=True)
class Pending:
    """A job whose request decoded and fits the model, waiting for its group's run. A request
    whose header is a remembered one (ortq.knownheaders) keeps its ``frame`` and ``known`` header
    instead of ``inputs``: its group's inputs are joined from the frames (``group_inputs``)."""

    job: JobRecord
    started: StartedJob
    inputs: Tensors | None
    timings: dict[str, float]
    rows: int
    #: What binds its answer to its request (wire.proof_of); None for a request without a nonce.
    proof: bytes | None
    key: BatchKey  # which jobs it may share a run with (ortq.worker.batch)
    model: str
    frame: bytes | bytearray | None = None
    known: knownheaders.KnownHeader | None = None
    #: What its answer says served it (the worker's model version and signature digest).
    served: wire.Served | None = None

    def tensors(self) -> Tensors:
        """Its inputs, as arrays."""
        if self.inputs is None:
            assert self.known is not None and self.frame is not None  # how check makes it
            self.inputs = self.known.inputs(self.frame)
        return self.inputs


def group_inputs(members: list[Pending]) -> Tensors:
    """The inputs of a group's run: its members' joined along dim 0."""
    known = members[0].known
    if len(members) > 1 and known is not None and all(m.known is known for m in members):
        return known.joined([m.frame for m in members if m.frame is not None])
    return concat([m.tensors() for m in members])


#: What a remembered header's requests have in common, worked out from the first of them in a
#: batch: why they do not fit the model (an error), or their rows and batch key.
HeaderVerdict = Exception | tuple[int, BatchKey]


@dataclass(slots=True)
class Failure:
    """A job to fail (or, with ``retry``, to put back for another attempt), as book.fail takes it."""

    started: StartedJob
    error_type: str
    error: bytes
    ttl: int
    reason: str
    retry: Retry | None
    timings: dict[str, float]
    status: str = "failed"  # RQ's status it ends with: "stopped" for a stopped job (JobStopped)


def check(
    taken: Taken,
    model: str,
    signature: ModelSignature,
    settings: Settings,
    batching: bool,
    batch_wait: float,
    headers: dict[knownheaders.KnownHeader, HeaderVerdict] | None = None,
    served: wire.Served | None = None,
    last: knownheaders.KnownHeader | None = None,
) -> Pending | Failure:
    """Stage **check** for one job: decode and check its request for ``model``; its Failure when it is bad.
    ``headers``: the verdicts of the batch's remembered headers so far (filled in here); ``last``:
    the remembered header of the batch's job before (knownheaders.known_frame tries it first).

    The request is read first: its nonce makes the proof (wire.proof_of) that every answer below
    carries, errors about the job's record included, so that its producer can tell an answer to its
    own request from one to a request someone else put in its place. What fails before the nonce is
    known (no frame, one too large or not decoding) fails unproven, in the worker's own words."""
    started = taken.started
    job = JobRecord.parse(started.job_id, started.fields)
    timings = _waits(job, started, batching, batch_wait)
    proof = None
    try:
        frame = _request_frame(taken, job)
        t0 = time.perf_counter()
        limit = settings.max_frame_bytes
        found = knownheaders.known_frame(frame, limit, last)
        if found is None:
            request, learned = wire.decode_request_in_full(frame, max_bytes=limit)  # remembers a producer's header
            nonce = request.nonce
            if learned is not None and nonce is not None:
                found = learned, nonce
        else:
            nonce = found[1]
        proof = None if nonce is None else wire.proof_of(model, nonce)
        _check_record(job, started, model, timings.get("queue"))
        verdict: HeaderVerdict
        if found is None:
            inputs = request.inputs
            verdict = header_verdict(inputs, signature, batching)
        else:
            known = found[0]
            verdict = _remembered_verdict(known, frame, signature, batching, headers)
        if isinstance(verdict, Exception):
            return failure(started, job, verdict, timings, proof, settings, served)
        rows, key = verdict
        timings["decode"] = time.perf_counter() - t0
    except Exception as exc:
        return failure(started, job, exc, timings, proof, settings, served)
    if found is None:
        return Pending(job, started, inputs, timings, rows, proof, key, model, served=served)
    return Pending(job, started, None, timings, rows, proof, key, model, frame, known, served)


def _waits(job: JobRecord, started: StartedJob, batching: bool, batch_wait: float) -> dict[str, float]:
    """The timings known before the request is read: its wait in the queue (from its enqueue to its
    start, when the record says when it was enqueued) and, when batching, its batch's wait."""
    timings: dict[str, float] = {}
    if job.enqueued_at is not None:
        timings["queue"] = max(0.0, started.started_at.timestamp() - job.enqueued_at.timestamp())
    if batching:
        timings["batch_wait"] = batch_wait
    return timings


def _request_frame(taken: Taken, job: JobRecord) -> bytes | bytearray:
    """The job's request frame: RequestExpired when there was none to read, or the OrtqError the
    intake failed it with instead of a frame."""
    frame = taken.frame
    if frame is None:
        raise RequestExpired(
            f"the request tensors of job {job.job_id} were gone when a worker took it (its ttl passed, or they "
            "were deleted; a producer of ortq protocol 2 writes them where workers of protocol 3 do not look)"
        )
    if isinstance(frame, OrtqError):
        raise frame
    return frame


def _check_record(job: JobRecord, started: StartedJob, model: str, waited: float | None) -> None:
    """Raise what keeps the job from running by its record alone: a field too large to have been
    read, a function other than ortq's, another model than ``model``, a wait (``waited`` seconds in
    the queue) past its ttl."""
    if started.oversized is not None:  # not read: what it would have said is unknown
        raise InvalidJob(f"job field {started.oversized!r} is larger than an ortq job's can be")
    if job.forbidden is not None:
        log.error("refusing job %s: %s", job.job_id, job.forbidden)
        raise UnknownJobFunction(job.forbidden)
    if job.model != model:
        raise InvalidJob(f"the job's record names another model than {model!r}, the one this worker serves")
    if job.reply is None:  # its answer would reach no one: the run is not made
        raise InvalidJob(
            f"job {job.job_id} names no reply stream (ortq_reply) to answer in: it was enqueued by a producer of "
            f"another ortq protocol than {keys.PROTOCOL}, or its record was rewritten"
        )
    if job.ttl is not None and job.ttl > 0 and waited is not None and waited > job.ttl:
        raise RequestExpired(f"job {job.job_id} waited {waited:.1f} s for a worker, past its ttl of {job.ttl} s")


def _remembered_verdict(
    known: knownheaders.KnownHeader,
    frame: bytes | bytearray,
    signature: ModelSignature,
    batching: bool,
    headers: dict[knownheaders.KnownHeader, HeaderVerdict] | None,
) -> HeaderVerdict:
    """The verdict on a request whose header is the remembered ``known``: the one an earlier request
    of the batch with that header got (``headers``), else worked out from ``frame`` and kept there.
    The header declares the names, dtypes and shapes that the checks look at: one frame's verdict is
    every frame's with it."""
    verdict = None if headers is None else headers.get(known)
    if verdict is None:
        verdict = header_verdict(known.inputs(frame), signature, batching)
        if headers is not None:
            headers[known] = verdict
    return verdict


def header_verdict(inputs: Tensors, signature: ModelSignature, batching: bool) -> HeaderVerdict:
    """Why ``inputs`` do not fit the model, or their rows and batch key."""
    try:
        signature.check_inputs(inputs)
        return rows_of(inputs) if batching else 1, batch_key(inputs)
    except InvalidInput as exc:
        return exc


def check_batch(
    taken: list[Taken],
    model: str,
    signature: ModelSignature,
    settings: Settings,
    batching: bool,
    batch_wait: float,
    served: wire.Served | None = None,
) -> tuple[list[Pending], list[Failure]]:
    """Stage **check** for a batch: each job checked on its own, the good ones to run, the bad to
    fail. What a remembered header's frames have in common is worked out once a batch: whether
    they fit the model (``headers``), and the header itself, which the next frame is tried against
    first (its bytes compared in place, not sliced and hashed: ``last``)."""
    pending: list[Pending] = []
    failures: list[Failure] = []
    headers: dict[knownheaders.KnownHeader, HeaderVerdict] = {}
    last: knownheaders.KnownHeader | None = None
    for item in taken:
        checked = check(item, model, signature, settings, batching, batch_wait, headers, served, last)
        if isinstance(checked, Pending):
            pending.append(checked)
            if checked.known is not None:
                last = checked.known
        else:
            failures.append(checked)
    return pending, failures


def failure(
    started: StartedJob,
    job: JobRecord,
    exc: BaseException,
    timings: dict[str, float],
    proof: bytes | None,
    settings: Settings,
    served: wire.Served | None = None,
) -> Failure:
    """How one job fails: its error reply (with ``proof``, when its request was read) and RQ's
    failure records; or, when it has retries left and the failure is not the job's own fault (an
    OrtqError: bad input, expiry, a timeout), back for another attempt. An unproven reply keeps to
    words of the worker's own (its producer takes it for its answer: docs/wire-format.md): a frame
    that does not decode is said to, why is in RQ's record and the worker's log."""
    error_type = type(exc).__name__
    message = str(exc) or error_type
    retry = None
    if job.retries_left > 0 and not isinstance(exc, OrtqError):
        wait = job.retry_interval()
        # Its hash lives as a queued job's does (ortq.producer.enqueue): its wait, then failure_ttl.
        waiting = min(job.ttl, settings.request_ttl) if job.ttl and job.ttl > 0 else settings.request_ttl
        ttl = wait + waiting + ttl_of(job.failure_ttl, settings.failure_ttl)
        retry = Retry(job.retries_left - 1, time.time() + wait if wait else None, ttl)
    reason = f"{error_type}: {message}"
    if proof is None and type(exc) is WireFormatError:  # its message quotes the frame: anyone's bytes
        # What is wrong, in the decoder's fixed words only (its own message: RQ's record, the log).
        said = f": {exc.plain}" if exc.plain else " (why: RQ's failure record, the worker's log)"
        message = f"the request frame does not decode as an ortq request{said}"
    error = wire.encode_error(error_type, message, timings, proof, served)
    status = "stopped" if isinstance(exc, JobStopped) else "failed"
    ttl = ttl_of(job.failure_ttl, settings.failure_ttl)
    return Failure(started, error_type, error, ttl, reason, retry, timings, status)


@dataclass(slots=True)
class Computed:
    """A job's outputs from its run, whose answer the replier encodes (stage **encode**): off the main
    thread, so that it runs while the next ``Run`` holds no GIL. ``layout``: ``wire.layout_of``
    its outputs, looked up once for the jobs of a run with as many rows (their outputs look alike)."""

    member: Pending
    outputs: dict[str, np.ndarray]
    run: float
    batch_size: int
    ttl: int
    layout: wire.Layout | None

    def encode(self, settings: Settings) -> Finished | Failure:
        """Stage **encode** for one job: its response and RQ's result summary; its Failure when the
        outputs cannot be encoded (more dimensions than a frame carries, a header past the wire format's limit), which
        fails this job alone."""
        member = self.member
        try:
            return finished(self, settings.rq_results)
        except Exception as exc:
            return failure_of(member, exc, {**member.timings, "run": self.run}, settings)


def failure_of(member: Pending, exc: BaseException, timings: dict[str, float], settings: Settings) -> Failure:
    """``failure`` of a job that was checked: its answer carries its proof and what served it."""
    return failure(member.started, member.job, exc, timings, member.proof, settings, member.served)


def layout_of(outputs: dict[str, np.ndarray]) -> wire.Layout | None:
    """``wire.layout_of``, None for outputs it refuses: their answer then goes through the general
    encoder, which refuses them for their job alone (Computed.answer)."""
    try:
        return wire.layout_of(outputs)
    except Exception:
        return None


def finished(computed: Computed, rq_result: bool = True) -> Finished:
    """The **encode** of one job whose run succeeded: its response frame and (``rq_result``) RQ's result summary."""
    member, outputs, layout = computed.member, computed.outputs, computed.layout
    timings = {**member.timings, "run": computed.run}
    t0 = time.perf_counter()
    frame = wire.encode_laid_out(outputs, layout, timings, member.proof, member.served)
    timings["encode"] = time.perf_counter() - t0
    if not rq_result:
        return Finished(member.started, frame, computed.ttl, None, timings)
    summary = {
        "reply_key": keys.reply_key(member.model, member.job.reply or ""),
        "outputs": layout.shapes if layout is not None else _shapes(outputs),
        "batch_size": computed.batch_size,
        "timings": timings,
    }
    return Finished(member.started, frame, computed.ttl, MsgpackSerializer.dumps(summary), timings)


def _shapes(outputs: dict[str, np.ndarray]) -> dict[str, list[object]]:
    return {name: [wire.dtype_name(v.dtype), list(v.shape)] for name, v in outputs.items()}


def rows_of(inputs: dict[str, np.ndarray]) -> int:
    """The rows a job adds to a batch: every input's first dimension, which must agree."""
    if len(inputs) == 1:  # most models': nothing to agree
        for value in inputs.values():
            if value.ndim:
                return int(value.shape[0])
    sizes = {name: value.shape[0] if value.ndim else None for name, value in inputs.items()}
    distinct = set(sizes.values())
    if len(distinct) != 1 or None in distinct:
        raise InvalidInput(f"with batching every input of a job needs the same first dimension (its rows); got {sizes}")
    return int(distinct.pop() or 0)


def ttl_of(from_job: int | None, default: int) -> int:
    """The job's own result/failure ttl when it is a positive number of seconds, else ortq's."""
    return min(from_job, MAX_SECONDS) if from_job is not None and from_job > 0 else default

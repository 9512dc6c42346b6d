"""OpenTelemetry traces of ortq jobs (docs/tracing.md), with ``opentelemetry-api`` optional.

Producer: ``submit``/``submit_many``/``infer`` open one ``ortq.send`` span (PRODUCER) per call and
put its W3C context (``traceparent``, ``tracestate``) in each request frame's ``options``, through
the application's global propagator. Worker: one ``ortq.batch`` span (CONSUMER) per batch, linked
to each job's producer context, with ``ortq.decode``/``ortq.run``/``ortq.encode``/``ortq.reply``
children laid out from the timings the worker measures anyway (their durations are those timings;
where they sit is worked out from a few anchors, read once per batch).

Tracing is on only where a real TracerProvider is configured (an SDK's, not the API's default
proxy): without one, or without opentelemetry at all, the producer adds nothing to frames (whose
headers then stay the ones the worker's fast path knows: ortq.knownheaders) and the worker, which
decides once when it is made, does nothing per job. A context read from a frame is anyone's bytes:
it is checked against the W3C format and dropped when it does not match, never logged.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.metadata
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgpack

from ortq import keys
from ortq.wiretypes import MAGIC, MAX_HEADER_BYTES, PREFIX

try:
    from opentelemetry import propagate, trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, TraceState

    AVAILABLE = True
except ImportError:  # the `otel` extra is not installed: every function here is a no-op
    AVAILABLE = False

if TYPE_CHECKING:
    from ortq.rqcompat.book import Finished
    from ortq.worker.intake import Taken
    from ortq.worker.jobs import Failure, Pending

log = logging.getLogger("ortq.tracing")

#: ``messaging.system``: none of the semantic conventions' well-known values fits (Redis stores the
#: jobs; what a message is, and how it is taken and answered, is ortq's), so ortq names itself.
SYSTEM = "ortq"
#: The frame options that carry a W3C trace context (docs/wire-format.md, 6.2).
TRACE_OPTIONS = ("traceparent", "tracestate")
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[ -~]*)?")
_MAX_TRACEPARENT, _MAX_TRACESTATE, _MAX_MEMBERS = 512, 512, 32  # W3C: keep at least 512 chars of tracestate
_KEY = r"(?:[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
_MEMBER = re.compile(rf"({_KEY})=([\x20-\x2b\x2d-\x3c\x3e-\x7e]{{0,255}}[\x21-\x2b\x2d-\x3c\x3e-\x7e])")


class _State:
    override: Any = None  # set_tracer_provider's provider, else the global one
    cached: tuple[Any, Any] = (None, None)  # (provider, its tracer)


_state = _State()
#: The trace options of the ``ortq.send`` span in progress in this context (task, thread).
_sending: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("ortq_sending", default=None)


def set_tracer_provider(provider: Any) -> None:
    """Trace with ``provider`` instead of OpenTelemetry's global one (None: the global one again).
    A worker made before the change keeps what it decided when it was made."""
    _state.override = provider


def tracer() -> Any:
    """The tracer of the provider in use; None when tracing is off: no opentelemetry, or no SDK's
    provider configured (the API's proxy and no-op providers make spans that record nothing)."""
    if not AVAILABLE:
        return None
    provider = _state.override if _state.override is not None else trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    if _state.cached[0] is not provider:
        _state.cached = (provider, provider.get_tracer("ortq", _version()))
    return _state.cached[1]


def _version() -> str | None:
    try:
        return importlib.metadata.version("ortq")
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------- the producer

F = TypeVar("F", bound=Callable[..., list[Any]])
A = TypeVar("A", bound=Callable[..., Awaitable[list[Any]]])


def request_options(nonce: bytes) -> dict[str, Any]:
    """A request frame's ``options``: the nonce, after the trace context of the ``ortq.send`` span
    in progress, if any (the nonce stays last: ortq.knownheaders reads it from the header's end)."""
    carried = _sending.get()
    return {"nonce": nonce} if carried is None else {**carried, "nonce": nonce}


def sends(method: F) -> F:
    """Decorates ``Producer.submit_many`` (which submit and infer call): one ``ortq.send`` span a call."""

    @functools.wraps(method)
    def traced(self: Any, model: str, many_inputs: Iterable[Any], *args: Any, **kwargs: Any) -> list[Any]:
        found = tracer()
        if found is None:
            return method(self, model, many_inputs, *args, **kwargs)
        many = list(many_inputs)
        with _send_span(found, model, len(many), kwargs) as span:
            handles = method(self, model, many, *args, **kwargs)
            _sent(span, handles)
            return handles

    return cast(F, traced)


def sends_async(method: A) -> A:
    """``sends`` for ``AsyncProducer.submit_many``."""

    @functools.wraps(method)
    async def traced(self: Any, model: str, many_inputs: Iterable[Any], *args: Any, **kwargs: Any) -> list[Any]:
        found = tracer()
        if found is None:
            return await method(self, model, many_inputs, *args, **kwargs)
        many = list(many_inputs)
        with _send_span(found, model, len(many), kwargs) as span:
            handles = await method(self, model, many, *args, **kwargs)
            _sent(span, handles)
            return handles

    return cast(A, traced)


class _send_span:
    """The ``ortq.send`` span of one call, current while it runs, its context in ``_sending``."""

    def __init__(self, found: Any, model: str, count: int, options: Mapping[str, Any]) -> None:
        name = model if isinstance(model, str) else repr(model)[:80]
        attributes: dict[str, Any] = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "messaging.destination.name": keys.queue_name(name),
            "ortq.model": name,
        }
        if count != 1:  # the conventions keep it for batches
            attributes["messaging.batch.message_count"] = count
        retries = options.get("retries", 0)
        if isinstance(retries, int) and not isinstance(retries, bool):
            attributes["ortq.job.retries"] = retries  # with a link's retries_left: which attempt that was
        self.manager = found.start_as_current_span("ortq.send", kind=SpanKind.PRODUCER, attributes=attributes)

    def __enter__(self) -> Any:
        span = self.manager.__enter__()
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # the application's propagator: W3C tracecontext unless it chose otherwise
        carried = {key: carrier[key] for key in TRACE_OPTIONS if isinstance(carrier.get(key), str)}
        self.token = _sending.set(carried or None)
        return span

    def __exit__(self, *exc: Any) -> None:
        _sending.reset(self.token)
        self.manager.__exit__(*exc)


def _sent(span: Any, handles: Sequence[Any]) -> None:
    ids = [str(handle.id) for handle in handles]
    if len(ids) == 1:
        span.set_attribute("messaging.message.id", ids[0])
    span.set_attribute("ortq.job.ids", ids)


# ------------------------------------------------------------------------------------ the worker


def for_worker(model: str, worker: str) -> WorkerTracing | None:
    """What a worker traces with, decided once when it is made: None (nothing to do per batch)
    unless a real TracerProvider is configured, or OTEL_TRACES_EXPORTER asks for one here."""
    if not AVAILABLE:
        return None
    found = tracer()
    if found is None and configure_from_env():
        found = tracer()
    if found is None:
        return None
    parent = os.environ.get("ORTQ_TRACE_PARENT", "link").strip().lower()
    if parent not in ("link", "single"):
        log.warning("ORTQ_TRACE_PARENT=%r is neither 'link' nor 'single': batch spans link their jobs", parent)
    return WorkerTracing(found, model, worker, parent_single=parent == "single")


def configure_from_env() -> bool:
    """Set OpenTelemetry's global TracerProvider up from the standard OTEL_* variables, as
    ``ortq worker`` does when OTEL_TRACES_EXPORTER names exporters (``console``, ``otlp``, ...; each an
    installed package's entry point) and opentelemetry-sdk is installed. Each exporter reads its
    own variables (OTEL_EXPORTER_OTLP_ENDPOINT, ...), the batch processor OTEL_BSP_*, the resource
    OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (service.name defaults to ``ortq-worker``).
    Returns whether it did; never raises."""
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n and n != "none"]
    if not names:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_TRACES_EXPORTER is set but opentelemetry-sdk is not installed: no traces")
        return False
    exporters = []
    for name in names:
        found = importlib.metadata.entry_points(group="opentelemetry_traces_exporter", name=name)
        try:
            exporters.append(next(iter(found)).load()())
        except StopIteration:
            log.warning("OTEL_TRACES_EXPORTER names %r, but no installed package provides that exporter", name)
        except Exception as exc:
            log.warning("the trace exporter %r could not be made: %s", name, exc)
    if not exporters:
        return False
    resource = Resource.create({})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "ortq-worker"}))
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True


class WorkerTracing:
    """A worker's tracer, model and name. ``parent_single`` (ORTQ_TRACE_PARENT=single): a batch of
    one job is a child of that job's producer span (its link kept), so that a trace view shows the
    job's whole path in one trace; a batch of several stays a root linking each."""

    def __init__(self, found: Any, model: str, worker: str, parent_single: bool = False) -> None:
        self.tracer, self.model, self.worker = found, model, worker
        self.parent_single = parent_single

    def batch(self, taken: Sequence[Taken]) -> BatchTrace:
        """The trace of a batch the main thread is about to check and run."""
        return BatchTrace(self, taken)


#: One job of a batch: the attributes of its spans, and its stage timings (seconds by stage name).
JobSpans = tuple[dict[str, Any], dict[str, float]]


class BatchTrace:
    """What the spans of one batch are made from, gathered on its way through the worker's threads
    (ortq.worker.loop, ortq.worker.overlap) and turned into spans by ``end`` on the replier's."""

    __slots__ = ("done", "encoded_at", "failures", "finished", "owner", "runs", "taken")

    def __init__(self, owner: WorkerTracing, taken: Sequence[Taken]) -> None:
        self.owner, self.taken, self.done = owner, taken, False
        self.runs: list[tuple[float, float, list[str]]] = []  # perf_counter at its start, seconds, job ids
        self.finished: Sequence[Finished] = ()
        self.failures: Sequence[Failure] = ()
        self.encoded_at: float | None = None

    def ran(self, began: float, seconds: float, members: Sequence[Pending]) -> None:
        """A run of ``members`` began at ``began`` (perf_counter) and took ``seconds``."""
        self.runs.append((began, seconds, [m.job.job_id for m in members]))

    def encoded(self, finished: Sequence[Finished], failures: Sequence[Failure]) -> None:
        """The answers are encoded (one clock read): what follows is writing them."""
        self.finished, self.failures, self.encoded_at = finished, failures, time.perf_counter()

    def end(self) -> None:
        """The batch has been answered (or its answering failed): its spans, once. Never raises."""
        if self.done:
            return
        self.done = True
        try:
            self._emit(time.time_ns(), time.perf_counter())
        except Exception as exc:  # tracing must never cost a job its answer
            log.warning("the spans of a batch could not be recorded: %s", type(exc).__name__)

    def _emit(self, now_ns: int, now: float) -> None:
        owner = self.owner

        def at(perf: float) -> int:  # a perf_counter reading as epoch nanoseconds
            return now_ns - round((now - perf) * 1e9)

        start = min((int(t.started.started_at.timestamp() * 1e9) for t in self.taken), default=now_ns)
        links, ids, jobs = self._jobs()
        failed = {f.started.execution_id: f for f in self.failures}
        context = Context()  # a root: each job's producer is a link
        if owner.parent_single and len(self.taken) == 1 and len(links) == 1:
            context = trace.set_span_in_context(trace.NonRecordingSpan(links[0].context), context)
        span = owner.tracer.start_span(
            "ortq.batch",
            context=context,
            kind=SpanKind.CONSUMER,
            links=links,
            start_time=start,
            attributes={
                "messaging.system": SYSTEM,
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": keys.queue_name(owner.model),
                "messaging.batch.message_count": len(self.taken),
                "messaging.client.id": owner.worker,
                "ortq.model": owner.model,
                "ortq.worker": owner.worker,
                "ortq.job.ids": ids,
                "ortq.job.failed": len(failed),
            },
        )
        self._failure_events(span, failed)
        parent = trace.set_span_in_context(span, Context())
        self._decode_spans(parent, jobs, start, at)
        for began, seconds, run_ids in self.runs:  # a run is shared by the jobs of its group
            attributes = {"ortq.job.ids": run_ids, "messaging.batch.message_count": len(run_ids)}
            self._child("ortq.run", parent, at(began), at(began) + round(seconds * 1e9), attributes)
        if self.encoded_at is not None:
            self._answer_spans(parent, jobs, at(self.encoded_at), now_ns)
        span.end(end_time=now_ns)

    def _jobs(self) -> tuple[list[Any], list[str], list[JobSpans]]:
        """The batch's jobs, in order: the links to their producers' spans (for the frames that
        carry one), their ids, and the attributes of each one's spans with its stage timings."""
        from ortq.rqjob import JobRecord

        timings = {done.started.execution_id: done.timings for done in self.finished}
        timings.update((failure.started.execution_id, failure.timings) for failure in self.failures)
        links, ids, jobs = [], [], []
        for item in self.taken:
            started = item.started
            try:
                retries_left = JobRecord.parse(started.job_id, started.fields).retries_left
            except Exception:  # a record nobody foresaw: its job is failed elsewhere, by its checks
                retries_left = -1
            ids.append(started.job_id)
            attributes: dict[str, Any] = {"messaging.message.id": started.job_id, "ortq.job.retries_left": retries_left}
            context = producer_context(item.frame)
            if context is not None:
                links.append(Link(context, attributes))
            jobs.append((attributes, timings.get(started.execution_id, {})))
        return links, ids, jobs

    def _failure_events(self, span: Any, failed: Mapping[str, Failure]) -> None:
        """An ``ortq.job.failed`` event on the batch's ``span`` for each of its jobs that failed
        (``failed``: by execution id), in the batch's order."""
        for item in self.taken:
            if (failure := failed.get(item.started.execution_id)) is not None:
                retrying = failure.retry is not None
                event = {"messaging.message.id": item.started.job_id, "error.type": failure.error_type}
                span.add_event("ortq.job.failed", {**event, "ortq.job.retrying": retrying})

    def _decode_spans(self, parent: Any, jobs: Sequence[JobSpans], start: int, at: Callable[[float], int]) -> None:
        """The ``ortq.decode`` span of each job that was decoded: one after the other, ending as
        the first run began, none before the batch's ``start``."""
        decode = [(a, round(t["decode"] * 1e9)) for a, t in jobs if "decode" in t]
        cursor = at(min(r[0] for r in self.runs)) - sum(d for _, d in decode) if self.runs else start
        for attributes, took in decode:  # one after the other, ending as the first run began
            cursor = max(cursor, start)
            self._child("ortq.decode", parent, cursor, cursor + took, attributes)
            cursor += took

    def _answer_spans(self, parent: Any, jobs: Sequence[JobSpans], encoded: int, now_ns: int) -> None:
        """The ``ortq.encode`` span of each job that was encoded, one after the other and ending at
        ``encoded`` (epoch ns), then the batch's ``ortq.reply`` span from there to ``now_ns``."""
        encode = [(a, round(t["encode"] * 1e9)) for a, t in jobs if "encode" in t]
        cursor = encoded - sum(d for _, d in encode)
        for attributes, took in encode:  # one after the other, ending as the last was done
            self._child("ortq.encode", parent, cursor, cursor + took, attributes)
            cursor += took
        self._child("ortq.reply", parent, encoded, now_ns, {"messaging.batch.message_count": len(jobs)})

    def _child(self, name: str, parent: Any, start: int, end: int, attributes: Mapping[str, Any]) -> None:
        self.owner.tracer.start_span(name, context=parent, start_time=start, attributes=attributes).end(end_time=end)


def producer_context(frame: object) -> Any:
    """The producer's SpanContext carried in a request frame's options, or None: no frame, no
    context, or one that is not W3C trace context (checked here; its bytes are never logged)."""
    if not isinstance(frame, bytes | bytearray) or frame[:4] != MAGIC or len(frame) < PREFIX.size:
        return None
    size = int.from_bytes(frame[4:8], "little")
    end = PREFIX.size + size
    if size > MAX_HEADER_BYTES or end > len(frame) or frame.find(b"traceparent", PREFIX.size, end) < 0:
        return None  # most frames: no trace context, nothing decoded
    raw = memoryview(frame)[PREFIX.size : end]
    try:
        header = msgpack.unpackb(raw, raw=False, max_str_len=size, max_bin_len=size, max_array_len=size,
                                 max_map_len=size // 2, max_ext_len=0)  # fmt: skip
    except Exception:
        return None
    options = header.get("options") if isinstance(header, dict) else None
    return parse_context(options) if isinstance(options, dict) else None


def parse_context(options: Mapping[str, Any]) -> Any:
    """The remote SpanContext of ``options``' W3C ``traceparent`` (and ``tracestate``), or None."""
    value = options.get("traceparent")
    if not isinstance(value, str) or len(value) > _MAX_TRACEPARENT:
        return None
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or not int(trace_id, 16) or not int(span_id, 16):
        return None
    return SpanContext(
        int(trace_id, 16),
        int(span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(int(flags, 16)),
        trace_state=_trace_state(options.get("tracestate")),
    )


def _trace_state(value: object) -> Any:
    """A W3C ``tracestate``; an empty one when it is absent or any of it is not W3C's format (the
    API's own parser would log the offending member)."""
    if not isinstance(value, str) or len(value) > _MAX_TRACESTATE:
        return TraceState()
    pairs: dict[str, str] = {}
    for member in filter(None, (m.strip(" \t") for m in value.split(","))):
        match = _MEMBER.fullmatch(member)
        if match is None or match.group(1) in pairs or len(pairs) >= _MAX_MEMBERS:
            return TraceState()
        pairs[match.group(1)] = match.group(2)
    return TraceState(list(pairs.items()))

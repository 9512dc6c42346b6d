"""OpenTelemetry traces (ortq.tracing, docs/tracing.md): the producer's ``ortq.send`` span and the
W3C context its frames carry, a real worker's ``ortq.batch`` span linked to every job's producer
and its children made of the timings the frames report, a retried job's executions linked to one
producer span, hostile trace options that fail nothing, and nothing at all with tracing off.
Real Redis, real ONNX Runtime sessions; spans caught by the SDK's in-memory exporter, or written
by a real ``ortq worker`` process that configured its SDK from OTEL_* variables.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import onnxruntime as ort
import pytest
import redis
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from ortq import keys, knownheaders, tracing, wire
from ortq.errors import InferenceFailed
from ortq.producer import AsyncProducer, Producer
from ortq.producer.checks import job_options
from ortq.producer.enqueue import add_enqueue, new_nonce
from ortq.settings import Settings
from tests import onnx_models
from tests.conftest import REPO, WorkerProcesses, eventually
from tests.test_worker_inprocess import Serving, make_worker

X = {"x": np.array([[1, 2, 3, 4]], np.float32)}


@pytest.fixture
def provider() -> Iterator[TracerProvider]:
    """An SDK provider of the test's own (ortq.tracing.set_tracer_provider: the global one stays
    unset, so no other test traces)."""
    made = TracerProvider()
    tracing.set_tracer_provider(made)
    yield made
    tracing.set_tracer_provider(None)
    made.shutdown()


@pytest.fixture
def spans(provider: TracerProvider) -> InMemorySpanExporter:
    """The spans of ``provider``, kept in memory."""
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return Settings.from_url(redis_url, heartbeat_seconds=0.5)


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def traceparent_of(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def options_of(connection: redis.Redis, model: str, job_id: str) -> dict[str, Any]:
    raw = connection.get(keys.request_key(model, job_id))
    assert isinstance(raw, bytes)
    return wire.decode_request(raw).options


def batches_of(exporter: InMemorySpanExporter, job_id: str) -> list[ReadableSpan]:
    return [span for span in named(exporter, "ortq.batch") if job_id in (span.attributes or {})["ortq.job.ids"]]


def test_a_submit_is_one_producer_span_whose_context_every_frame_carries(
    provider: TracerProvider, spans: InMemorySpanExporter, redis_url: str, connection: redis.Redis, model_name: str
) -> None:
    producer = Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True)
    app = provider.get_tracer("app")
    with app.start_as_current_span("request") as parent:
        one = producer.submit(model_name, X, retries=2)
    many = producer.submit_many(model_name, [X, X, X])
    [first, bulk] = named(spans, "ortq.send")
    assert first.kind is SpanKind.PRODUCER and bulk.kind is SpanKind.PRODUCER
    assert first.parent is not None and first.parent.span_id == parent.get_span_context().span_id  # the app's span
    assert first.attributes == {
        "messaging.system": "ortq",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": keys.queue_name(model_name),
        "ortq.model": model_name,
        "ortq.job.retries": 2,
        "messaging.message.id": one.id,
        "ortq.job.ids": (one.id,),
    }
    assert bulk.attributes is not None and bulk.attributes["messaging.batch.message_count"] == 3
    assert bulk.attributes["ortq.job.ids"] == tuple(job.id for job in many)
    # Each frame carries the W3C context of its call's span, the nonce still last (knownheaders).
    options = options_of(connection, model_name, one.id)
    assert options["traceparent"] == traceparent_of(first) and list(options)[-1] == "nonce"
    assert {options_of(connection, model_name, job.id)["traceparent"] for job in many} == {traceparent_of(bulk)}

    async def submit_async() -> list[str]:
        async with AsyncProducer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as aio:
            return [job.id for job in await aio.submit_many(model_name, [X, X])]

    ids = asyncio.run(submit_async())
    [sent] = named(spans, "ortq.send")[2:]
    assert sent.attributes is not None and sent.attributes["ortq.job.ids"] == tuple(ids)
    assert {options_of(connection, model_name, i)["traceparent"] for i in ids} == {traceparent_of(sent)}


def test_a_batch_span_links_every_job_and_its_children_are_the_timings_it_measured(
    spans: InMemorySpanExporter, settings: Settings, tiny_path: Path, model_name: str, connection: redis.Redis
) -> None:
    producer = Producer(settings=settings, allow_unknown_models=True)
    inputs = [{"x": np.full((1, 4), i, np.float32)} for i in range(4)]
    jobs = [producer.submit(model_name, x) for x in inputs]  # queued first: the worker takes them as one batch
    sent = {job.id: span for job, span in zip(jobs, named(spans, "ortq.send"), strict=True)}
    serving = Serving(make_worker(tiny_path, model_name, settings, max_batch=8, rows_independent=True))
    try:
        responses = [producer.wait_response(job.id, model_name, 30, job.proof) for job in jobs]
    finally:
        assert serving.stop() == 0
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    for x, response in zip(inputs, responses, strict=True):
        np.testing.assert_array_equal(response.outputs["y"], session.run(None, x)[0])
    eventually(lambda: all(batches_of(spans, job.id) for job in jobs))
    batches = {span.context.span_id: span for job in jobs for span in batches_of(spans, job.id)}
    assert max(len(span.links) for span in batches.values()) == 4  # one run of all four
    for job, response in zip(jobs, responses, strict=True):
        [batch] = batches_of(spans, job.id)
        assert batch.kind is SpanKind.CONSUMER and batch.parent is None
        attributes = batch.attributes or {}
        assert attributes["ortq.model"] == model_name and attributes["ortq.worker"] == serving.worker.name
        assert attributes["messaging.batch.message_count"] == len(attributes["ortq.job.ids"])
        assert attributes["messaging.destination.name"] == keys.queue_name(model_name)
        # Its link to the job is the job's own producer span, marked with the job's id and retries left.
        [link] = [link for link in batch.links if (link.attributes or {})["messaging.message.id"] == job.id]
        assert link.context.span_id == sent[job.id].context.span_id
        assert link.context.trace_id == sent[job.id].context.trace_id
        assert (link.attributes or {})["ortq.job.retries_left"] == 0
        children = [s for s in spans.get_finished_spans() if s.parent and s.parent.span_id == batch.context.span_id]
        measured = {"ortq.decode": response.timings["decode"], "ortq.encode": encode_timing(connection, job.id)}
        for name, timing in measured.items():
            [child] = [s for s in children if s.name == name and (s.attributes or {})["messaging.message.id"] == job.id]
            assert child.end_time is not None and child.start_time is not None
            assert abs(child.end_time - child.start_time - timing * 1e9) <= 1, name  # the same measurement
        [run] = [s for s in children if s.name == "ortq.run" and job.id in (s.attributes or {})["ortq.job.ids"]]
        assert run.end_time is not None and run.start_time is not None
        assert abs(run.end_time - run.start_time - response.timings["run"] * 1e9) <= 1
        assert batch.start_time is not None and batch.end_time is not None
        assert all(batch.start_time <= s.start_time and s.end_time <= batch.end_time for s in children)  # type: ignore[operator]
        assert {s.name for s in children} == {"ortq.decode", "ortq.run", "ortq.encode", "ortq.reply"}


def test_with_trace_parent_single_a_batch_of_one_job_is_a_child_of_its_producer_span(
    spans: InMemorySpanExporter, settings: Settings, tiny_path: Path, model_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTQ_TRACE_PARENT", "single")  # read when the worker is made
    serving = Serving(make_worker(tiny_path, model_name, settings))
    producer = Producer(settings=settings, allow_unknown_models=True)
    try:
        outputs = producer.infer(model_name, X, timeout=30)  # alone: a batch of one
        xs = [{"x": np.full((1, 4), i, np.float32)} for i in range(3)]
        together = producer.submit_many(model_name, xs)
        for job in together:
            job.result(timeout=30)
    finally:
        assert serving.stop() == 0
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(outputs["y"], session.run(None, X)[0])
    [sent, *_] = named(spans, "ortq.send")
    eventually(lambda: len(named(spans, "ortq.batch")) >= 2)
    [alone, *rest] = named(spans, "ortq.batch")
    assert alone.parent is not None and alone.context is not None and sent.context is not None
    assert (alone.parent.span_id, alone.context.trace_id) == (sent.context.span_id, sent.context.trace_id)
    [link] = alone.links  # the link stays
    assert link.context.span_id == sent.context.span_id
    # The worker runs one job a batch (--max-batch 1): each of the three is a child of their one
    # submit_many span; a batch of several stays a root (the test above, at the default "link").
    [bulk] = named(spans, "ortq.send")[1:]
    assert len(rest) == 3 and all(b.parent is not None and b.parent.span_id == bulk.context.span_id for b in rest)


def encode_timing(connection: redis.Redis, job_id: str) -> float:
    """The ``encode`` timing of RQ's result record of the job (docs/wire-format.md 4.6)."""
    eventually(lambda: connection.exists(f"rq:results:{job_id}") == 1)
    [(_, entry)] = connection.xrevrange(f"rq:results:{job_id}", count=1)
    return float(msgpack.unpackb(base64.b64decode(entry[b"return_value"]))["timings"]["encode"])


def test_each_execution_of_a_retried_job_links_to_its_one_producer_span(
    spans: InMemorySpanExporter, settings: Settings, models_dir: Path, model_name: str
) -> None:
    gather = onnx_models.gather_model(models_dir / "gather.onnx")
    producer = Producer(settings=settings, allow_unknown_models=True)
    job = producer.submit(model_name, {"idx": np.array([9])}, retries=1)  # out of range: every run fails
    [sent] = named(spans, "ortq.send")
    serving = Serving(make_worker(gather, model_name, settings))
    try:
        with pytest.raises(InferenceFailed):
            job.result(timeout=30)
        eventually(lambda: len(batches_of(spans, job.id)) == 2)
    finally:
        assert serving.stop() == 0
    executions = batches_of(spans, job.id)
    retries_left = []
    for batch in executions:
        [link] = batch.links
        assert (link.context.trace_id, link.context.span_id) == (sent.context.trace_id, sent.context.span_id)
        retries_left.append((link.attributes or {})["ortq.job.retries_left"])
        [event] = [e for e in batch.events if e.name == "ortq.job.failed"]
        assert (event.attributes or {})["ortq.job.retrying"] is (retries_left[-1] > 0)
    assert retries_left == [1, 0]  # which attempt each was: ortq.send's ortq.job.retries (1) less this, plus 1


HOSTILE = [
    "garbage\x1b[31m\n<script>",
    "00-" + "0" * 32 + "-00f067aa0ba902b7-01",  # an all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",  # an all-zero span id
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # the version W3C forbids
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # version 00 has nothing after
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # upper case
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" + "x" * 100_000,
    12345,
    b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"],
]
VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("value", HOSTILE)
def test_a_malformed_traceparent_is_no_context(value: object) -> None:
    assert tracing.parse_context({"traceparent": value}) is None


def test_a_well_formed_context_is_read_and_a_malformed_tracestate_dropped() -> None:
    context = tracing.parse_context({"traceparent": VALID, "tracestate": "vendor=abc,other@tenant=x y"})
    assert (context.trace_id, context.span_id) == (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7)
    assert context.is_remote and context.trace_flags.sampled
    assert dict(context.trace_state) == {"vendor": "abc", "other@tenant": "x y"}
    for state in ("vendor=abc,Bad Key=1", "a=1,a=2", ",".join(f"k{i}=v" for i in range(33)), "k=" + "v" * 600, 7):
        context = tracing.parse_context({"traceparent": VALID, "tracestate": state})
        assert context is not None and len(context.trace_state) == 0
    # A later version of the format may add fields after a dash.
    assert tracing.parse_context({"traceparent": "01" + VALID[2:] + "-more"}) is not None


def test_hostile_trace_options_in_frames_written_by_hand_fail_nothing(
    spans: InMemorySpanExporter,
    settings: Settings,
    tiny_path: Path,
    model_name: str,
    connection: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    options = job_options(settings, reply=keys.new_reply_name(settings.result_ttl))  # answered: a reply stream
    ids = []
    with connection.pipeline(transaction=True) as pipe:
        for value in [*HOSTILE, VALID]:
            frame = wire.encode_request(X, {"traceparent": value, "tracestate": "\x00bad\n", "nonce": new_nonce()})
            ids.append(add_enqueue(pipe, model_name, frame, options))
        pipe.execute()
    serving = Serving(make_worker(tiny_path, model_name, settings, max_batch=4, rows_independent=True))
    try:
        producer = Producer(settings=settings)
        for job_id in ids:
            response = producer.wait_response(job_id, model_name, 30)
            assert response.error is None, response.error
            np.testing.assert_array_equal(response.outputs["y"], X["x"] * 2 + 1)
        eventually(lambda: all(batches_of(spans, job_id) for job_id in ids))
    finally:
        assert serving.stop() == 0
    batches = {batch.context.span_id: batch for job_id in ids for batch in batches_of(spans, job_id)}
    assert sorted(i for batch in batches.values() for i in (batch.attributes or {})["ortq.job.ids"]) == sorted(ids)
    linked = [link for batch in batches.values() for link in batch.links]
    assert [(link.attributes or {})["messaging.message.id"] for link in linked] == [ids[-1]]  # the valid one alone
    assert linked[0].context.span_id == 0x00F067AA0BA902B7 and len(linked[0].context.trace_state) == 0
    assert "garbage" not in caplog.text and "\x1b" not in caplog.text and "xxxx" not in caplog.text


def test_with_tracing_off_nothing_is_made(
    spans: InMemorySpanExporter, settings: Settings, tiny_path: Path, model_name: str, connection: redis.Redis
) -> None:
    tracing.set_tracer_provider(None)  # the global provider: the API's proxy, no SDK configured
    assert tracing.tracer() is None and tracing.for_worker(model_name, "w") is None
    producer = Producer(settings=settings, allow_unknown_models=True)
    job = producer.submit(model_name, X)
    # The frame is as it was before tracing: the nonce alone, a header the worker's fast path learns.
    raw = connection.get(keys.request_key(model_name, job.id))
    assert isinstance(raw, bytes) and wire.decode_request_in_full(raw)[0].options.keys() == {"nonce"}
    assert knownheaders.known_frame(raw, settings.max_frame_bytes) is not None
    worker = make_worker(tiny_path, model_name, settings)
    assert worker.tracing is None  # decided once: nothing is done per batch
    serving = Serving(worker)
    try:
        np.testing.assert_array_equal(job.result(timeout=30)["y"], X["x"] * 2 + 1)
    finally:
        assert serving.stop() == 0
    assert spans.get_finished_spans() == ()


def test_without_opentelemetry_installed_ortq_works_as_before(redis_url: str, model_name: str) -> None:
    script = f"""
import sys
sys.modules["opentelemetry"] = None  # as if the `otel` extra were not installed
import numpy as np
from ortq import keys, tracing, wire
from ortq.producer import Producer
from ortq.settings import Settings
assert not tracing.AVAILABLE and tracing.tracer() is None and tracing.for_worker("m", "w") is None
producer = Producer(settings=Settings.from_url({redis_url!r}), allow_unknown_models=True)
job = producer.submit({model_name!r}, {{"x": np.ones((1, 4), np.float32)}})
raw = producer.connection.get(keys.request_key({model_name!r}, job.id))
assert wire.decode_request(raw).options.keys() == {{"nonce"}}
print("ok")
"""
    run = [sys.executable, "-c", script]
    done = subprocess.run(run, check=False, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_worker_process_exports_its_spans_as_the_otel_variables_say(
    spans: InMemorySpanExporter,
    workers: WorkerProcesses,
    redis_url: str,
    tiny_path: Path,
    model_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ortq worker`` sets its SDK up from OTEL_* (here the SDK's console exporter, into its log)."""
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "digits-worker")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    workers.serve(tiny_path, model_name, redis_url)
    producer = Producer(settings=Settings.from_url(redis_url))
    np.testing.assert_array_equal(producer.infer(model_name, X, timeout=30)["y"], X["x"] * 2 + 1)
    [sent] = named(spans, "ortq.send")
    workers.stop_all()  # SIGTERM: a warm stop, and the SDK flushes what is left at exit
    exported = list(json_objects(workers.logs()))
    [batch] = [span for span in exported if span.get("name") == "ortq.batch"]
    assert batch["kind"] == "SpanKind.CONSUMER"
    assert batch["resource"]["attributes"]["service.name"] == "digits-worker"
    [link] = batch["links"]
    assert link["context"]["span_id"] == f"0x{sent.context.span_id:016x}"
    assert link["context"]["trace_id"] == f"0x{sent.context.trace_id:032x}"
    names = {span["name"] for span in exported if span["parent_id"] == batch["context"]["span_id"]}
    assert names == {"ortq.decode", "ortq.run", "ortq.encode", "ortq.reply"}


def json_objects(text: str) -> Iterator[dict[str, Any]]:
    """The JSON objects that begin lines of ``text`` (the console exporter's spans among log lines)."""
    decoder = json.JSONDecoder()
    for start in [i for i in range(len(text)) if text.startswith("{\n", i) and (i == 0 or text[i - 1] == "\n")]:
        try:
            found, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(found, dict):
            yield found

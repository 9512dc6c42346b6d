"""What tracing (ortq.tracing, docs/tracing.md) costs, side by side on one machine:

    python -m bench.tracing [--requests 300] [--drain 1000] [--rounds 3]

End to end, the tiny model through one real ``ortq worker`` (unbatched, then --max-batch 8), sequential
``infer`` p50 and a drained burst's jobs/s, in three setups: **off** (no SDK configured anywhere: what
every ortq user without tracing runs), **producer** (the producer traces, so every frame carries a
traceparent; the worker does not), **both** (the worker exports too: OTEL_TRACES_EXPORTER=console
into /dev/null, so span export is paid, not just span making). Setups alternate per round, and the
median of the rounds is printed. Then, per job, what the worker's decode of a frame costs with and
without a traceparent (a traced frame misses ortq.knownheaders' fast path) and what the producer's
options cost with tracing off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import numpy as np

from ortq import knownheaders, tracing, wire
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests import onnx_models

X = {"x": np.ones((1, 4), np.float32)}


def producer_tracing(on: bool) -> None:
    """The producer's provider: an SDK one exporting to /dev/null, or none."""
    if not on:
        tracing.set_tracer_provider(None)
        return
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=open(os.devnull, "w"))))  # noqa: SIM115
    tracing.set_tracer_provider(provider)


def one_round(url: str, model: Path, setup: str, max_batch: int, requests: int, drain: int) -> tuple[float, float]:
    name = f"bench-tracing-{setup}-{max_batch}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "ortq", "worker", "--model", str(model), "--name", name, "--redis-url", url,
               "--threads", "1", "--max-batch", str(max_batch)]  # fmt: skip
    if max_batch > 1:
        command += ["--max-wait-ms", "1", "--rows-independent"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if setup == "both":
        env["OTEL_TRACES_EXPORTER"] = "console"
    worker = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    producer_tracing(setup != "off")
    try:
        with Producer(settings=Settings.from_url(url)) as producer:
            producer.wait_for_workers(name, 1, timeout=60)
            for _ in range(20):
                producer.infer(name, X, timeout=30)
            samples = []
            for _ in range(requests):
                started = time.perf_counter()
                producer.infer(name, X, timeout=30)
                samples.append(time.perf_counter() - started)
            started = time.perf_counter()
            producer.results(producer.submit_many(name, [X] * drain), timeout=120)
            rate = drain / (time.perf_counter() - started)
    finally:
        producer_tracing(False)
        worker.terminate()
        worker.wait(30)
    return 1e6 * statistics.median(samples), rate


def per_job() -> None:
    nonce = os.urandom(16)
    plain = wire.encode_request(X, {"nonce": nonce})
    traced = wire.encode_request(X, {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "nonce": nonce})
    wire.decode_request_in_full(plain)  # learnt: the worker's fast path knows its header from now on
    other_span = wire.encode_request(X, {"traceparent": "00-" + "3" * 32 + "-" + "4" * 16 + "-01", "nonce": nonce})
    wire.decode_request_in_full(other_span)  # a traced header: learnt up to its traceparent
    limit = wire.DEFAULT_MAX_FRAME_BYTES
    number = 20_000
    cases = {
        "worker decode, frame without trace context (knownheaders fast path)": lambda: knownheaders.known_frame(
            plain, limit
        ),
        "worker decode, frame with a traceparent (full decode)": lambda: wire.decode_request_in_full(traced),
        "worker decode, frame with a traceparent (knownheaders fast path)": lambda: knownheaders.known_frame(
            traced, limit
        ),
        "worker, reading a frame's trace context when tracing": lambda: tracing.producer_context(traced),
        "producer options, before tracing existed ({'nonce': n})": lambda: {"nonce": nonce},
        "producer options, tracing off (tracing.request_options)": lambda: tracing.request_options(nonce),
    }
    for label, call in cases.items():
        seconds = min(timeit.repeat(call, number=number, repeat=5)) / number
        print(f"  {1e6 * seconds:7.2f} us  {label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--drain", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-job-only", action="store_true", help="only the per-job lines (no worker, no Redis)")
    args = parser.parse_args()
    if args.per_job_only:
        per_job()
        return
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as server:
        model = onnx_models.tiny_model(Path(tmp) / "tiny.onnx")
        for max_batch in (1, 8):
            found: dict[str, list[tuple[float, float]]] = {"off": [], "producer": [], "both": []}
            for _ in range(args.rounds):
                for setup, rounds in found.items():
                    rounds.append(one_round(server.url, model, setup, max_batch, args.requests, args.drain))
            print(f"tiny model, --max-batch {max_batch}, median of {args.rounds} rounds:")
            for setup, rounds in found.items():
                p50 = statistics.median(r[0] for r in rounds)
                rate = statistics.median(r[1] for r in rounds)
                print(f"  {setup:>8}: sequential p50 {p50:7.0f} us   drain {rate:7.0f} jobs/s")
    print("per job (best of 5 x 20,000):")
    per_job()


if __name__ == "__main__":
    main()

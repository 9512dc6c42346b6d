"""Side-by-side latency and throughput: direct ``session.run`` vs a raw Redis queue vs ortq.

    python -m bench.latency [--threads 1] [--requests 300] [--drain 300]

For each model (a tiny 1x4 affine model and a 1x3x224x224 float32 conv net) and each system,
in one run on one machine:
- sequential: one request at a time, end to end (encode, enqueue, worker, reply, decode); p50/p99;
- drain: a burst of jobs enqueued at once, then all results awaited; jobs/s.

Systems: ``direct`` (in-process ``session.run``: the floor), ``raw`` (bench/raw_worker.py: bare
LPUSH/BRPOP, same codec and session), ``ortq`` (a real ``ortq worker`` process). The worker and
``direct`` use the same intra-op thread count. Ratios are printed against ``direct`` (latency)
and ``raw`` (drain). Results go to docs/performance.md with the command that produced them.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import redis

from ortq import wire
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests import onnx_models

Inputs = dict[str, np.ndarray]


@dataclass
class Measured:
    system: str
    p50_ms: float
    p99_ms: float
    drain_jobs_per_s: float


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def time_each(call: Callable[[], object], count: int, warmup: int = 20) -> list[float]:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def measure_direct(model: Path, inputs: Inputs, threads: int, requests: int, drain: int) -> Measured:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(model), sess_options=options, providers=["CPUExecutionProvider"])
    samples = time_each(lambda: session.run(None, inputs), requests)
    started = time.perf_counter()
    for _ in range(drain):
        session.run(None, inputs)
    rate = drain / (time.perf_counter() - started)
    return Measured("direct", 1000 * statistics.median(samples), 1000 * percentile(samples, 99), rate)


def measure_raw(model: Path, inputs: Inputs, url: str, threads: int, requests: int, drain: int) -> Measured:
    queue = f"bench:raw:{model.stem}"
    command = [sys.executable, "-m", "bench.raw_worker", "--model", str(model), "--redis-url", url,
               "--queue", queue, "--threads", str(threads)]  # fmt: skip
    r = redis.Redis.from_url(url, socket_timeout=30)
    r.delete(queue, queue + ":reply", queue + ":ready")
    worker = subprocess.Popen(command)
    try:
        while not r.exists(queue + ":ready"):
            time.sleep(0.05)

        def one() -> None:
            r.lpush(queue, wire.encode_request(inputs))
            _, frame = r.brpop([queue + ":reply"], 30)  # type: ignore[misc]
            wire.decode_response(frame)

        samples = time_each(one, requests)
        started = time.perf_counter()
        with r.pipeline(transaction=False) as pipe:
            for _ in range(drain):
                pipe.lpush(queue, wire.encode_request(inputs))
            pipe.execute()
        for _ in range(drain):
            _, frame = r.brpop([queue + ":reply"], 30)  # type: ignore[misc]
            wire.decode_response(frame)
        rate = drain / (time.perf_counter() - started)
    finally:
        r.lpush(queue, b"stop")
        worker.wait(10)
    return Measured("raw", 1000 * statistics.median(samples), 1000 * percentile(samples, 99), rate)


def measure_ortq(model: Path, inputs: Inputs, url: str, threads: int, requests: int, drain: int) -> Measured:
    name = f"bench-{model.stem}"
    command = [sys.executable, "-m", "ortq", "worker", "--model", str(model), "--name", name,
               "--redis-url", url, "--threads", str(threads)]  # fmt: skip
    worker = subprocess.Popen(command)
    try:
        with Producer(settings=Settings.from_url(url)) as producer:
            producer.wait_for_workers(name, 1, timeout=60)
            samples = time_each(lambda: producer.infer(name, inputs, timeout=30), requests)
            started = time.perf_counter()
            jobs = producer.submit_many(name, [inputs] * drain)
            for job in jobs:
                job.result(timeout=60)
            rate = drain / (time.perf_counter() - started)
    finally:
        worker.terminate()
        worker.wait(20)
    return Measured("ortq", 1000 * statistics.median(samples), 1000 * percentile(samples, 99), rate)


def report(model: str, rows: list[Measured]) -> None:
    direct = next(r for r in rows if r.system == "direct")
    raw = next(r for r in rows if r.system == "raw")
    print(f"\n{model}")
    print(f"{'system':8} {'p50 ms':>8} {'p99 ms':>8} {'p50 / direct':>13} {'drain jobs/s':>13} {'drain / raw':>12}")
    for r in rows:
        print(
            f"{r.system:8} {r.p50_ms:8.3f} {r.p99_ms:8.3f} {r.p50_ms / direct.p50_ms:12.2f}x "
            f"{r.drain_jobs_per_s:13.0f} {r.drain_jobs_per_s / raw.drain_jobs_per_s:11.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="ortq vs direct session.run vs a raw Redis queue")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads, same for every system")
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per system")
    parser.add_argument("--drain", type=int, default=300, help="jobs per drain burst")
    parser.add_argument("--models", default="tiny,conv", help="comma-separated: tiny, conv")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    cases = {
        "tiny": (onnx_models.tiny_model, {"x": rng.standard_normal((1, 4)).astype(np.float32)}),
        "conv": (onnx_models.conv_model, {"image": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}),
    }
    print(f"threads={args.threads} requests={args.requests} drain={args.drain} onnxruntime={ort.__version__}")
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as server:
        for name in args.models.split(","):
            build, inputs = cases[name]
            model = build(Path(tmp) / f"{name}.onnx")
            shape = "x".join(str(d) for d in next(iter(inputs.values())).shape)
            rows = [
                measure_direct(model, inputs, args.threads, args.requests, args.drain),
                measure_raw(model, inputs, server.url, args.threads, args.requests, args.drain),
                measure_ortq(model, inputs, server.url, args.threads, args.requests, args.drain),
            ]
            report(f"{name} model, input {shape}", rows)


if __name__ == "__main__":
    main()

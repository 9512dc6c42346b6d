"""Side-by-side latency and throughput: direct ``session.run`` vs a raw Redis queue vs ortq.

    python -m bench.latency [--threads 1] [--requests 300] [--drain 300]

For each model (a tiny 1x4 affine model and a 1x3x224x224 float32 conv net) and each system,
in one run on one machine:
- sequential: one request at a time, end to end (encode, enqueue, worker, reply, decode); p50/p99;
- drain: a burst of jobs enqueued at once, then all results awaited; jobs/s.

Systems: ``direct`` (in-process ``session.run``: the floor), ``raw`` (bench/raw_worker.py: bare
LPUSH/BRPOP, same codec and session), ``plain RQ`` (bench/plain_rq_job.py: tensors pickled in
the job's args, ``rq worker --worker-class rq.SimpleWorker``; at most 100 jobs, it is slow),
``ortq`` (real ``ortq worker`` processes), unbatched and batched (``--max-batch``, 1 ms wait),
with 1 and 2 workers. Every worker and ``direct`` use the same intra-op thread count. Ratios
are printed against ``direct`` (latency) and ``raw`` (drain; raw has one worker). Results go
to docs/performance.md with the command that produced them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

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


def raw_round_trips(
    r: redis.Redis, queue: str, next_inputs: Callable[[], Inputs], requests: int, drain: int, timeout: int
) -> tuple[list[float], float]:
    """Through a bench.raw_worker serving ``queue``: ``requests`` sequential round trips (their
    times) and a drain of ``drain`` frames pushed at once (jobs/s)."""

    def one() -> None:
        r.lpush(queue, wire.encode_request(next_inputs()))
        _, frame = r.brpop([queue + ":reply"], timeout)  # type: ignore[misc]
        wire.decode_response(cast(bytes, frame))

    samples = time_each(one, requests)
    started = time.perf_counter()
    with r.pipeline(transaction=False) as pipe:
        for _ in range(drain):
            pipe.lpush(queue, wire.encode_request(next_inputs()))
        pipe.execute()
    for _ in range(drain):
        _, frame = r.brpop([queue + ":reply"], timeout)  # type: ignore[misc]
        wire.decode_response(cast(bytes, frame))
    return samples, drain / (time.perf_counter() - started)


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

        samples, rate = raw_round_trips(r, queue, lambda: inputs, requests, drain, 30)
    finally:
        r.lpush(queue, b"stop")
        worker.wait(10)
    return Measured("raw", 1000 * statistics.median(samples), 1000 * percentile(samples, 99), rate)


def _drain(submit_all: Callable[[], Callable[[], None]], drain: int) -> float:
    """Jobs/s for a burst: ``submit_all`` enqueues every job and returns the function that waits for them."""
    started = time.perf_counter()
    submit_all()()
    return drain / (time.perf_counter() - started)


def measure_ortq(
    model: Path,
    inputs: Inputs,
    url: str,
    threads: int,
    requests: int,
    drain: int,
    workers: int,
    max_batch: int,
    wait_replicas: int = 0,
) -> Measured:
    """``wait_replicas``: the producer's and the workers' (Settings.wait_replicas; bench/wait_replicas.py)."""
    name = f"bench-{model.stem}-{workers}-{max_batch}-{wait_replicas}"
    command = [sys.executable, "-m", "ortq", "worker", "--model", str(model), "--name", name,
               "--redis-url", url, "--threads", str(threads), "--max-batch", str(max_batch)]  # fmt: skip
    if max_batch > 1:
        command += ["--max-wait-ms", "1", "--rows-independent"]  # conv and digits: one image per row
    env = {**os.environ, "ORTQ_WAIT_REPLICAS": str(wait_replicas)}
    processes = [subprocess.Popen(command, env=env) for _ in range(workers)]
    try:
        with Producer(settings=Settings.from_url(url, wait_replicas=wait_replicas)) as producer:
            producer.wait_for_workers(name, workers, timeout=60)
            samples = time_each(lambda: producer.infer(name, inputs, timeout=30), requests)

            def submit_all() -> Callable[[], None]:
                jobs = producer.submit_many(name, [inputs] * drain)

                def wait() -> None:
                    producer.results(jobs, timeout=120)

                return wait

            rate = _drain(submit_all, drain)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(20)
    label = "ortq" + (f" b{max_batch}" if max_batch > 1 else "") + (f" x{workers}" if workers > 1 else "")
    label += f" wait {wait_replicas}" if wait_replicas else ""
    return Measured(label, 1000 * statistics.median(samples), 1000 * percentile(samples, 99), rate)


def measure_plain_rq(model: Path, inputs: Inputs, url: str, threads: int, requests: int, drain: int) -> Measured:
    """RQ as a user would write it: tensors pickled in the job's args, a SimpleWorker, job.result polling."""
    from rq import Queue
    from rq.job import JobStatus

    queue_name = f"bench-plain-{model.stem}"
    env = {**os.environ, "BENCH_MODEL": str(model), "BENCH_THREADS": str(threads)}
    command = [sys.executable, "-m", "rq.cli", "worker", "--worker-class", "rq.SimpleWorker", "--url", url,
               "--quiet", queue_name]  # fmt: skip
    worker = subprocess.Popen(command, env=env)
    connection = redis.Redis.from_url(url)
    queue = Queue(queue_name, connection=connection)
    try:

        def one() -> None:
            job = queue.enqueue("bench.plain_rq_job.run", inputs)
            while job.get_status(refresh=True) not in (JobStatus.FINISHED, JobStatus.FAILED):
                time.sleep(0.0005)  # plain RQ has no blocking wait for a result
            assert job.return_value() is not None

        samples = time_each(one, min(requests, 100), warmup=5)

        def submit_all() -> Callable[[], None]:
            jobs = [queue.enqueue("bench.plain_rq_job.run", inputs) for _ in range(min(drain, 100))]

            def wait() -> None:
                for job in jobs:
                    while job.get_status(refresh=True) not in (JobStatus.FINISHED, JobStatus.FAILED):
                        time.sleep(0.0005)

            return wait

        rate = _drain(submit_all, min(drain, 100))
    finally:
        worker.terminate()
        worker.wait(20)
    return Measured("plain RQ", 1000 * statistics.median(samples), 1000 * percentile(samples, 99), rate)


def report(model: str, rows: list[Measured]) -> None:
    direct = next(r for r in rows if r.system == "direct")
    raw = next(r for r in rows if r.system == "raw")
    print(f"\n{model}")
    print(f"{'system':12} {'p50 ms':>8} {'p99 ms':>8} {'p50 / direct':>13} {'drain jobs/s':>13} {'drain / raw':>12}")
    for r in rows:
        print(
            f"{r.system:12} {r.p50_ms:8.3f} {r.p99_ms:8.3f} {r.p50_ms / direct.p50_ms:12.2f}x "
            f"{r.drain_jobs_per_s:13.0f} {r.drain_jobs_per_s / raw.drain_jobs_per_s:11.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="ortq vs direct session.run vs a raw Redis queue")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads, same for every system")
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per system")
    parser.add_argument("--drain", type=int, default=300, help="jobs per drain burst")
    parser.add_argument("--models", default="tiny,conv", help="comma-separated: tiny, conv")
    parser.add_argument("--max-batch", type=int, default=32, help="ortq batched runs: --max-batch")
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
            common = (args.threads, args.requests, args.drain)
            rows = [
                measure_direct(model, inputs, *common),
                measure_raw(model, inputs, server.url, *common),
                measure_plain_rq(model, inputs, server.url, *common),
                measure_ortq(model, inputs, server.url, *common, workers=1, max_batch=1),
                measure_ortq(model, inputs, server.url, *common, workers=1, max_batch=args.max_batch),
                measure_ortq(model, inputs, server.url, *common, workers=2, max_batch=1),
                measure_ortq(model, inputs, server.url, *common, workers=2, max_batch=args.max_batch),
            ]
            report(f"{name} model, input {shape}", rows)


if __name__ == "__main__":
    main()

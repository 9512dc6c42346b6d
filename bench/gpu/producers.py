"""End to end through real producers: what users see (issue 27, item 2).

    python -m bench.gpu.producers --models DIR [--provider cuda|cpu] [--producers 8] [--workers 1,2]
        [--jobs N] [--chunk 256] [--in-flight 2] [--workloads digits,digits32,conv] [--metrics]
        [--job-timeout S] [--out FILE.json]

DIR and the workloads are bench/gpu/throughput.py's (``--jobs``: each workload's job count, else
its own). For each workload and worker count, side by side on one Redis (ortq.localredis):

1. **ortq**: P producer *processes* (multiprocessing, spawn) each submit their share of the jobs
   with ``Producer.submit_many`` in chunks of ``--chunk`` and collect them with ``results``,
   pipelined: ``--in-flight`` chunks (2) are submitted before the oldest is waited for, and the
   next is submitted as soon as the oldest's answers are all in, so that a producer always has
   jobs queued while it waits. W real ``ortq worker`` processes (throughput.start_workers, with
   the workload's ``--max-batch``) serve them.
2. **floor**: the same P processes push the same request frames (``wire.encode_request`` of the
   same inputs, encoded once, not per job as ortq must with its nonce; a large one sent as a
   memoryview as ortq sends it) with one RPUSH per chunk onto one plain list, and W consumer
   processes pop them in batches as large as the workers' (BLPOP, then LPOP with a count: Redis
   6.2 has no BLMPOP) and push, for each, a reply of the ortq response's size; no decode, no run.
   Replies go back on **one reply list per producer** (the cheapest fair design: a producer waits
   with one BLPOP plus one LPOP-with-count per wake-up, as ``results`` waits with one XREAD per
   wake-up, and no key is made per job). The list's name is each frame's first 16 bytes, so a
   consumer routes a reply by slicing, and a consumer's replies go in one RPUSH per producer, in
   one pipeline per batch. A producer counts replies: with two chunks in flight a reply to the
   younger chunk may count for the older one, which can only make the floor faster.

The clock runs from the first producer's start (all are connected and warm, an ortq producer has
had one answer) to the last one's last answer. Printed per run: jobs/s of both and ortq/floor,
producer-side CPU per job (each producer's process CPU over its run, summed), worker CPU per job
(/proc, the floor's consumers likewise), Redis CPU per job (INFO cpu) and, of it, scripts
(INFO commandstats: evalsha, eval and fcall). Exit status 0 when every job of both sides was
answered, no ortq job is left on its queue and every sampled answer (each 1/200th job) agrees with
an in-process CPU ``session.run`` on the same inputs (throughput.agreement: the worker's canary rule).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import replace
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import numpy as np
import redis

from bench.gpu.throughput import (
    PROVIDERS,
    WORKLOADS,
    Workload,
    agreement,
    cpu_seconds,
    job_inputs,
    redis_cpu,
    scripts_usec,
    session_for,
    start_workers,
    workload_row,
)
from ortq import keys, wire
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings, frame_argument

SEEDS = 8  # distinct inputs; job n carries job_inputs(work, n % SEEDS)
HEADER = 16  # a floor request's first bytes: its producer's reply list
QUEUE = "floor:requests"
WAIT_S = 300.0  # the longest a producer waits for one chunk: past it, the jobs count as lost


def reply_key(producer: int) -> bytes:
    return b"floor:reply:%04d" % producer  # HEADER bytes


def all_scripts_usec(connection: redis.Redis) -> float:
    """throughput.scripts_usec (evalsha, eval) and FCALL's (ortq's high-priority and unique enqueues)."""
    fcall = connection.info("commandstats").get("cmdstat_fcall", {}).get("usec", 0)
    return scripts_usec(connection) + float(fcall)


# ------------------------------------------------------------------ producer processes


class OrtqSide:
    """One producer process's ortq.Producer; ``collect`` returns the sampled jobs' outputs."""

    def __init__(self, url: str, work: Workload, index: int, stride: int) -> None:
        self.work, self.stride = work, stride
        self.inputs = [job_inputs(work, seed) for seed in range(SEEDS)]
        self.producer = Producer(settings=Settings.from_url(url))
        self.collect(range(1), self.submit(range(1)))  # warm: the signature is cached, a worker answered

    def submit(self, numbers: range) -> Any:
        many = [self.inputs[n % SEEDS] for n in numbers]
        return self.producer.submit_many(self.work.name, many, job_timeout=self.work.job_timeout)

    def collect(self, numbers: range, jobs: Any) -> list[tuple[int, dict[str, np.ndarray]]]:
        outputs = self.producer.results(jobs, WAIT_S)
        return [(n, out) for n, out in zip(numbers, outputs, strict=True) if n % self.stride == 0]

    def close(self) -> None:
        self.producer.close()


class FloorSide:
    """One producer process of the floor: RPUSH a chunk's frames, count replies on its own list."""

    def __init__(self, url: str, work: Workload, index: int, stride: int) -> None:
        self.key = reply_key(index)
        # As ortq's producers send frames: a large one as a memoryview, which redis-py sends without a copy.
        self.frames = [frame_argument(self.key + wire.encode_request(job_inputs(work, s))) for s in range(SEEDS)]
        self.connection = redis.Redis.from_url(url, socket_timeout=None)
        self.connection.delete(self.key)

    def submit(self, numbers: range) -> None:
        self.connection.rpush(QUEUE, *[self.frames[n % SEEDS] for n in numbers])

    def collect(self, numbers: range, _: None) -> list[tuple[int, dict[str, np.ndarray]]]:
        need = len(numbers)
        while need:
            if self.connection.blpop([self.key], WAIT_S) is None:
                raise TimeoutError(f"{need} replies of {len(numbers)} missing after {WAIT_S:g} s")
            need -= 1
            if need:
                need -= len(self.connection.lpop(self.key, need) or [])
        return []

    def close(self) -> None:
        self.connection.close()


def produce(
    kind: str,
    url: str,
    work: Workload,
    numbers: range,
    index: int,
    plan: tuple[int, int, int],
    ready: Barrier,
    go: Event,
    out: Any,
) -> None:
    """A producer process: set up, wait for the start, submit ``numbers`` pipelined, report.
    ``plan``: jobs a chunk, chunks in flight, and every how many jobs an answer is sampled."""
    chunk, in_flight, stride = plan
    report: dict[str, Any] = {"index": index, "answered": 0, "samples": [], "error": None}
    try:
        side = (OrtqSide if kind == "ortq" else FloorSide)(url, work, index, stride)
    except Exception as exc:
        ready.abort()
        out.put({**report, "error": f"set-up: {type(exc).__name__}: {exc}"})
        return
    ready.wait()
    go.wait()
    cpu, report["start"] = time.process_time(), time.monotonic()
    pending: deque[tuple[range, Any]] = deque()
    try:
        for first in range(numbers.start, numbers.stop, chunk):
            part = range(first, min(first + chunk, numbers.stop))
            pending.append((part, side.submit(part)))
            if len(pending) >= in_flight:
                part, handle = pending.popleft()
                report["samples"] += side.collect(part, handle)
                report["answered"] += len(part)
        while pending:
            part, handle = pending.popleft()
            report["samples"] += side.collect(part, handle)
            report["answered"] += len(part)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["end"], report["cpu_s"] = time.monotonic(), time.process_time() - cpu
    side.close()
    out.put(report)


def floor_consumer(url: str, batch: int, reply_bytes: int) -> None:
    """A consumer of the floor: pop up to ``batch`` frames, push a reply to each one's producer."""
    connection = redis.Redis.from_url(url, socket_timeout=None)
    reply = frame_argument(os.urandom(reply_bytes))
    while True:
        _, first = connection.blpop([QUEUE], 0)  # type: ignore[misc]
        frames = [first, *(connection.lpop(QUEUE, batch - 1) or [])] if batch > 1 else [first]
        if b"stop" in frames:  # one for each consumer: another's go back
            others = frames.count(b"stop") - 1
            if others:
                connection.rpush(QUEUE, *[b"stop"] * others)
            return
        with connection.pipeline(transaction=False) as pipe:
            for key, count in Counter(frame[:HEADER] for frame in frames).items():
                pipe.rpush(key, *[reply] * count)
            pipe.execute()


# ------------------------------------------------------------------ one side's run


def drive(kind: str, url: str, work: Workload, servers: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Run ``kind``'s producers against processes ``servers`` (workers or consumers), already up."""
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Barrier(args.producers + 1), ctx.Event(), ctx.Queue()
    bounds = np.linspace(0, work.jobs, args.producers + 1).astype(int)
    stride = max(1, work.jobs // 200)
    processes = [
        ctx.Process(
            target=produce,
            args=(
                kind,
                url,
                work,
                range(bounds[i], bounds[i + 1]),
                i,
                (args.chunk, args.in_flight, stride),
                ready,
                go,
                out,
            ),
        )
        for i in range(args.producers)
    ]
    for process in processes:
        process.start()
    connection = redis.Redis.from_url(url)
    try:
        ready.wait(timeout=300)
    except threading.BrokenBarrierError:
        time.sleep(1)  # for the failed one's report
        errors = [out.get_nowait()["error"] for _ in processes if not out.empty()]
        for process in processes:
            process.kill()
        raise RuntimeError(f"{kind} producers failed to start: {errors}") from None
    server_cpu = sum(cpu_seconds(pid) for pid in servers)
    redis_before, scripts_before = redis_cpu(connection), all_scripts_usec(connection)
    go.set()
    reports = [out.get(timeout=WAIT_S * (1 + work.jobs / args.chunk)) for _ in processes]
    server_cpu = sum(cpu_seconds(pid) for pid in servers) - server_cpu
    redis_spent = redis_cpu(connection) - redis_before
    scripts_spent = all_scripts_usec(connection) - scripts_before
    for process in processes:
        process.join(60)
    seconds = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    answered = sum(r["answered"] for r in reports)
    return {
        "jobs_per_s": work.jobs / seconds,
        "seconds": seconds,
        "answered": answered,
        "lost": work.jobs - answered,
        "errors": [r["error"] for r in reports if r["error"]],
        "producer_cpu_us_per_job": 1e6 * sum(r["cpu_s"] for r in reports) / work.jobs,
        "worker_cpu_us_per_job": 1e6 * server_cpu / work.jobs,
        "redis_cpu_us_per_job": 1e6 * redis_spent / work.jobs,
        "redis_scripts_us_per_job": scripts_spent / work.jobs,
        "samples": sorted((n, out) for r in reports for n, out in r["samples"]),
    }


def ortq_run(url: str, model: Path, work: Workload, count: int, args: argparse.Namespace) -> dict[str, Any]:
    workers = start_workers(url, model, work, args.provider, count, {}, args.metrics)
    try:
        with Producer(settings=Settings.from_url(url)) as producer:
            producer.wait_for_workers(work.name, count, timeout=120)
        run = drive("ortq", url, work, [w.pid for w in workers], args)
        left = redis.Redis.from_url(url).llen(keys.queue_key(work.name))
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(60)
    session = session_for(model, "cpu")
    want = [session.run(None, job_inputs(work, seed))[0] for seed in range(SEEDS)]
    samples = run.pop("samples")
    worst, close = agreement([out for _, out in samples], [want[n % SEEDS] for n, _ in samples])
    return {**run, "left_on_queue": left, "sampled": len(samples), "max_abs_diff_vs_cpu": worst, "outputs_close": close}


def floor_run(url: str, work: Workload, count: int, reply_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    batch = max(1, work.max_batch // work.rows_per_job)
    consumers = [ctx.Process(target=floor_consumer, args=(url, batch, reply_bytes)) for _ in range(count)]
    connection = redis.Redis.from_url(url)
    connection.delete(QUEUE)
    for consumer in consumers:
        consumer.start()
    try:
        run = drive("floor", url, work, [c.pid for c in consumers if c.pid is not None], args)
    finally:
        connection.rpush(QUEUE, *[b"stop"] * count)
        for consumer in consumers:
            consumer.join(30)
        connection.delete(QUEUE, *[reply_key(i) for i in range(args.producers)])
    run.pop("samples")
    return run


def measure(url: str, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    model = args.models / f"{work.model}.onnx"
    row, _, reply_bytes = workload_row(work, model)
    row["runs"] = []
    for count in args.workers:
        ortq = ortq_run(url, model, work, count, args)
        floor = floor_run(url, work, count, reply_bytes, args)
        run = {"workers": count, "ortq": ortq, "floor": floor, "vs_floor": ortq["jobs_per_s"] / floor["jobs_per_s"]}
        row["runs"].append(run)
        print(json.dumps({"workload": work.name, **run}), flush=True)
    return row


def ok_run(run: dict[str, Any]) -> bool:
    ortq, floor = run["ortq"], run["floor"]
    clean = not (ortq["lost"] or ortq["errors"] or ortq["left_on_queue"] or floor["lost"] or floor["errors"])
    return clean and bool(ortq["outputs_close"]) and ortq["sampled"] > 0


def report(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'workload':9} {'w':>2} {'ortq jobs/s':>11} {'floor jobs/s':>12} {'x floor':>7}",
        f"{'producer us/job':>15} {'worker us/job':>13} {'redis us/job':>12} {'scripts':>7} {'max diff':>8} ok",
    )
    print(f"{'':44} {'ortq/floor':>15} {'ortq/floor':>13} {'ortq/floor':>12} {'ortq':>7}")
    for row in rows:
        for run in row["runs"]:
            o, f = run["ortq"], run["floor"]
            print(
                f"{row['workload']:9} {run['workers']:>2} {o['jobs_per_s']:>11.0f} {f['jobs_per_s']:>12.0f} "
                f"{run['vs_floor']:>7.2f} {o['producer_cpu_us_per_job']:>7.0f}/{f['producer_cpu_us_per_job']:<7.0f} "
                f"{o['worker_cpu_us_per_job']:>6.0f}/{f['worker_cpu_us_per_job']:<6.0f} "
                f"{o['redis_cpu_us_per_job']:>5.0f}/{f['redis_cpu_us_per_job']:<6.0f} "
                f"{o['redis_scripts_us_per_job']:>7.1f} {o['max_abs_diff_vs_cpu']:>8.1e} "
                f"{'yes' if ok_run(run) else 'NO'}"
            )
            for error in o["errors"] + f["errors"]:
                print(f"  error: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cuda")
    parser.add_argument("--producers", type=int, default=8, help="producer processes")
    parser.add_argument("--workers", default="1,2", help="worker counts (the floor: as many consumers)")
    parser.add_argument("--jobs", type=int, help="jobs per workload (default: each workload's own)")
    parser.add_argument("--chunk", type=int, default=256, help="jobs per submit_many")
    parser.add_argument("--in-flight", type=int, default=2, help="chunks a producer has submitted and not collected")
    parser.add_argument("--workloads", default="digits,digits32,conv")
    parser.add_argument("--metrics", action="store_true", help="workers serve Prometheus metrics, as deployed")
    parser.add_argument("--job-timeout", type=float, help="each job's timeout (RQ's; a worker stops runs past it)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.workers = [int(c) for c in args.workers.split(",")]
    names = args.workloads.split(",")
    unknown = set(names) - {w.name for w in WORKLOADS}
    if unknown or args.producers < 1 or args.chunk < 1 or args.in_flight < 1:
        parser.error(f"unknown workloads {sorted(unknown)}" if unknown else "--producers, --chunk, --in-flight: >= 1")
    rows = []
    with LocalRedis() as server:
        for work in (w for w in WORKLOADS if w.name in names):
            jobs = max(args.producers, args.jobs or work.jobs)
            rows.append(measure(server.url, replace(work, jobs=jobs, job_timeout=args.job_timeout), args))
    report(rows)
    ok = all(ok_run(run) for row in rows for run in row["runs"])
    if args.out:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"}
        args.out.write_text(json.dumps({"args": settings, "rows": rows, "ok": ok}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""One GPU's throughput through one Redis, side by side in one run: issue 14's three yardsticks.

    python -m bench.gpu.throughput --models DIR [--provider cuda] [--workers 1,2,4] [--out FILE.json]

DIR holds digits.onnx, conv.onnx and image.onnx (tests/onnx_models.py). Four workloads: ``digits``
(one 64-float row a job), ``digits32`` (32 rows a job: a producer that batches itself), ``conv``
(one 3x224x224 image a job: a 602 KB request, a 136-byte answer of ten logits) and ``image`` (the
same image in, a filtered image of the same size out: 602 KB each way). For each, measured here
in one run:

1. **direct**: ``session.run`` on the provider at the batch the workers run (rows/s);
2. **floor**: what this Redis carries for the same traffic and the same number of consumers, with
   nothing else: consumer processes pop the request frames (already in a list) in batches as large
   as the workers', and push a reply of the response's size for each; no decode, no run (jobs/s);
3. **ortq**: 1, 2, 4 real ``ortq worker`` processes with ``--max-batch``: the queue is filled while
   the workers are suspended (``rq suspend``), then drained; jobs/s and rows/s, the workers' CPU per
   job (utime+stime from /proc; the main thread's apart) and Redis's (INFO cpu; of which its
   scripts' time, INFO commandstats), so a miss says which side the time went to; and the median
   of the sampled answers' ``run`` timing (their group's run as the worker timed it; mean and max
   in the JSON) beside direct's time a run.
   ``--metrics``: each worker serves Prometheus metrics (``--metrics-port 0``), as deployed
   workers do (deploy/), so that their per-job cost is in the figures. ``--job-timeout S``: every
   job carries RQ's timeout, which the workers enforce on each run (ortq.worker.deadline).
   ``--rq-results on,off`` runs each drain twice, with and without RQ's result record per job
   (``ORTQ_RQ_RESULTS``), side by side; ``--rq-executions on,off`` likewise for RQ's execution
   records (``ORTQ_RQ_EXECUTIONS``); both: the four combinations.

Ratios printed: ortq rows/s over direct, ortq jobs/s over the floor. Producers are not measured:
the queue is full before the clock starts. Exit status 0 when every drain answered every job with
outputs that agree with a direct CPU run on the same inputs, by the worker's own canary rule
(``compare_with_cpu``; checked on every 1/200th job).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import redis

from ortq import keys, wire
from ortq.errors import CanaryMismatch
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.producer.enqueue import outputs_of
from ortq.rqcompat import layout
from ortq.settings import Settings
from ortq.worker.canary import compare_with_cpu

PROVIDERS = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # file stem in --models
    input_name: str
    row: tuple[int, ...]
    rows_per_job: int
    max_batch: int  # rows a worker runs at once
    jobs: int
    job_timeout: float | None = None  # RQ's timeout of each job (--job-timeout)


WORKLOADS = [
    Workload("digits", "digits", "pixels", (64,), 1, 32, 30_000),
    Workload("digits32", "digits", "pixels", (64,), 32, 32, 3_000),
    Workload("conv", "conv", "image", (3, 224, 224), 1, 8, 2_000),
    Workload("image", "image", "image", (3, 224, 224), 1, 8, 2_000),  # 602 KB answers too
]


def job_inputs(work: Workload, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {work.input_name: rng.standard_normal((work.rows_per_job, *work.row)).astype(np.float32)}


def session_for(model: Path, provider: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(model), providers=[PROVIDERS[provider]])


def direct(work: Workload, model: Path, provider: str, seconds: float = 2.0) -> float:
    """Rows per second of session.run at the workers' batch."""
    session = session_for(model, provider)
    batch = {
        work.input_name: np.concatenate([job_inputs(work, 0)[work.input_name]] * (work.max_batch // work.rows_per_job))
    }
    for _ in range(20):
        session.run(None, batch)
    runs, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        session.run(None, batch)
        runs += 1
    return runs * work.max_batch / elapsed


def cpu_seconds(pid: int, main_thread: bool = False) -> float:
    """A process's CPU time so far (utime+stime); ``main_thread``: its main thread's alone (the one
    that calls ``Run``, whose spin while a CUDA run completes counts as CPU)."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def redis_cpu(connection: redis.Redis) -> float:
    info = connection.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def scripts_usec(connection: redis.Redis) -> float:
    """Redis's time inside scripts so far (µs, INFO commandstats): the part of its CPU that is
    ortq's bookkeeping, the rest being round trips and plain commands."""
    stats = connection.info("commandstats")
    return float(sum(stats.get(f"cmdstat_{name}", {}).get("usec", 0) for name in ("evalsha", "eval")))


def wait_drained(connection: redis.Redis, queue_key: str, total: int, done: Any, timeout: float = 300) -> float:
    """Seconds from the first job leaving ``queue_key`` (which holds ``total``) until ``done()``
    reaches ``total``."""
    deadline = time.monotonic() + timeout
    while connection.llen(queue_key) >= total:
        if time.monotonic() > deadline:
            raise TimeoutError("the drain did not start")
        time.sleep(0.0005)
    started = time.perf_counter()
    while done() < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"drained {done()} of {total}")
        time.sleep(0.002)
    return time.perf_counter() - started


# ------------------------------------------------------------------ the floor


def floor_consumer(url: str, queue_key: str, batch: int, reply_bytes: int) -> None:
    """One consumer of the floor: pop up to ``batch`` frames, push a reply of ``reply_bytes`` each."""
    connection = redis.Redis.from_url(url, socket_timeout=None)
    reply = os.urandom(reply_bytes)
    while True:
        # BLPOP, then LPOP with a count: Redis 6.2 has no BLMPOP (the device's redis-server is 6.2).
        _, first = connection.blpop([queue_key], 0)  # type: ignore[misc]
        frames = [first, *(connection.lpop(queue_key, batch - 1) or [])] if batch > 1 else [first]  # type: ignore[misc,unused-ignore]
        stops = frames.count(b"stop")
        if stops:  # one for each consumer: the ones popped here that are another's go back
            if stops > 1:
                connection.rpush(queue_key, *[b"stop"] * (stops - 1))
            return
        with connection.pipeline(transaction=False) as pipe:
            for _ in frames:
                pipe.rpush(queue_key + ":reply", reply)
            pipe.execute()


def floor(url: str, work: Workload, consumers: int, frame: bytes, reply_bytes: int) -> dict[str, float]:
    connection = redis.Redis.from_url(url)
    queue_key, reply_key = f"floor:{work.name}", f"floor:{work.name}:reply"
    connection.delete(queue_key, reply_key)
    with connection.pipeline(transaction=False) as pipe:
        for i in range(work.jobs):
            pipe.rpush(queue_key, frame)
            if i % 500 == 499:
                pipe.execute()
        pipe.execute()
    before = redis_cpu(connection)
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.gpu.throughput",
                "--floor-consumer",
                url,
                queue_key,
                str(work.max_batch // work.rows_per_job),
                str(reply_bytes),
            ]
        )
        for _ in range(consumers)
    ]
    seconds = wait_drained(connection, queue_key, work.jobs, lambda: connection.llen(reply_key))
    spent = redis_cpu(connection) - before
    connection.rpush(queue_key, *[b"stop"] * consumers)
    for process in processes:
        process.wait(30)
    connection.delete(queue_key, reply_key)
    return {"jobs_per_s": work.jobs / seconds, "redis_cpu_us_per_job": 1e6 * spent / work.jobs}


# ------------------------------------------------------------------ ortq


#: Which of RQ's records a drain's workers write: Settings.rq_results and rq_executions.
Records = dict[str, bool]


def start_workers(
    url: str, model: Path, work: Workload, provider: str, count: int, records: Records, metrics: bool
) -> list[subprocess.Popen[bytes]]:
    adapter = ["--adapter", "0"] if provider != "cpu" else []
    adapter += ["--metrics-port", "0"] if metrics else []
    env = {**os.environ, **{"ORTQ_" + name.upper(): str(int(on)) for name, on in records.items()}}
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ortq",
                "worker",
                "--model",
                str(model),
                "--name",
                work.name,
                "--provider",
                provider,
                *adapter,
                "--redis-url",
                url,
                "--max-batch",
                str(work.max_batch),
                "--max-wait-ms",
                "2",
                "--rows-independent",
                "--threads",
                "1",
                "--worker-name",
                f"{work.name}-{count}-{i}",
            ],
            env=env,
        )
        for i in range(count)
    ]


def ortq_drain(
    url: str, model: Path, work: Workload, provider: str, count: int, records: Records, metrics: bool = False
) -> dict[str, Any]:
    settings = Settings.from_url(url)
    connection = settings.connect()
    connection.set(layout.suspended_key(), 1)
    workers = start_workers(url, model, work, provider, count, records, metrics)
    try:
        with Producer(settings=settings) as producer:
            producer.wait_for_workers(work.name, count, timeout=120)
            inputs = [job_inputs(work, seed) for seed in range(8)]
            many = [inputs[i % 8] for i in range(work.jobs)]
            jobs = producer.submit_many(work.name, many, job_timeout=work.job_timeout)
            finished = layout.QueueKeys.of(keys.queue_name(work.name)).finished
            cpu_before = [cpu_seconds(w.pid) for w in workers]
            main_before = [cpu_seconds(w.pid, main_thread=True) for w in workers]
            redis_before, scripts_before = redis_cpu(connection), scripts_usec(connection)
            connection.delete(layout.suspended_key())
            base = connection.zcard(finished)  # earlier drains' jobs
            seconds = wait_drained(
                connection, keys.queue_key(work.name), work.jobs, lambda: connection.zcard(finished) - base
            )
            worker_cpu = sum(cpu_seconds(w.pid) for w in workers) - sum(cpu_before)
            main_cpu = sum(cpu_seconds(w.pid, main_thread=True) for w in workers) - sum(main_before)
            redis_spent = redis_cpu(connection) - redis_before
            scripts_spent = scripts_usec(connection) - scripts_before
            session = session_for(model, "cpu")
            want = [session.run(None, x)[0] for x in inputs]
            sampled = [jobs[i] for i in range(0, work.jobs, max(1, work.jobs // 200))]
            responses = responses_of(producer, sampled)
            checked = [outputs_of(response, j) for response, j in zip(responses, sampled, strict=True)]
            worst, close = agreement(checked, [want[(i * max(1, work.jobs // 200)) % 8] for i in range(len(checked))])
            # Each answer's "run": its group's run as the worker's main thread timed it (the inputs
            # joined, session.run, the outputs split), GIL hand-back included: against direct's.
            runs = [response.timings["run"] for response in responses if "run" in response.timings]
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(60)
        connection.delete(layout.suspended_key())
    return {
        "workers": count,
        **records,
        "metrics": metrics,
        "jobs_per_s": work.jobs / seconds,
        "rows_per_s": work.jobs * work.rows_per_job / seconds,
        "worker_cpu_us_per_job": 1e6 * worker_cpu / work.jobs,
        "main_thread_cpu_us_per_job": 1e6 * main_cpu / work.jobs,
        "redis_cpu_us_per_job": 1e6 * redis_spent / work.jobs,
        "redis_scripts_us_per_job": scripts_spent / work.jobs,
        "max_abs_diff_vs_cpu": worst,
        "outputs_close": close,
        "run_us_mean": 1e6 * sum(runs) / max(1, len(runs)),
        # The median besides the mean: a drain's first run of a shape can take milliseconds (the
        # provider choosing its kernels), enough to move the mean of ~200 samples by 100 us.
        "run_us_median": 1e6 * float(np.median(runs)) if runs else 0.0,
        "run_us_max": 1e6 * max(runs, default=0.0),
    }


def agreement(got: list[dict[str, np.ndarray]], want: list[np.ndarray]) -> tuple[float, bool]:
    """The largest absolute difference between each job's output and the CPU's, and whether every
    one agrees by the worker's own canary rule (``compare_with_cpu``: for float32, rtol 1e-2 and
    atol 1e-3 of the output's scale; TF32 convolutions on the H200 differ by ~1e-3)."""
    worst, close = 0.0, True
    for out, expected in zip(got, want, strict=True):
        actual = next(iter(out.values()))
        worst = max(worst, float(np.max(np.abs(actual.astype(np.float64) - expected))))
        try:
            compare_with_cpu({"y": actual}, {"y": expected}, "the GPU")
        except CanaryMismatch:
            close = False
    return worst, close


def responses_of(producer: Any, jobs: list[Any]) -> list[Any]:
    """The sampled jobs' responses, each checked against its request: through ``results_of``
    (protocol 3), or for an older tree's ortq (bench/gpu/ab_on_h200.sh measures one with this
    bench) its ``wait_responses`` with the nonces."""
    if hasattr(producer, "results_of"):
        return list(producer.results_of(jobs, 60))
    return list(producer.wait_responses([j.id for j in jobs], 60, [j.nonce for j in jobs]))


def workload_row(work: Workload, model: Path) -> tuple[dict[str, Any], bytes, int]:
    """A workload's report row (what it is), its request frame and its response's size (from a CPU run)."""
    session = session_for(model, "cpu")
    one = job_inputs(work, 0)
    frame = wire.encode_request(one)
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, one), strict=True))
    reply_bytes = len(wire.encode_response(outputs))
    row: dict[str, Any] = {
        "workload": work.name,
        "jobs": work.jobs,
        "rows_per_job": work.rows_per_job,
        "batch_rows": work.max_batch,
        "job_timeout": work.job_timeout,
        "frame_bytes": len(frame),
        "reply_bytes": reply_bytes,
    }
    return row, frame, reply_bytes


def measure(
    url: str,
    models: Path,
    work: Workload,
    provider: str,
    counts: list[int],
    variants: list[Records],
    metrics: bool = False,
) -> dict[str, Any]:
    model = models / f"{work.model}.onnx"
    row, frame, reply_bytes = workload_row(work, model)
    row["direct_rows_per_s"] = direct(work, model, provider)
    row["direct_us_per_run"] = 1e6 * work.max_batch / row["direct_rows_per_s"]
    row["runs"] = []
    for count in counts:
        runs = [ortq_drain(url, model, work, provider, count, records, metrics) for records in variants]
        same_floor = floor(url, work, count, frame, reply_bytes)
        for run in runs:
            run["floor"] = same_floor
            run["vs_floor"] = run["jobs_per_s"] / same_floor["jobs_per_s"]
            run["vs_direct_rows"] = run["rows_per_s"] / row["direct_rows_per_s"]
            row["runs"].append(run)
            print(json.dumps({"workload": work.name, **run}), flush=True)
    return row


def report(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'workload':10} {'w':>2} {'rq res/exe':>10} {'jobs/s':>9} {'rows/s':>10} {'direct rows/s':>13}",
        f"{'x direct':>8} {'floor jobs/s':>12} {'x floor':>7} {'worker us/job':>13} {'redis us/job':>12}",
        f"{'in scripts':>10} {'main us/job':>11} {'run p50 (direct)':>16}",
    )
    for row in rows:
        for run in row["runs"]:
            print(
                f"{row['workload']:10} {run['workers']:>2} {records_label(run):>10} "
                f"{run['jobs_per_s']:>9.0f} {run['rows_per_s']:>10.0f} "
                f"{row['direct_rows_per_s']:>13.0f} {run['vs_direct_rows']:>8.2f} {run['floor']['jobs_per_s']:>12.0f} "
                f"{run['vs_floor']:>7.2f} {run['worker_cpu_us_per_job']:>13.1f} {run['redis_cpu_us_per_job']:>12.1f} "
                f"{run['redis_scripts_us_per_job']:>10.1f} {run.get('main_thread_cpu_us_per_job', 0):>11.1f} "
                f"{run.get('run_us_median', 0):>8.0f} ({row.get('direct_us_per_run', 0):>5.0f})"
            )


def records_label(run: dict[str, Any]) -> str:
    """``on/off``: whether a drain's workers wrote RQ's result and execution records (runs from
    before ``rq_executions`` wrote them)."""
    return "/".join("on" if run.get(name, True) else "off" for name in ("rq_results", "rq_executions"))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--floor-consumer":
        url, queue_key, batch, reply_bytes = sys.argv[2:6]
        floor_consumer(url, queue_key, int(batch), int(reply_bytes))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cuda")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS))
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every workload's job count")
    parser.add_argument("--io-threads", type=int, default=1, help="redis-server's io-threads")
    parser.add_argument(
        "--rq-results",
        default="on",
        help="on, off or on,off: the workers write RQ's result record per job (ORTQ_RQ_RESULTS); both: side by side",
    )
    parser.add_argument(
        "--rq-executions",
        default="on",
        help="on, off or on,off: the workers write RQ's execution records per job (ORTQ_RQ_EXECUTIONS)",
    )
    parser.add_argument("--metrics", action="store_true", help="workers serve Prometheus metrics, as deployed")
    parser.add_argument("--job-timeout", type=float, help="each job's timeout (RQ's; a worker stops runs past it)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    counts = [int(c) for c in args.workers.split(",")]
    chosen = [w for w in WORKLOADS if w.name in args.workloads.split(",")]
    on_off = {"on": True, "off": False}
    variants = [
        {"rq_results": on_off[results], "rq_executions": on_off[executions]}
        for results in args.rq_results.split(",")
        for executions in args.rq_executions.split(",")
    ]
    extra = ("--io-threads", str(args.io_threads)) if args.io_threads > 1 else ()
    rows = []
    with LocalRedis(extra_args=extra) as server:
        for work in chosen:
            jobs = max(64, int(work.jobs * args.scale))
            scaled = Workload(**{**work.__dict__, "jobs": jobs, "job_timeout": args.job_timeout})
            rows.append(measure(server.url, args.models, scaled, args.provider, counts, variants, args.metrics))
    report(rows)
    ok = all(run["outputs_close"] for row in rows for run in row["runs"])
    if args.out:
        args.out.write_text(
            json.dumps({"provider": args.provider, "redis_args": extra, "rows": rows, "ok": ok}, indent=1)
        )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

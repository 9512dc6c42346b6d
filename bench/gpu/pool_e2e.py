"""``ortq pool`` on real NVIDIA GPUs: workers per GPU, where they really run, restarts, throughput.

    python -m bench.gpu.pool_e2e --models DIR [--per-gpu 2] [--jobs 2048] [--out FILE.json]

Run by bench/gpu/run_on_h200.sh on a lent machine (one H200, or two on nvidia-h200-x2). With the
conv model at ``--max-batch 32`` it checks, and prints, each step:

1. ``ortq pool --check`` plans ``--per-gpu`` workers on every GPU (each pinned by ``uuid:``);
2. the pool starts them: ``nvidia-smi --query-compute-apps`` shows exactly those processes, the
   right number on each GPU and none elsewhere, and each worker's published record names the GPU
   it really runs on; its /metrics carry that adapter and CUDAExecutionProvider;
3. throughput: the same number of jobs drained by the workers of one GPU, then by the workers of
   every GPU (two pools, one after the other, in one run; ``--producers`` processes submit);
4. SIGKILL of one worker mid-drain: the pool restarts it on the same GPU, no job is lost, and the
   outputs equal a CPU ``session.run`` of the same inputs (within TF32 tolerance);
5. the same drain with 1, 2, 4 (``--sweep``) workers on the first GPU, for sizing.
Exit status 0 only if every check held.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings

MODEL = "conv"
METRICS_BASE = 9300


def gpus() -> list[dict[str, Any]]:
    listed = json.loads(subprocess.run([sys.executable, "-m", "ortq", "adapters", "--json"], check=True,
                                       capture_output=True, text=True).stdout)  # fmt: skip
    return [a for a in listed if a["provider"] == "cuda"]


def compute_apps() -> list[dict[str, str]]:
    text = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return [
        {"pid": r[0].strip(), "gpu_uuid": r[1].strip(), "used_mib": r[2].strip()}
        for r in csv.reader(io.StringIO(text))
        if r
    ]


#: Each model's one input (name, one row's shape); the queue is named after the model's file.
INPUTS = {"conv": ("image", (1, 3, 224, 224)), "digits": ("pixels", (1, 64))}


def write_config(folder: Path, model: Path, url: str, uuids: list[str], per_gpu: int) -> Path:
    groups = "".join(f'\n[[model.workers]]\nadapter = "uuid:{u}"\ncount = {per_gpu}\n' for u in uuids)
    path = folder / f"pool-{model.stem}-{len(uuids)}gpu.toml"
    path.write_text(
        f'[pool]\nredis_url = "{url}"\nmetrics_port_base = {METRICS_BASE}\ngrace_seconds = 30\n'
        f'log_dir = "{folder / "logs"}"\n\n[[model]]\nname = "{model.stem}"\npath = "{model}"\nprovider = "cuda"\n'
        f"max_batch = 32\nmax_wait_ms = 2\nrows_independent = true\n{groups}"
    )
    return path


def submit_and_wait(url: str, seed: int, count: int, name: str = MODEL) -> list[str]:
    """One producer process: ``count`` jobs for model ``name``, then their results; the job ids."""
    rng = np.random.default_rng(seed)
    input_name, shape = INPUTS[name]
    with Producer(settings=Settings.from_url(url)) as producer:
        x = rng.standard_normal(shape).astype(np.float32)
        jobs = producer.submit_many(name, [{input_name: x}] * count)
        producer.results(jobs, timeout=600)
        return [job.id for job in jobs]


def drain(url: str, jobs: int, producers: int, name: str = MODEL) -> float:
    """Jobs per second for ``jobs`` jobs submitted by ``producers`` processes at once."""
    started = time.perf_counter()
    with ProcessPoolExecutor(producers) as pool:
        list(pool.map(submit_and_wait, [url] * producers, range(producers), [jobs // producers] * producers,
                      [name] * producers))  # fmt: skip
    return jobs / (time.perf_counter() - started)


def run_pool(config: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "ortq", "pool", "--config", str(config)])


def stop_pool(pool: subprocess.Popen[bytes]) -> int:
    pool.send_signal(signal.SIGTERM)
    return pool.wait(60)


def placement(producer: Producer, expected: dict[str, int]) -> dict[str, Any]:
    """Where the pool's workers run, by nvidia-smi and by their own records."""
    records = producer.workers(MODEL)
    apps = compute_apps()
    by_pid = {a["pid"]: a for a in apps}
    per_gpu: dict[str, int] = {}
    for app in apps:
        per_gpu[app["gpu_uuid"]] = per_gpu.get(app["gpu_uuid"], 0) + 1
    own_gpu = all(
        str(r["pid"]) in by_pid and by_pid[str(r["pid"])]["gpu_uuid"] == r["adapter"]["uuid"] for r in records
    )
    labels = []
    for i in range(len(records)):
        with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_BASE + i}/metrics", timeout=5) as response:
            text = response.read().decode()
        labels.append([line for line in text.splitlines() if line.startswith("ortq_worker_ready{")])
    ok = per_gpu == expected and own_gpu and len(records) == sum(expected.values())
    result = {"apps": apps, "per_gpu": per_gpu, "expected": expected, "records_name_their_gpu": own_gpu,
              "ready_samples": labels, "ok": ok}  # fmt: skip
    print(json.dumps(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--per-gpu", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2048)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--sweep", default="1,2,4", help="Workers on the first GPU to compare, e.g. 1,2,4.")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = (args.models / "conv.onnx").resolve()
    found = gpus()
    uuids = [g["uuid"] for g in found]
    report: dict[str, Any] = {"gpus": found, "per_gpu": args.per_gpu, "jobs": args.jobs, "producers": args.producers}
    folder = Path(tempfile.mkdtemp(prefix="ortq-pool-"))
    checks: list[bool] = []
    with LocalRedis() as server, Producer(settings=Settings.from_url(server.url)) as producer:
        rates = {}
        for used in ([uuids[0]], uuids) if len(uuids) > 1 else ([uuids[0]],):
            config = write_config(folder, model, server.url, used, args.per_gpu)
            plan = subprocess.run([sys.executable, "-m", "ortq", "pool", "--config", str(config), "--check"],
                                  check=False, capture_output=True, text=True)  # fmt: skip
            print(plan.stdout, plan.stderr)
            report[f"plan_{len(used)}gpu"] = plan.stdout
            checks.append(plan.returncode == 0)
            pool = run_pool(config)
            try:
                producer.wait_for_workers(MODEL, args.per_gpu * len(used), timeout=300)
                report[f"placement_{len(used)}gpu"] = where = placement(producer, dict.fromkeys(used, args.per_gpu))
                checks.append(where["ok"])
                drain(server.url, 256, args.producers)  # warm-up: CUDA kernels, arenas
                rates[len(used)] = drain(server.url, args.jobs, args.producers)
                print(json.dumps({"gpus": len(used), "jobs_per_s": rates[len(used)]}))
            finally:
                report[f"pool_exit_{len(used)}gpu"] = code = stop_pool(pool)
                checks.append(code == 0)
        report["jobs_per_s"] = rates
        if len(rates) > 1:
            report["two_over_one"] = rates[2] / rates[1]
            checks.append(report["two_over_one"] >= 1.8)
        report["workers_on_one_gpu"] = sweep(producer, folder, model, server.url, uuids[0], args)
        report["kill"] = kill = kill_mid_drain(producer, folder, model, server.url, uuids, args.per_gpu)
        checks.append(kill["ok"])
    report["ok"] = all(checks)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print("ALL CHECKS PASSED" if report["ok"] else "SOME CHECKS FAILED")
    sys.exit(0 if report["ok"] else 1)


def sweep(
    producer: Producer, folder: Path, model: Path, url: str, uuid: str, args: argparse.Namespace
) -> dict[str, float]:
    """Drain jobs/s with 1, 2, 4, ... workers on one GPU, side by side in one run: how many
    workers per GPU pay (docs/operations.md)."""
    rates: dict[str, float] = {}
    for path in (model, model.with_name("digits.onnx")):
        jobs = args.jobs if path.stem == MODEL else 4 * args.jobs
        for count in (int(n) for n in args.sweep.split(",")):
            pool = run_pool(write_config(folder, path, url, [uuid], count))
            try:
                producer.wait_for_workers(path.stem, count, timeout=300)
                drain(url, 256, args.producers, path.stem)
                rates[f"{path.stem} x{count}"] = drain(url, jobs, args.producers, path.stem)
            finally:
                stop_pool(pool)
            print(
                json.dumps(
                    {"model": path.stem, "workers_on_one_gpu": count, "jobs_per_s": rates[f"{path.stem} x{count}"]}
                )
            )
    return rates


def kill_mid_drain(
    producer: Producer, folder: Path, model: Path, url: str, uuids: list[str], per_gpu: int
) -> dict[str, Any]:
    import onnxruntime as ort

    pool = run_pool(write_config(folder, model, url, uuids, per_gpu))
    result: dict[str, Any] = {"ok": False}
    try:
        before = producer.wait_for_workers(MODEL, per_gpu * len(uuids), timeout=300)
        rng = np.random.default_rng(5)
        inputs = [rng.standard_normal((1, 3, 224, 224)).astype(np.float32) for _ in range(64)]
        jobs = producer.submit_many(MODEL, [{"image": x} for x in inputs * 8])
        victim = before[0]
        time.sleep(0.2)
        os.kill(victim["pid"], signal.SIGKILL)
        results = producer.results(jobs, timeout=300)
        deadline = time.monotonic() + 120
        while len(after := producer.workers(MODEL)) < len(before) and time.monotonic() < deadline:
            time.sleep(0.5)
        replacement = [r for r in after if r["pid"] not in {b["pid"] for b in before}]
        cpu = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        want = [cpu.run(None, {"image": x})[0] for x in inputs]
        worst = max(float(np.max(np.abs(r["logits"] - want[i % 64]))) for i, r in enumerate(results))
        same_gpu = [r["adapter"]["uuid"] for r in replacement] == [victim["adapter"]["uuid"]]
        apps = {a["pid"]: a["gpu_uuid"] for a in compute_apps()}
        on_its_gpu = all(apps.get(str(r["pid"])) == victim["adapter"]["uuid"] for r in replacement)
        result = {
            "killed_pid": victim["pid"],
            "replacement_pids": [r["pid"] for r in replacement],
            "replacement_on_same_gpu": same_gpu and on_its_gpu,
            "jobs": len(jobs),
            "all_answered": len(results) == len(jobs),
            "max_abs_diff_vs_cpu": worst,
        }  # fmt: skip
        result["ok"] = bool(result["replacement_on_same_gpu"] and result["all_answered"] and worst < 5e-2)
    finally:
        result["pool_exit"] = stop_pool(pool)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

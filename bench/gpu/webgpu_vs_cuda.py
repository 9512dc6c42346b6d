"""``--provider webgpu`` (Dawn on NVIDIA's Vulkan driver) side by side with ``--provider cuda`` on
one real NVIDIA GPU: adapters, where each worker runs, agreement, throughput.

    python -m bench.gpu.webgpu_vs_cuda --models DIR [--out FILE.json] [--requests 300]
    python -m bench.gpu.webgpu_vs_cuda --models DIR --providers webgpu,cpu   # a smoke run without CUDA

Run by bench/gpu/run_on_h200.sh (``ORTQ_GPU_BENCH=webgpu_vs_cuda``) on the lent H200, with
onnxruntime-gpu and onnxruntime-ep-webgpu installed, the Vulkan loader unpacked from carried .deb
files (bench/gpu/prepare_webgpu.sh), a redis-server on PATH, and DIR holding conv.onnx, tiny.onnx
and digits.onnx. It checks, and prints, each step:

1. ``ortq adapters --json`` lists the GPU twice: as CUDA (NVML) and as WebGPU (Vulkan), the same
   UUID both ways (NVIDIA's Vulkan deviceUUID is the GPU's UUID);
2. for each model, one ``--provider webgpu`` and one ``--provider cuda`` worker: each publishes the
   provider it really runs on, the CPU canary passed, and (WebGPU) how many nodes the EP took;
   both answer the same inputs within tolerance of a CPU ``session.run`` and of each other;
3. speed, in this one run: direct ``session.run`` on each provider (the same session ortq builds)
   at batch 1 and 32, p50 and items/s; ortq's drain (jobs/s) through each worker.
Exit status 0 only if every check of steps 1 and 2 held.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.gpu.cuda_e2e import cpu_run, stop
from bench.latency import time_each
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings

#: Where the lent machine's NVIDIA driver keeps its Vulkan ICD (device README), used when the
#: loader finds no driver by itself.
NVIDIA_ICD = "/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json"
#: The ONNX Runtime EP each compared provider must really run on.
EXPECTED = {"webgpu": "WebGpuExecutionProvider", "cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}


def inputs_for(model: str, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if model == "conv":
        return {"image": rng.standard_normal((batch, 3, 224, 224)).astype(np.float32)}
    if model == "digits":
        return {"pixels": rng.uniform(0, 16, (batch, 64)).astype(np.float32)}
    return {"x": rng.standard_normal((batch, 4)).astype(np.float32)}


def close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[bool, float]:
    worst, ok = 0.0, True
    for name, expected in want.items():
        actual = np.asarray(got[name])
        if expected.dtype.kind == "f":
            scale = max(1.0, float(np.abs(expected).max()))
            ok &= bool(np.allclose(actual, expected, rtol=1e-2, atol=1e-3 * scale))
            worst = max(worst, float(np.abs(actual.astype(np.float64) - expected).max()))
        else:
            ok &= bool(np.array_equal(actual, expected))
    return ok, worst


def start(model: Path, name: str, url: str, provider: str) -> subprocess.Popen[bytes]:
    adapter = ["--adapter", "0"] if provider == "cuda" else []
    return subprocess.Popen([sys.executable, "-m", "ortq", "worker", "--model", str(model), "--name", name,
                             "--provider", provider, *adapter, "--redis-url", url])  # fmt: skip


def session_for(model: Path, provider: str) -> Any:
    """The session an ``ortq worker --provider PROVIDER`` builds, in this process."""
    from ortq.worker.serve import WorkerConfig, resolve_plan
    from ortq.worker.session import load_model

    plan, _ = resolve_plan(WorkerConfig(model, "bench", provider=provider, adapter="0" if provider == "cuda" else None))
    return load_model(model, plan)


def direct_speed(model: Path, stem: str, provider: str) -> dict[str, Any]:
    loaded = session_for(model, provider)
    figures: dict[str, Any] = {"provider": loaded.provider, "nodes": loaded.placement}
    for batch in (1, 32):
        x = inputs_for(stem, batch, seed=5)
        samples = time_each(functools.partial(loaded.run, x), 200 if batch == 1 else 50, warmup=20)
        figures[f"batch{batch}_p50_ms"] = 1000 * statistics.median(samples)
        figures[f"batch{batch}_items_per_s"] = batch / statistics.mean(samples)
    return figures


def serving(producer: Producer, name: str, process: subprocess.Popen[bytes], timeout: float = 300) -> dict[str, Any]:
    """The worker's record once it serves; RuntimeError as soon as its process has exited (a
    refused provider: its message is in the log above) rather than after the whole timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the worker for {name} exited with status {process.returncode} before serving")
        found = producer.workers(name)
        if found:
            return found[0]
        time.sleep(0.5)
    raise RuntimeError(f"no worker for {name} after {timeout:g} s")


def compare_model(
    producer: Producer, models: Path, stem: str, url: str, requests: int, providers: tuple[str, str]
) -> dict[str, Any]:
    path = models / f"{stem}.onnx"
    processes = {p: start(path, f"{stem}-{p}", url, p) for p in providers}
    result: dict[str, Any] = {"model": stem, "ok": False}
    try:
        records = {p: serving(producer, f"{stem}-{p}", processes[p]) for p in providers}
        x = inputs_for(stem, 8, seed=1)
        want = cpu_run(path, x)
        outputs = {p: producer.infer(f"{stem}-{p}", x, timeout=120) for p in providers}
        for p in providers:
            ok, worst = close(outputs[p], want)
            record = records[p]
            result[p] = {
                "provider": record["provider"],
                "adapter": (record.get("adapter") or {}).get("name"),
                "power_preference": (record.get("adapter") or {}).get("power_preference"),
                "canary": record["canary"],
                "nodes": record.get("nodes"),
                "max_abs_diff_vs_cpu": worst,
                "ok": ok and record["canary"]["passed"] and record["provider"] == EXPECTED[p],
            }
            one = inputs_for(stem, 1, seed=2)
            producer.results(producer.submit_many(f"{stem}-{p}", [one] * 20), timeout=120)  # warm
            started = time.perf_counter()
            producer.results(producer.submit_many(f"{stem}-{p}", [one] * requests), timeout=300)
            result[p]["ortq_drain_jobs_per_s"] = requests / (time.perf_counter() - started)
        agree, worst = close(outputs[providers[0]], outputs[providers[1]])
        result["agreement"] = {"between": list(providers), "close": agree, "max_abs_diff": worst}
        result["ok"] = agree and all(result[p]["ok"] for p in providers)
    finally:
        result["exit_codes"] = {p: stop(process) for p, process in processes.items()}
    result["ok"] = result["ok"] and all(code == 0 for code in result["exit_codes"].values())
    print(json.dumps(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--providers", default="webgpu,cuda", help="the two providers to compare")
    args = parser.parse_args()
    first, second = args.providers.split(",")
    providers = (first, second)
    if "VK_DRIVER_FILES" not in os.environ and Path(NVIDIA_ICD).is_file():
        os.environ["VK_DRIVER_FILES"] = NVIDIA_ICD  # inherited by the workers too
    import onnxruntime

    report: dict[str, Any] = {"onnxruntime": onnxruntime.__version__, "providers": list(providers),
                              "vk_driver_files": os.environ.get("VK_DRIVER_FILES")}  # fmt: skip
    listed = json.loads(subprocess.run([sys.executable, "-m", "ortq", "adapters", "--json"], check=True,
                                       capture_output=True, text=True).stdout)  # fmt: skip
    report["adapters"] = listed
    print(json.dumps(listed, indent=1))
    cuda = [a for a in listed if a["provider"] == "cuda"]
    webgpu = [a for a in listed if a["provider"] == "webgpu"]
    if "cuda" in providers:
        report["same_gpu"] = bool(cuda and webgpu and cuda[0]["uuid"] == webgpu[0]["uuid"])
    checks = [report.get("same_gpu", True)]
    with LocalRedis() as server, Producer(settings=Settings.from_url(server.url)) as producer:
        report["models"] = [compare_model(producer, args.models, m, server.url, args.requests, providers)
                            for m in ("conv", "digits", "tiny")]  # fmt: skip
    checks += [m["ok"] for m in report["models"]]
    report["direct"] = {p: direct_speed(args.models / "conv.onnx", "conv", p) for p in providers}
    print(json.dumps(report["direct"], indent=1))
    report["ok"] = all(checks)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print("ALL CHECKS PASSED" if report["ok"] else "SOME CHECKS FAILED")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()

"""The CUDA worker end to end on a real NVIDIA GPU: adapters, selection, outputs vs the CPU, speed.

    python -m bench.gpu.cuda_e2e --models DIR [--out FILE.json]

Run by bench/gpu/run_on_h200.sh on the lent H200 (needs onnxruntime-gpu, a redis-server on
PATH, and DIR holding conv.onnx, tiny.onnx, digits.onnx built here by tests/onnx_models.py).
It checks, and prints, each step:
1. ``ortq adapters --json`` lists the GPU with its UUID, and the CPU;
2. workers started with ``--provider cuda`` and ``--adapter 0``, ``--adapter name:<part of its
   name>`` (or, where several GPUs share the name, that spec is refused as ambiguous) and
   ``--adapter uuid:<prefix>`` all resolve to that GPU, and every other GPU is resolved by its index
   and by its UUID (a two-GPU host: the two-GPU issue's step 1); each worker really runs on
   CUDAExecutionProvider, pass the CPU canary, and return outputs within tolerance of a CPU
   ``session.run`` on the same inputs;
3. side by side in one run: direct CUDA ``session.run`` vs ortq (sequential p50, drain jobs/s)
   on the conv model at batch 1.
Exit status 0 only if every check held.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from bench.latency import time_each
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings


def cpu_run(model: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def start_worker(model: Path, name: str, url: str, adapter: str, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "ortq", "worker", "--model", str(model), "--name", name,
                             "--provider", "cuda", "--adapter", adapter, "--redis-url", url, *extra])  # fmt: skip


def stop(process: subprocess.Popen[bytes]) -> int:
    process.terminate()
    return process.wait(30)


def check_worker(
    producer: Producer, model: Path, name: str, url: str, adapter: str, gpu: dict[str, Any]
) -> dict[str, Any]:
    process = start_worker(model, name, url, adapter)
    try:
        [record] = producer.wait_for_workers(name, 1, timeout=120)
        rng = np.random.default_rng(0)
        signature = producer.signature(name)
        assert signature is not None
        spec = signature.inputs[0]
        shape = tuple(4 if not isinstance(d, int) else d for d in spec.shape)
        x = (rng.standard_normal(shape) * (4 if spec.name == "pixels" else 1)).astype(spec.dtype)
        got = producer.infer(name, {spec.name: x}, timeout=60)
        want = cpu_run(model, {spec.name: x})
        worst = max(float(np.max(np.abs(got[k].astype(np.float64) - want[k]))) for k in want)
        close = all(np.allclose(got[k], want[k], rtol=1e-2, atol=1e-3 * max(1.0, float(np.max(np.abs(want[k])))))
                    for k in want)  # fmt: skip
        result = {
            "adapter_spec": adapter,
            "provider": record["provider"],
            "resolved": record["adapter"],
            "canary": record["canary"],
            "max_abs_diff_vs_cpu": worst,
            "ok": bool(close and record["provider"] == "CUDAExecutionProvider"
                       and record["adapter"]["uuid"] == gpu["uuid"] and record["canary"]["passed"]),
        }  # fmt: skip
    finally:
        result_code = stop(process)
    result["exit_code"] = result_code
    print(json.dumps(result))
    return result


def ambiguous(model: Path, url: str, spec: str) -> dict[str, Any]:
    """A worker started with an --adapter spec that matches several GPUs: refused, exit 2."""
    done = subprocess.run([sys.executable, "-m", "ortq", "worker", "--model", str(model), "--name", "ambiguous",
                           "--provider", "cuda", "--adapter", spec, "--redis-url", url],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    # "exit_code" is that of stopping a worker elsewhere in this script: none was left running here.
    result = {"adapter_spec": spec, "worker_exit": done.returncode, "exit_code": 0, "stderr": done.stderr[-500:],
              "ok": done.returncode == 2 and "AmbiguousAdapter" in done.stderr}  # fmt: skip
    print(json.dumps(result))
    return result


def speed(producer: Producer, model: Path, name: str, url: str, requests: int = 300) -> dict[str, float]:
    x = {"image": np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    session = ort.InferenceSession(str(model), providers=[("CUDAExecutionProvider", {"device_id": "0"})])
    direct = time_each(lambda: session.run(None, x), requests, warmup=50)
    process = start_worker(model, name, url, "0")
    try:
        producer.wait_for_workers(name, 1, timeout=120)
        queued = time_each(lambda: producer.infer(name, x), requests, warmup=30)
        t = time.perf_counter()
        producer.results(producer.submit_many(name, [x] * requests), timeout=60)
        drain = requests / (time.perf_counter() - t)
    finally:
        stop(process)
    figures = {
        "direct_p50_ms": 1000 * statistics.median(direct),
        "ortq_p50_ms": 1000 * statistics.median(queued),
        "ortq_p50_over_direct": statistics.median(queued) / statistics.median(direct),
        "direct_jobs_per_s": 1 / statistics.mean(direct),
        "ortq_drain_jobs_per_s": drain,
    }
    print(json.dumps(figures))
    return figures


def batched_drain(
    producer: Producer, model: Path, url: str, one: dict[str, np.ndarray], batch: int = 32, jobs: int = 512
) -> dict[str, Any]:
    """ortq batched drain (queue filled first) vs direct session.run at the same batch size, per item."""
    session = ort.InferenceSession(str(model), providers=[("CUDAExecutionProvider", {"device_id": "0"})])
    stacked = {name: np.repeat(value, batch, axis=0) for name, value in one.items()}
    for _ in range(20):
        session.run(None, stacked)
    t = time.perf_counter()
    for _ in range(jobs // batch):
        session.run(None, stacked)
    direct_items = jobs / (time.perf_counter() - t)
    name = f"{model.stem}-batch{batch}"
    process = start_worker(model, name, url, "0", "--max-batch", str(batch), "--rows-independent", "--max-wait-ms", "2")
    try:
        producer.wait_for_workers(name, 1, timeout=120)
        for job in producer.submit_many(name, [one] * batch):
            job.result(timeout=60)
        submitted = producer.submit_many(name, [one] * jobs)
        t = time.perf_counter()
        results = producer.results(submitted, timeout=120)
        ortq_items = jobs / (time.perf_counter() - t)
    finally:
        stop(process)
    want = cpu_run(model, one)
    close = all(np.allclose(r[k], want[k], rtol=1e-2, atol=1e-3) for r in results for k in want)
    figures = {
        "model": model.stem,
        "batch": batch,
        "jobs": jobs,
        "direct_items_per_s": direct_items,
        "ortq_batched_items_per_s": ortq_items,
        "ortq_over_direct": ortq_items / direct_items,
        "outputs_close_to_cpu": close,
    }
    print(json.dumps(figures))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report: dict[str, Any] = {"onnxruntime": ort.__version__, "available": ort.get_available_providers()}
    listed = json.loads(subprocess.run([sys.executable, "-m", "ortq", "adapters", "--json"], check=True,
                                       capture_output=True, text=True).stdout)  # fmt: skip
    report["adapters"] = listed
    print(json.dumps(listed, indent=1))
    gpus = [a for a in listed if a["provider"] == "cuda"]
    assert gpus and gpus[0]["uuid"], "no CUDA device listed"
    gpu = gpus[0]
    name_part = gpu["name"].split()[-1]  # e.g. "H200"
    unique_name = sum(name_part in g["name"] for g in gpus) == 1
    with LocalRedis() as server, Producer(settings=Settings.from_url(server.url)) as producer:
        checks = [
            check_worker(producer, args.models / "conv.onnx", "conv-a", server.url, "0", gpu),
            check_worker(producer, args.models / "tiny.onnx", "tiny-c", server.url, f"uuid:{gpu['uuid'][:12]}", gpu),
        ]
        if unique_name:
            checks.append(
                check_worker(producer, args.models / "digits.onnx", "digits-b", server.url, f"name:{name_part}", gpu)
            )
        else:  # several GPUs of one model: a name must be refused as ambiguous, not guessed
            checks.append(ambiguous(args.models / "tiny.onnx", server.url, f"name:{name_part}"))
        # Every other GPU, by index and by UUID: each must resolve to that GPU and no other.
        for i, other in enumerate(gpus[1:], start=1):
            tiny = args.models / "tiny.onnx"
            checks.append(check_worker(producer, tiny, f"tiny-i{i}", server.url, str(i), other))
            checks.append(check_worker(producer, tiny, f"tiny-u{i}", server.url, f"uuid:{other['uuid'][:16]}", other))
        report["checks"] = checks
        report["speed_conv_batch1"] = speed(producer, args.models / "conv.onnx", "conv-speed", server.url)
        rng = np.random.default_rng(2)
        image = {"image": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}
        pixels = {"pixels": rng.uniform(0, 16, (1, 64)).astype(np.float32)}
        report["batched_drain"] = [
            batched_drain(producer, args.models / "conv.onnx", server.url, image),
            batched_drain(producer, args.models / "digits.onnx", server.url, pixels, jobs=2048),
        ]
    ok = all(c["ok"] and c["exit_code"] == 0 for c in checks)
    report["ok"] = ok
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

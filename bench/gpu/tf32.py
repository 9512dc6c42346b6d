"""How much CUDA's TF32 changes answers against the CPU, and that ``use_tf32=0`` takes it away.

    python -m bench.gpu.tf32 [--model PATH] [--inputs 80000] [--batch 1000] [--device-id 0] [--out FILE.json]
    ORTQ_GPU_BENCH=tf32 bash bench/gpu/run_on_h200.sh      # on the device, as the other GPU benches

On the GPU host (bench/gpu/run_on_h200.sh's venv: onnxruntime-gpu, no CPU onnxruntime beside it).
N random digits inputs (64 floats uniform in [0, 16], the range of the demo's pixels; seeded) go
through the bundled digits model (``ortq.demo.MODEL_PATH``, or ``--model``) three ways: the CPU
(the reference), CUDA with ``use_tf32=1`` and CUDA with ``use_tf32=0``. The CUDA sessions are made
by the worker's own code (``ortq.worker.session.load_model`` with ``--provider-option use_tf32=...``),
so that its check that the option was taken (``get_provider_options()``) runs on real CUDA; a
misspelt option is tried too and must be refused. Prints, for each CUDA run, how many labels differ
from the CPU's and the largest absolute difference of the probabilities; writes a JSON report with
what ``get_provider_options()`` reported (tests/test_provider_options.py's CUDA_REPORTED). Exit
status 0 when the misspelt option was refused and ``use_tf32=0`` was reported as taken.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ortq.demo import MODEL_PATH
from ortq.errors import ProviderOptionRejected
from ortq.worker.session import LoadedModel, SessionPlan, load_model


def run_all(model: LoadedModel, pixels: np.ndarray, batch: int) -> dict[str, np.ndarray]:
    parts = [model.run({"pixels": pixels[i : i + batch]}) for i in range(0, len(pixels), batch)]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def compare(name: str, got: dict[str, np.ndarray], cpu: dict[str, np.ndarray]) -> dict[str, Any]:
    mismatched = np.flatnonzero(got["label"] != cpu["label"])
    worst = float(np.max(np.abs(got["probabilities"].astype(np.float64) - cpu["probabilities"])))
    print(f"{name:14} labels differing from the CPU: {len(mismatched)} of {len(cpu['label'])}; "
          f"max abs diff of probabilities {worst:.3g}")  # fmt: skip
    return {"label_mismatches": len(mismatched), "first_mismatches": mismatched[:20].tolist(), "max_abs_diff": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL_PATH)
    parser.add_argument("--models", type=Path, default=None, help="a folder with digits.onnx (run_on_h200.sh's)")
    parser.add_argument("--inputs", type=int, default=80_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--device-id", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.models is not None:
        args.model = args.models / "digits.onnx"
    pixels = np.random.default_rng(args.seed).uniform(0, 16, (args.inputs, 64)).astype(np.float32)
    report: dict[str, Any] = {"inputs": args.inputs, "model": str(args.model)}
    cpu = run_all(load_model(args.model, SessionPlan("cpu", None, None, False)), pixels, args.batch)
    print(f"{args.inputs} random digits inputs, batches of {args.batch}, model {args.model}")
    ok = True
    for tf32 in ("1", "0"):
        plan = SessionPlan("cuda", args.device_id, None, False, user_options=(("use_tf32", tf32),))
        model = load_model(args.model, plan)
        reported = model.session.get_provider_options()["CUDAExecutionProvider"]
        report.setdefault("reported", {})[tf32] = reported
        ok = ok and reported.get("use_tf32") == tf32
        started = time.perf_counter()
        got = run_all(model, pixels, args.batch)
        seconds = time.perf_counter() - started
        report[f"use_tf32={tf32}"] = {**compare(f"use_tf32={tf32}", got, cpu), "seconds": seconds}
    try:
        load_model(args.model, SessionPlan("cuda", args.device_id, None, False, user_options=(("use_tf23", "0"),)))
        report["misspelt"] = "taken: NOT refused"
        ok = False
    except ProviderOptionRejected as exc:  # ONNX Runtime's own refusal, or ortq's read-back
        report["misspelt"] = f"refused: {exc}"
    print(f"use_tf23=0 (misspelt): {report['misspelt']}")
    print("CUDA reports:", json.dumps(report["reported"]["0"]))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

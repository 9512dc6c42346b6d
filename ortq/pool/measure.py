"""Measuring what one worker's session costs, in a fresh interpreter, before the pool starts any.

``python -m ortq.pool.measure MODEL THREADS MAX_BATCH [CUSTOM_OPS]`` imports what a worker imports,
creates the model's session on the CPU exactly as a worker does (ortq.worker.session.load_model, with
the model's custom-op library), runs it once on signature-built inputs of ``MAX_BATCH`` rows, and
prints one JSON line: the process's resident memory before the session (interpreter + ortq + ONNX
Runtime) and after the run (+ weights, CPU arena, activations). A subprocess, because a session's
memory cannot be given back to the OS by deleting it, and the pool itself never loads ONNX Runtime.

For a GPU worker the CPU session's growth stands in for the session's device memory (the same
weights and, roughly, the same activations); the device's own per-process cost (a CUDA context,
cuBLAS/cuDNN workspaces) is not in it: the plan adds an estimate for that and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: How long measuring one model may take (a large model's session takes seconds to create).
MEASURE_TIMEOUT_SECONDS = 180.0


@dataclass(frozen=True)
class SessionFootprint:
    """Resident memory of a measuring process, in bytes."""

    #: Interpreter, ortq's worker modules and ONNX Runtime, before any session.
    baseline_bytes: int
    #: What creating the session and one run at max_batch added.
    session_bytes: int


def resident_bytes() -> int | None:
    """This process's resident memory (Linux: /proc; Windows: the working set), or None."""
    if sys.platform == "win32":
        return _windows_working_set()
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _windows_working_set() -> int | None:
    import ctypes
    from ctypes import wintypes

    class Counters(ctypes.Structure):
        _fields_ = [
            ("cb", wintypes.DWORD),
            ("PageFaultCount", wintypes.DWORD),
            ("PeakWorkingSetSize", ctypes.c_size_t),
            ("WorkingSetSize", ctypes.c_size_t),
            ("QuotaPeakPagedPoolUsage", ctypes.c_size_t),
            ("QuotaPagedPoolUsage", ctypes.c_size_t),
            ("QuotaPeakNonPagedPoolUsage", ctypes.c_size_t),
            ("QuotaNonPagedPoolUsage", ctypes.c_size_t),
            ("PagefileUsage", ctypes.c_size_t),
            ("PeakPagefileUsage", ctypes.c_size_t),
        ]

    counters = Counters()
    counters.cb = ctypes.sizeof(Counters)
    kernel32 = ctypes.WinDLL("kernel32")  # type: ignore[attr-defined,unused-ignore]
    kernel32.GetCurrentProcess.restype = wintypes.HANDLE
    # Without argtypes ctypes passes the pseudo-handle (-1, returned as 2**64 - 1) as a C int.
    kernel32.K32GetProcessMemoryInfo.argtypes = [wintypes.HANDLE, ctypes.POINTER(Counters), wintypes.DWORD]
    kernel32.K32GetProcessMemoryInfo.restype = wintypes.BOOL
    process = kernel32.GetCurrentProcess()
    if not kernel32.K32GetProcessMemoryInfo(process, ctypes.byref(counters), counters.cb):
        return None
    return int(counters.WorkingSetSize)


def measure_session(
    model_path: Path, threads: int | None, max_batch: int, custom_ops: str | None = None
) -> SessionFootprint | str:
    """The footprint of ``model_path``'s CPU session, or why it could not be measured."""
    command = [sys.executable, "-m", "ortq.pool.measure", str(model_path), str(threads or 0), str(max_batch)]
    command += [custom_ops] if custom_ops is not None else []
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=MEASURE_TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        return f"measuring took longer than {MEASURE_TIMEOUT_SECONDS:g} s"
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"the measuring process printed no result ({tail})"
    if "error" in result:
        return str(result["error"])
    return SessionFootprint(int(result["baseline"]), max(0, int(result["after"]) - int(result["baseline"])))


def _main(model: str, threads: int, max_batch: int, custom_ops: str | None) -> dict[str, object]:
    import numpy as np

    from ortq.errors import OrtqError
    from ortq.worker import serve  # noqa: F401  (the modules a worker has loaded: part of the baseline)
    from ortq.worker.batch import check_batchable
    from ortq.worker.custom_ops import library_path
    from ortq.worker.model_signature import guessed_inputs, warmup_inputs
    from ortq.worker.runtime import import_onnxruntime
    from ortq.worker.session import SessionPlan, load_model

    try:
        import_onnxruntime("cpu")
        baseline = resident_bytes()
        library = None if custom_ops is None else library_path(custom_ops)
        plan = SessionPlan("cpu", None, threads or None, allow_cpu_fallback=False, custom_ops=library)
        loaded = load_model(Path(model), plan)
        inputs = warmup_inputs(loaded.signature, encoded=loaded.encoded_inputs)
        if max_batch > 1:  # the worker's batches are concatenated on dim 0, so its activations grow with them
            check_batchable(loaded.signature)  # the worker's own refusal, before inputs it could not join
            inputs = {name: np.repeat(value, max_batch, axis=0) for name, value in inputs.items()}
        try:
            loaded.run(inputs)
        except Exception:
            # A shape guessed for an input of no declared shape may not fit the model: the worker
            # starts without its warm-up run then (session.warm_up), so this measures no run either.
            if not guessed_inputs(loaded.signature, loaded.encoded_inputs):
                raise
    except OrtqError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # ONNX Runtime's own errors on a bad model or a failed run
        return {"error": f"the CPU session failed: {type(exc).__name__}: {exc}"}
    after = resident_bytes()
    if baseline is None or after is None:
        return {"error": "resident memory cannot be read on this platform"}
    return {"baseline": baseline, "after": after}


if __name__ == "__main__":
    custom_ops = sys.argv[4] if len(sys.argv) > 4 else None
    print(json.dumps(_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), custom_ops)), flush=True)

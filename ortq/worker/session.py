"""Building the one ONNX Runtime session a worker owns: provider, adapter, strictness, warm-up.

Rules from the DirectML guide that shape this module:
- DML needs ``enable_mem_pattern=False`` and sequential execution, always;
- ``device_id`` is always passed, since the default adapter lookup can silently end up on the CPU;
- ONNX Runtime drops a provider it cannot create and runs on the CPU; ortq checks
  ``get_providers()`` and refuses unless the CPU was explicitly allowed.
"""

from __future__ import annotations

import importlib
import logging
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ortq.errors import CanaryMismatch, JobTimeout, ModelLoadError, ProviderUnavailable
from ortq.signature import Dim, ModelSignature, TensorSpec
from ortq.worker.runtime import DISTRIBUTION_FOR_PROVIDER, import_onnxruntime, installed_runtimes

log = logging.getLogger("ortq.worker")

#: ortq's provider names and ONNX Runtime's.
EXECUTION_PROVIDERS = {
    "dml": "DmlExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}

#: ONNX tensor element types ortq carries, as ONNX Runtime spells them, to numpy dtype names.
ORT_TENSOR_TYPES = {
    "tensor(bool)": "bool",
    "tensor(int8)": "int8",
    "tensor(int16)": "int16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(uint8)": "uint8",
    "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32",
    "tensor(uint64)": "uint64",
    "tensor(float16)": "float16",
    "tensor(float)": "float32",
    "tensor(double)": "float64",
}


#: ``--policy`` names for ``--provider auto`` and ONNX Runtime's device-selection policies.
AUTO_POLICIES = {
    "prefer-gpu": "PREFER_GPU",
    "max-performance": "MAX_PERFORMANCE",
    "max-efficiency": "MAX_EFFICIENCY",
    "min-overall-power": "MIN_OVERALL_POWER",
}


@dataclass(frozen=True)
class SessionPlan:
    """Everything needed to create the session, decided before ONNX Runtime is touched."""

    provider: str  # "dml" | "cuda" | "cpu" | "auto"
    device_id: int | None
    threads: int | None
    allow_cpu_fallback: bool
    #: More provider options: DML's performance_preference/device_filter when DXGI could not
    #: enumerate adapters and DirectML chooses by preference (device_id is then None).
    extra_options: tuple[tuple[str, str], ...] = ()
    policy: str = "prefer-gpu"  # for provider "auto"

    def provider_options(self) -> dict[str, str]:
        if self.provider in ("cpu", "auto"):
            return {}
        # device_id is passed even when it is 0: without it DML's default adapter lookup
        # goes through dxcore, which can be missing and then quietly yields the CPU.
        options = {} if self.device_id is None else {"device_id": str(self.device_id)}
        return {**options, **dict(self.extra_options)}

    def session_options(self, ort: Any) -> Any:
        options = ort.SessionOptions()
        # "auto" may land on DML, whose requirements are harmless elsewhere.
        if self.provider in ("dml", "auto"):
            options.enable_mem_pattern = False
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if self.threads:
            options.intra_op_num_threads = self.threads
        if self.provider == "auto":
            if not hasattr(options, "set_provider_selection_policy"):
                raise ProviderUnavailable("--provider auto needs onnxruntime >= 1.23 (set_provider_selection_policy)")
            policy = getattr(ort.OrtExecutionProviderDevicePolicy, AUTO_POLICIES[self.policy])
            options.set_provider_selection_policy(policy)
        return options

    def providers(self) -> list[tuple[str, dict[str, str]]] | None:
        if self.provider == "auto":
            return None  # ONNX Runtime chooses, by the policy
        return [(EXECUTION_PROVIDERS[self.provider], self.provider_options())]

    def cpu(self) -> SessionPlan:
        return SessionPlan("cpu", None, self.threads, allow_cpu_fallback=False)


@dataclass
class LoadedModel:
    """The session and what the worker publishes about it."""

    session: Any
    signature: ModelSignature
    provider: str  # the ONNX Runtime provider actually running the model
    device_id: int | None
    fell_back_to_cpu: bool
    output_names: list[str]

    def run_options(self) -> Any:
        return importlib.import_module("onnxruntime").RunOptions()

    def run(self, inputs: dict[str, np.ndarray], timeout: float | None = None) -> dict[str, np.ndarray]:
        """``session.run``; with ``timeout``, stopped by ONNX Runtime itself once that many seconds
        pass (``RunOptions.terminate``, set from a timer thread): a timer-based timeout like RQ's
        cannot interrupt native code."""
        if timeout is None:
            return self._run(inputs, None)
        options = self.run_options()
        timer = threading.Timer(timeout, setattr, (options, "terminate", True))
        timer.start()
        try:
            return self._run(inputs, options)
        except Exception as exc:
            if options.terminate:
                raise JobTimeout(f"the run was stopped after the job's timeout of {timeout:g} s") from exc
            raise
        finally:
            timer.cancel()

    def _run(self, inputs: dict[str, np.ndarray], run_options: Any) -> dict[str, np.ndarray]:
        values = self.session.run(self.output_names, inputs, run_options)
        return dict(zip(self.output_names, values, strict=True))


def _tensor_spec(node: Any, what: str) -> TensorSpec:
    dtype = ORT_TENSOR_TYPES.get(node.type)
    if dtype is None:
        raise ModelLoadError(
            f"{what} {node.name!r} has type {node.type}, which ortq cannot carry "
            f"(supported: {', '.join(sorted(ORT_TENSOR_TYPES))})"
        )
    shape: tuple[Dim, ...] = tuple(d if isinstance(d, int | str) else None for d in node.shape)
    return TensorSpec(name=node.name, dtype=dtype, shape=shape)


def signature_of(session: Any) -> ModelSignature:
    return ModelSignature(
        inputs=tuple(_tensor_spec(node, "input") for node in session.get_inputs()),
        outputs=tuple(_tensor_spec(node, "output") for node in session.get_outputs()),
    )


def warmup_inputs(signature: ModelSignature, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs built from the signature alone: dynamic dims become 1, floats random, the rest zero."""
    rng = np.random.default_rng(seed)
    inputs: dict[str, np.ndarray] = {}
    for spec in signature.inputs:
        shape = tuple(d if isinstance(d, int) and d >= 0 else 1 for d in spec.shape)
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            inputs[spec.name] = rng.standard_normal(shape).astype(dtype)
        else:
            inputs[spec.name] = np.zeros(shape, dtype=dtype)
    return inputs


def platform_refusal(provider: str, system: str | None = None) -> str | None:
    """Why ``provider`` cannot run on this operating system (``platform.system()``: "Windows",
    "Linux", "Darwin") at all, and what to use there instead; None where it can run."""
    system = system or platform.system()
    os_name = {"Darwin": "macOS"}.get(system, system)
    if provider == "dml" and system != "Windows":
        instead = (
            "--provider cuda for an NVIDIA GPU (pip install 'ortq[cuda]'), else --provider cpu"
            if system == "Linux"
            else "--provider cpu"
        )
        return f"DirectML (--provider dml) is Windows-only: onnxruntime-directml has no {os_name} build. Use {instead}"
    if provider == "cuda" and system not in ("Windows", "Linux"):
        return (
            f"CUDA (--provider cuda) does not run on {os_name}: NVIDIA's CUDA and onnxruntime-gpu exist only for "
            "Linux and Windows. Use --provider cpu"
        )
    return None


def install_advice(provider: str, system: str | None = None, installed: list[str] | None = None) -> str:
    """How to get the ONNX Runtime build ``provider`` needs on this operating system, given the
    distributions ``installed`` (only one may be: they share the ``onnxruntime`` package)."""
    system = system or platform.system()
    refusal = platform_refusal(provider, system)
    if refusal is not None:
        return refusal
    installed = [name for name, _ in installed_runtimes()] if installed is None else installed
    package = DISTRIBUTION_FOR_PROVIDER[provider]
    if provider == "cuda" and system == "Linux":
        get = "pip install 'ortq[cuda]'"
    elif provider == "cuda":  # Windows: ortq[cuda] is Linux-only, onnxruntime-gpu is not
        get = "pip install onnxruntime-gpu nvidia-ml-py"
    else:
        get = f"pip install {package}"
    others = [name for name in installed if name != package]
    swap = f"pip uninstall -y {' '.join(others)} && {get}" if others else get
    advice = f"--provider {provider} needs the {package} package ({swap})"
    if provider == "cuda" and system == "Windows":
        advice += "; or --provider dml (onnxruntime-directml), which runs on NVIDIA GPUs too"
    return advice


def _unavailable_reason(ort: Any, plan: SessionPlan) -> str:
    if plan.provider == "auto":
        devices = [f"{d.ep_name} ({d.device.type})" for d in ort.get_ep_devices()]
        return f"--provider auto (policy {plan.policy}) chose the CPU; ONNX Runtime sees these devices: {devices}"
    wanted = EXECUTION_PROVIDERS[plan.provider]
    available = ort.get_available_providers()
    if wanted not in available:
        return f"{wanted} is not in this ONNX Runtime build (it offers {available}); {install_advice(plan.provider)}"
    if plan.provider == "cuda":
        return (
            f"{wanted} is installed but could not start: check the NVIDIA driver, "
            f"the CUDA/cuDNN libraries and device {plan.device_id}"
        )
    return f"{wanted} is installed but could not start on adapter {plan.device_id}: check the GPU driver (DirectX 12)"


def _create(ort: Any, model_path: Path, plan: SessionPlan) -> tuple[Any, str]:
    """The session (or None) and, when it is None or on the wrong provider, why."""
    named = plan.provider not in ("cpu", "auto")
    if named and EXECUTION_PROVIDERS[plan.provider] not in ort.get_available_providers():
        return None, _unavailable_reason(ort, plan)
    try:
        session = ort.InferenceSession(
            str(model_path),
            sess_options=plan.session_options(ort),
            providers=plan.providers(),
            enable_fallback=0,  # no silent retry on the CPU, neither at creation nor in run()
        )
    except ProviderUnavailable:
        raise
    except Exception as exc:  # ONNX Runtime raises its own exception types from C++
        if plan.provider == "cpu":
            raise ModelLoadError(f"ONNX Runtime could not load {model_path}: {exc}") from exc
        return None, f"{_unavailable_reason(ort, plan)} ({exc})"
    actual = session.get_providers()[0]
    if plan.provider == "auto":
        return (session, "") if actual != "CPUExecutionProvider" else (None, _unavailable_reason(ort, plan))
    wanted = EXECUTION_PROVIDERS[plan.provider]
    if actual != wanted:
        return None, f"ONNX Runtime created the session on {actual} instead of {wanted}: " + _unavailable_reason(
            ort, plan
        )
    return session, ""


def load_model(model_path: Path, plan: SessionPlan) -> LoadedModel:
    """Create the session for ``plan`` and verify it really runs on the requested provider."""
    refusal = platform_refusal(plan.provider)
    if refusal is not None:  # before the runtime checks, whose advice would be to install it
        if not plan.allow_cpu_fallback:
            raise ProviderUnavailable(refusal)
        log.warning("%s; running on the CPU because --allow-cpu-fallback was given", refusal)
        model = load_model(model_path, plan.cpu())
        model.fell_back_to_cpu = True
        return model
    ort = import_onnxruntime("cpu" if plan.provider == "auto" else plan.provider)
    if not model_path.is_file():
        raise ModelLoadError(f"model file not found: {model_path}")
    session, reason = _create(ort, model_path, plan)
    if session is None:
        if not plan.allow_cpu_fallback:
            raise ProviderUnavailable(f"{reason}. Pass --allow-cpu-fallback to run on the CPU instead.")
        log.warning("%s; running on the CPU because --allow-cpu-fallback was given", reason)
        model = load_model(model_path, plan.cpu())
        model.fell_back_to_cpu = True
        return model
    provider = session.get_providers()[0]
    return LoadedModel(
        session=session,
        signature=signature_of(session),
        provider=provider,
        device_id=plan.device_id if provider in ("DmlExecutionProvider", "CUDAExecutionProvider") else None,
        fell_back_to_cpu=False,
        output_names=[o.name for o in session.get_outputs()],
    )


def warm_up(model: LoadedModel) -> float:
    """Run the model once on signature-built inputs before taking jobs; returns seconds taken."""
    inputs = warmup_inputs(model.signature)
    started = time.perf_counter()
    try:
        model.run(inputs)
    except Exception as exc:
        raise ModelLoadError(f"warm-up run failed on {model.provider}: {exc}") from exc
    return time.perf_counter() - started


def _tolerance(dtype: np.dtype[Any]) -> tuple[float, float] | None:
    """(rtol, atol relative to the output's scale) for comparing a GPU's output with the CPU's;
    None for exact comparison. Loose enough for TF32 and fused kernels, tight enough that an
    all-zero or garbage output fails."""
    if dtype == np.float16:
        return 5e-2, 1e-2
    if dtype == np.float32:
        return 1e-2, 1e-3
    if dtype == np.float64:
        return 1e-6, 1e-8
    return None


def compare_with_cpu(got: dict[str, np.ndarray], reference: dict[str, np.ndarray], provider: str) -> float:
    """Raise CanaryMismatch unless every output matches the CPU's within its dtype's tolerance;
    returns the largest absolute difference."""
    worst = 0.0
    for name, expected in reference.items():
        actual = np.asarray(got[name])
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            raise CanaryMismatch(
                f"output {name!r}: {actual.dtype}{list(actual.shape)} on {provider}, "
                f"{expected.dtype}{list(expected.shape)} on the CPU"
            )
        if expected.size:
            difference = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
            worst = max(worst, float(np.nanmax(difference)) if not np.isnan(difference).all() else 0.0)
        tolerance = _tolerance(expected.dtype)
        if tolerance is None:
            ok = bool(np.array_equal(actual, expected))
        else:
            rtol, atol = tolerance
            scale = max(1.0, float(np.nanmax(np.abs(expected)))) if expected.size else 1.0
            ok = bool(np.allclose(actual, expected, rtol=rtol, atol=atol * scale, equal_nan=True))
        if not ok:
            raise CanaryMismatch(
                f"output {name!r} on {provider} differs from the CPU's on the warm-up input "
                f"(max abs difference {worst:.3g}); refusing to serve wrong answers. "
                "Check the GPU driver; --skip-canary turns this check off"
            )
    return worst


def canary(model: LoadedModel, model_path: Path, plan: SessionPlan) -> dict[str, Any]:
    """Run the warm-up input on the chosen provider and on the CPU and compare them (seen: a
    DML session that says DML and returns all zeros). Returns the record published with the
    worker; raises CanaryMismatch."""
    if model.provider == "CPUExecutionProvider":
        return {"passed": True, "skipped": "the model runs on the CPU"}
    inputs = warmup_inputs(model.signature, seed=1)
    reference = load_model(model_path, plan.cpu()).run(inputs)
    worst = compare_with_cpu(model.run(inputs), reference, model.provider)
    return {"passed": True, "max_abs_diff": worst}

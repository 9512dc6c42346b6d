"""Building the one ONNX Runtime session a worker owns: provider, adapter, strictness, warm-up.

Rules from the DirectML guide that shape this module:
- DML needs ``enable_mem_pattern=False`` and sequential execution, always;
- ``device_id`` is always passed, since the default adapter lookup can silently end up on the CPU;
- ONNX Runtime drops a provider it cannot create and runs on the CPU; ortq checks
  ``get_providers()`` and refuses unless the CPU was explicitly allowed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ortq.errors import ModelLoadError, ProviderUnavailable
from ortq.signature import Dim, ModelSignature, TensorSpec
from ortq.worker.runtime import DISTRIBUTION_FOR_PROVIDER, import_onnxruntime

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


@dataclass(frozen=True)
class SessionPlan:
    """Everything needed to create the session, decided before ONNX Runtime is touched."""

    provider: str  # "dml" | "cuda" | "cpu"
    device_id: int
    threads: int | None
    allow_cpu_fallback: bool

    def provider_options(self) -> dict[str, str]:
        # device_id is passed even when it is 0: without it DML's default adapter lookup
        # goes through dxcore, which can be missing and then quietly yields the CPU.
        return {} if self.provider == "cpu" else {"device_id": str(self.device_id)}

    def session_options(self, ort: Any) -> Any:
        options = ort.SessionOptions()
        if self.provider == "dml":
            options.enable_mem_pattern = False
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if self.threads:
            options.intra_op_num_threads = self.threads
        return options

    def providers(self) -> list[tuple[str, dict[str, str]]]:
        return [(EXECUTION_PROVIDERS[self.provider], self.provider_options())]


@dataclass
class LoadedModel:
    """The session and what the worker publishes about it."""

    session: Any
    signature: ModelSignature
    provider: str  # the ONNX Runtime provider actually running the model
    device_id: int | None
    fell_back_to_cpu: bool
    output_names: list[str]

    def run(self, inputs: dict[str, np.ndarray], run_options: Any = None) -> dict[str, np.ndarray]:
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


def _unavailable_reason(ort: Any, plan: SessionPlan) -> str:
    wanted = EXECUTION_PROVIDERS[plan.provider]
    available = ort.get_available_providers()
    distribution = DISTRIBUTION_FOR_PROVIDER[plan.provider]
    if wanted not in available:
        return (
            f"{wanted} is not in this ONNX Runtime build (it offers {available}); "
            f"--provider {plan.provider} needs the {distribution} package"
        )
    if plan.provider == "cuda":
        return (
            f"{wanted} is installed but could not start: check the NVIDIA driver, "
            f"the CUDA/cuDNN libraries and device {plan.device_id}"
        )
    return f"{wanted} is installed but could not start on adapter {plan.device_id}: check the GPU driver (DirectX 12)"


def load_model(model_path: Path, plan: SessionPlan) -> LoadedModel:
    """Create the session for ``plan`` and verify it really runs on the requested provider."""
    ort = import_onnxruntime(plan.provider)
    if not model_path.is_file():
        raise ModelLoadError(f"model file not found: {model_path}")
    wanted = EXECUTION_PROVIDERS[plan.provider]
    reason = ""
    session = None
    if plan.provider == "cpu" or wanted in ort.get_available_providers():
        try:
            session = ort.InferenceSession(
                str(model_path),
                sess_options=plan.session_options(ort),
                providers=plan.providers(),
                enable_fallback=0,  # no silent retry on the CPU, neither at creation nor in run()
            )
        except Exception as exc:  # ONNX Runtime raises its own exception types from C++
            if plan.provider == "cpu":
                raise ModelLoadError(f"ONNX Runtime could not load {model_path}: {exc}") from exc
            reason = f"{_unavailable_reason(ort, plan)} ({exc})"
    if session is not None and session.get_providers()[0] != wanted:
        reason = (
            f"ONNX Runtime created the session on {session.get_providers()[0]} instead of {wanted}: "
            + _unavailable_reason(ort, plan)
        )
        session = None
    elif session is None and not reason:
        reason = _unavailable_reason(ort, plan)

    if session is None:
        if not plan.allow_cpu_fallback:
            raise ProviderUnavailable(f"{reason}. Pass --allow-cpu-fallback to run on the CPU instead.")
        log.warning("%s; running on the CPU because --allow-cpu-fallback was given", reason)
        model = load_model(model_path, SessionPlan("cpu", 0, plan.threads, allow_cpu_fallback=False))
        model.fell_back_to_cpu = True
        return model
    return LoadedModel(
        session=session,
        signature=signature_of(session),
        provider=wanted,
        device_id=None if plan.provider == "cpu" else plan.device_id,
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

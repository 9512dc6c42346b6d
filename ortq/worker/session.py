"""Building the one ONNX Runtime session a worker owns: provider, adapter, strictness, warm-up.

Rules from the DirectML guide that shape this module:
- DML needs ``enable_mem_pattern=False`` and sequential execution, always;
- ``device_id`` is always passed, since the default adapter lookup can silently end up on the CPU;
- ONNX Runtime drops a provider it cannot create and runs on the CPU; ortq checks
  ``get_providers()`` and refuses unless the CPU was explicitly allowed;
- an EP that was created can still take none of the model's nodes (all of them left to the CPU):
  where ONNX Runtime records the assignment (>= 1.24), ortq counts the nodes each EP took,
  refuses a session whose requested EP took none, and publishes the counts.

Plugin EPs (``webgpu``, ``plugin``, ``winml``) are added to the session options by
``ortq.devices.plugin_ep.add_plugin_provider`` from the plan: their libraries, the EP device, config entries.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from ortq.devices.plugin_ep import RECORD_ASSIGNMENT, add_plugin_provider, ep_failure, node_placement
from ortq.errors import ConfigurationError, JobTimeout, ModelLoadError, ProviderUnavailable
from ortq.signature import ModelSignature
from ortq.worker import custom_ops, encoded_images, onnx_shapes, provider_options
from ortq.worker.canary import compare_with_cpu  # also imported from here by bench/ and tests
from ortq.worker.deadline import RunDeadline
from ortq.worker.model_signature import encoded_inputs, guessed_inputs, signature_of, warmup_inputs
from ortq.worker.runtime import import_onnxruntime, install_advice, installed_runtimes, platform_refusal

log = logging.getLogger("ortq.worker")

#: ortq's provider names and ONNX Runtime's.
EXECUTION_PROVIDERS = {
    "dml": "DmlExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
#: Providers reached through ONNX Runtime's plugin-EP API (ortq/devices/plugin_ep.py, winml.py).
PLUGIN_PROVIDERS = ("webgpu", "plugin", "winml")

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

    provider: str  # "dml" | "cuda" | "cpu" | "auto" | "webgpu" | "plugin" | "winml"
    device_id: int | None
    threads: int | None
    allow_cpu_fallback: bool
    #: More provider options: DML's performance_preference/device_filter when DXGI could not
    #: enumerate adapters and DirectML chooses by preference (device_id is then None); a plugin
    #: EP's provider options.
    extra_options: tuple[tuple[str, str], ...] = ()
    policy: str = "prefer-gpu"  # for provider "auto" (and "winml" without an EP device)
    #: Plugin EPs: the EP, the libraries to register first (registration name, path), which of the
    #: EP's devices (its index in get_ep_devices()), session config entries (the WebGPU EP's power
    #: preference), and why it cannot run, when that was found while resolving the adapter.
    ep_name: str | None = None
    libraries: tuple[tuple[str, str], ...] = ()
    ep_device: int | None = None
    config_entries: tuple[tuple[str, str], ...] = ()
    unavailable: str | None = None
    #: The custom-op library to register (``--custom-ops``, resolved to a path), CPU sessions included.
    custom_ops: str | None = None
    #: The user's ``--provider-option`` pairs, passed after ortq's own (ortq.worker.provider_options).
    user_options: tuple[tuple[str, str], ...] = ()
    #: ONNX Runtime's least severe log line let through (``--ort-log-level``; 3: errors).
    log_severity: int = 3

    @property
    def wanted_ep(self) -> str | None:
        """The ONNX Runtime EP the session must run on; None where ONNX Runtime chooses."""
        return EXECUTION_PROVIDERS.get(self.provider) or self.ep_name

    def provider_options(self) -> dict[str, str]:
        """ortq's own options, then the user's (a user's option that ortq sets too is refused)."""
        return provider_options.merged(self._own_options(), self.user_options)

    def _own_options(self) -> dict[str, str]:
        if self.provider in PLUGIN_PROVIDERS:
            return dict(self.extra_options)
        if self.provider in ("cpu", "auto"):
            return {}
        # device_id is passed even when it is 0: without it DML's default adapter lookup
        # goes through dxcore, which can be missing and then quietly yields the CPU.
        options = {} if self.device_id is None else {"device_id": str(self.device_id)}
        return {**options, **dict(self.extra_options)}

    def session_options(self, ort: Any) -> Any:
        options = ort.SessionOptions()
        options.log_severity_level = self.log_severity
        # "auto" and "winml" may land on DML, whose requirements are harmless elsewhere.
        if self.provider in ("dml", "auto", "winml"):
            options.enable_mem_pattern = False
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if self.threads:
            options.intra_op_num_threads = self.threads
        options.add_session_config_entry(RECORD_ASSIGNMENT, "1")
        if self.custom_ops is not None:
            custom_ops.register(options, self.custom_ops)
        if self.provider in PLUGIN_PROVIDERS:
            add_plugin_provider(ort, options, self)
        if self.provider == "auto" or (self.provider in PLUGIN_PROVIDERS and self.ep_name is None):
            if not hasattr(options, "set_provider_selection_policy"):
                raise ProviderUnavailable("--provider auto needs onnxruntime >= 1.23 (set_provider_selection_policy)")
            policy = getattr(ort.OrtExecutionProviderDevicePolicy, AUTO_POLICIES[self.policy])
            options.set_provider_selection_policy(policy)
        return options

    def providers(self) -> list[tuple[str, dict[str, str]]] | None:
        if self.provider == "auto" or self.provider in PLUGIN_PROVIDERS:
            return None  # ONNX Runtime chooses by the policy, or the session options carry the EP device
        return [(EXECUTION_PROVIDERS[self.provider], self.provider_options())]

    def cpu(self) -> SessionPlan:
        """The CPU session of the same model (a fallback, the canary's reference): its custom ops too,
        not the user's provider options, which were meant for the requested provider."""
        return SessionPlan("cpu", None, self.threads, allow_cpu_fallback=False, custom_ops=self.custom_ops)


@dataclass
class LoadedModel:
    """The session and what the worker publishes about it."""

    session: Any
    signature: ModelSignature
    provider: str  # the ONNX Runtime provider actually running the model
    device_id: int | None
    fell_back_to_cpu: bool
    output_names: list[str]
    #: Nodes each EP took (ONNX Runtime's assignment record); None where it cannot say.
    placement: dict[str, int] | None = None
    #: The user's provider options as the EP reports them (published in the worker's record).
    provider_options: dict[str, str] = field(default_factory=dict)
    #: With a custom-op library loaded: the inputs that carry an encoded image (uint8 vectors), which
    #: get a PNG to warm up on and whose bytes are checked before each run (ortq.worker.encoded_images).
    encoded_inputs: tuple[str, ...] = ()
    #: Stops a run past its job's timeout.
    deadline: RunDeadline = field(default_factory=RunDeadline, repr=False, compare=False)

    def run_options(self) -> Any:
        """A fresh ``onnxruntime.RunOptions`` (every run of the worker has one: a stop may end it).
        ONNX Runtime logs nothing of the run below FATAL: a stopped run (a cancel, a job timeout)
        would print its raw, coloured "terminate flag" ERROR line into the worker's log, and any
        error of a run reaches the worker as the exception it raises, with the same words."""
        options = _run_options_class()()
        options.log_severity_level = ORT_FATAL
        return options

    def run(
        self, inputs: dict[str, np.ndarray], timeout: float | None = None, options: Any = None
    ) -> dict[str, np.ndarray]:
        """``session.run`` with ``options`` (``run_options()``: None, a new one where a timeout needs
        it); with ``timeout``, stopped by ONNX Runtime itself once that many seconds pass
        (``RunOptions.terminate``, set by the worker's one watcher thread: ortq.worker.deadline)."""
        for name in self.encoded_inputs:  # before the decoder sees bytes that would end the process
            encoded_images.check_encoded_image(name, inputs[name])
        if timeout is None:
            return self._run(inputs, options)
        options = options if options is not None else self.run_options()
        self.deadline.arm(options, timeout)
        try:
            return self._run(inputs, options)
        except Exception as exc:
            if options.terminate and self.deadline.fired:
                raise JobTimeout(
                    f"the run was stopped after its timeout of {timeout:g} s "
                    "(the job's own, else the worker's --job-timeout)"
                ) from exc
            raise
        finally:
            self.deadline.disarm()

    def _run(self, inputs: dict[str, np.ndarray], run_options: Any) -> dict[str, np.ndarray]:
        values = self.session.run(self.output_names, inputs, run_options)
        return dict(zip(self.output_names, values, strict=True))


#: ONNX Runtime's severity levels: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal.
ORT_FATAL = 4


@cache
def _run_options_class() -> Any:
    """onnxruntime.RunOptions, looked up once: import_module per run cost 2 us of its 3.5 (CI VM)."""
    return importlib.import_module("onnxruntime").RunOptions


def _unavailable_reason(ort: Any, plan: SessionPlan) -> str:
    if plan.provider in PLUGIN_PROVIDERS and plan.ep_name is not None:
        return f"{plan.ep_name} could not start on its device {plan.ep_device}"
    if plan.provider == "auto" or plan.provider in PLUGIN_PROVIDERS:
        devices = [f"{d.ep_name} ({d.device.type})" for d in ort.get_ep_devices()]
        return f"--provider auto (policy {plan.policy}) chose the CPU; ONNX Runtime sees these devices: {devices}"
    wanted = EXECUTION_PROVIDERS[plan.provider]
    missing = _missing_from_build(ort, plan.provider)
    if missing is not None:
        return missing
    if plan.provider == "cuda":
        return (
            f"{wanted} is installed but could not start: check the NVIDIA driver, "
            f"the CUDA/cuDNN libraries and device {plan.device_id}"
        )
    return f"{wanted} is installed but could not start on adapter {plan.device_id}: check the GPU driver (DirectX 12)"


def _missing_from_build(ort: Any, provider: str) -> str | None:
    """Why this ONNX Runtime build cannot run ``provider`` (dml, cuda) at all, the reason first and
    the package to install after it; None where the build has it."""
    wanted = EXECUTION_PROVIDERS[provider]
    available = ort.get_available_providers()
    if wanted in available:
        return None
    build = ", ".join(f"{name} {version}" for name, version in installed_runtimes()) or "onnxruntime"
    return f"this ONNX Runtime ({build}) has no {wanted}: {install_advice(provider)}; it offers {', '.join(available)}"


def missing_provider(provider: str) -> str | None:
    """Why ``provider`` (dml, cuda) cannot run here on any adapter: this operating system cannot
    run it, or the installed ONNX Runtime build lacks it. None where it may run. A worker asks
    this before it looks for adapters, whose listing would otherwise come before the reason."""
    refusal = platform_refusal(provider)
    if refusal is not None:
        return refusal
    return _missing_from_build(import_onnxruntime(provider), provider)


def _create(ort: Any, model_path: Path, plan: SessionPlan) -> tuple[Any, str]:
    """The session (or None) and, when it is None or on the wrong provider, why."""
    if plan.unavailable is not None:
        return None, plan.unavailable
    named = plan.provider in EXECUTION_PROVIDERS and plan.provider != "cpu"
    if named and EXECUTION_PROVIDERS[plan.provider] not in ort.get_available_providers():
        return None, _unavailable_reason(ort, plan)
    try:
        session = ort.InferenceSession(
            str(model_path),
            sess_options=plan.session_options(ort),
            providers=plan.providers(),
            enable_fallback=0,  # no silent retry on the CPU, neither at creation nor in run()
        )
    except ConfigurationError:  # a bad --custom-ops library or --provider-option: no provider would do better
        raise
    except ProviderUnavailable as exc:
        if plan.provider in ("cpu", "auto"):
            raise
        return None, str(exc)
    except Exception as exc:  # ONNX Runtime raises its own exception types from C++
        return None, _creation_failure(ort, model_path, plan, exc)
    return _checked_provider(ort, session, plan)


def _creation_failure(ort: Any, model_path: Path, plan: SessionPlan, exc: Exception) -> str:
    """Why the plan's provider cannot be used here, from ONNX Runtime's error ``exc`` in creating the
    session; raises instead where no other provider would do better: a custom op no library
    registers, a provider option ONNX Runtime refused, a model the CPU cannot load."""
    advice = custom_ops.unregistered_op_advice(str(exc), plan.custom_ops)
    if advice is not None:  # the model's fault on any provider: no CPU fallback would load it either
        raise ModelLoadError(f"ONNX Runtime could not load {model_path}: {advice}") from exc
    rejected = provider_options.refused_by_runtime(str(exc), plan.user_options)
    if rejected is not None:  # the user's option, wrong on any adapter: not a provider to fall back from
        raise rejected from exc
    if plan.provider == "cpu":
        raise ModelLoadError(f"ONNX Runtime could not load {model_path}: {exc}") from exc
    if plan.provider in PLUGIN_PROVIDERS:
        return f"{_unavailable_reason(ort, plan)}: {ep_failure(plan.provider, str(exc))}"
    return f"{_unavailable_reason(ort, plan)} ({exc})"


def _checked_provider(ort: Any, session: Any, plan: SessionPlan) -> tuple[Any, str]:
    """The new ``session`` (None where it is on another EP than the plan's) and why it cannot serve
    (empty when it can): it is on another EP (for auto or winml by policy: on the CPU), or its EP
    took none of the model's nodes."""
    actual = session.get_providers()[0]
    wanted = plan.wanted_ep
    if wanted is None:  # auto, or winml by policy
        if actual == "CPUExecutionProvider":
            return None, _unavailable_reason(ort, plan)
        wanted = actual
    if actual != wanted:
        return None, f"ONNX Runtime created the session on {actual} instead of {wanted}: " + _unavailable_reason(
            ort, plan
        )
    return session, _unplaced(session, wanted)


def _unplaced(session: Any, wanted: str) -> str:
    """Why a session on ``wanted`` would still run on the CPU: the EP took none of the nodes."""
    placement = node_placement(session)
    if wanted == "CPUExecutionProvider" or not placement or placement.get(wanted, 0):
        return ""
    others = ", ".join(f"{count} on {ep}" for ep, count in placement.items())
    return (
        f"{wanted} was created but took none of the model's {sum(placement.values())} nodes ({others}): "
        f"it has no kernels for this model's operators or types, so the model would run on the CPU"
    )


def quiet_onnxruntime(ort: Any, severity: int) -> None:
    """ONNX Runtime's default logger (the one of provider registration and session creation, e.g.
    "No registered plugin EP device found" at every CUDA session) lets through ``severity`` and up."""
    ort.set_default_logger_severity(severity)


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
    quiet_onnxruntime(ort, plan.log_severity)
    if not model_path.is_file():
        raise ModelLoadError(f"model file not found: {model_path}")
    session, reason = _create(ort, model_path, plan)
    if reason:
        session = None
    if session is None:
        if not plan.allow_cpu_fallback:
            raise ProviderUnavailable(f"{reason}. Pass --allow-cpu-fallback to run on the CPU instead.")
        log.warning("%s; running on the CPU because --allow-cpu-fallback was given", reason)
        model = load_model(model_path, plan.cpu())
        model.fell_back_to_cpu = True
        return model
    provider = session.get_providers()[0]
    taken = provider_options.check_taken(session, provider, plan.user_options)
    placement = node_placement(session)
    if placement and provider != "CPUExecutionProvider" and placement.get("CPUExecutionProvider"):
        log.warning(
            "%d of the model's %d nodes run on the CPU: %s has no kernels for them (%s)",
            placement["CPUExecutionProvider"],
            sum(placement.values()),
            provider,
            placement,
        )
    # ONNX Runtime says [] for an input of no declared shape too: the file says which are (any rank).
    signature = signature_of(session, onnx_shapes.declared_shapes(model_path))
    return LoadedModel(
        session=session,
        signature=signature,
        provider=provider,
        device_id=plan.device_id if provider in ("DmlExecutionProvider", "CUDAExecutionProvider") else None,
        fell_back_to_cpu=False,
        output_names=[o.name for o in session.get_outputs()],
        placement=placement,
        provider_options=taken,
        encoded_inputs=encoded_inputs(signature) if plan.custom_ops is not None else (),
    )


def warm_up(model: LoadedModel) -> float | None:
    """Run the model once on signature-built inputs before taking jobs; returns seconds taken.
    None where the run failed on the 0-d tensor guessed for an input of no declared shape, which
    proves nothing wrong with the model: the worker starts, and its first job warms the session."""
    inputs = warmup_inputs(model.signature, encoded=model.encoded_inputs)
    started = time.perf_counter()
    try:
        model.run(inputs)
    except Exception as exc:
        guessed = guessed_inputs(model.signature, model.encoded_inputs)
        if guessed:
            log.warning(
                "no warm-up run: the model declares no shape for %s, and its run on the 0-d tensor(s) ortq "
                "guessed failed (%s); the first job's run warms the session up",
                ", ".join(guessed),
                exc,
            )
            return None
        raise ModelLoadError(f"warm-up run failed on {model.provider}: {exc}") from exc
    return time.perf_counter() - started


def canary(model: LoadedModel, model_path: Path, plan: SessionPlan) -> dict[str, Any]:
    """Run the warm-up input on the chosen provider and on the CPU and compare them (seen: a
    DML session that says DML and returns all zeros). Returns the record published with the
    worker; raises CanaryMismatch."""
    if model.provider == "CPUExecutionProvider":
        return {"passed": True, "skipped": "the model runs on the CPU"}
    inputs = warmup_inputs(model.signature, seed=1, encoded=model.encoded_inputs)
    reference_model = load_model(model_path, plan.cpu())
    try:
        reference = reference_model.run(inputs)
    except Exception as exc:  # ONNX Runtime's own error on the inputs: guessed ones may be wrong
        guessed = guessed_inputs(model.signature, model.encoded_inputs)
        if not guessed:
            raise
        return {"passed": True, "skipped": f"the CPU refused the 0-d tensors guessed for {guessed}: {exc}"[:500]}
    worst = compare_with_cpu(model.run(inputs), reference, model.provider)
    return {"passed": True, "max_abs_diff": worst}

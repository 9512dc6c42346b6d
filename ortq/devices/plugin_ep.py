"""Plugin execution providers: ONNX Runtime's plugin-EP API (onnxruntime >= 1.23).

A plugin EP is a shared library registered with ``register_execution_provider_library``; it
then offers devices (``get_ep_devices()``: an ``OrtEpDevice`` per hardware device it supports,
with ONNX Runtime's metadata about that device), and a session uses one through
``SessionOptions.add_provider_for_devices``. ortq resolves ``--adapter`` against those devices
as it does against DXGI's or NVML's, and the session is then checked like any other: the EP
ONNX Runtime created, and how many of the model's nodes it took (ortq/worker/session.py).

- ``--provider plugin --ep-library PATH --ep-name NAME``: any plugin EP (OpenVINO, TensorRT RTX,
  QNN, ...); its devices are the adapters.
- ``--provider webgpu``: the ``onnxruntime-ep-webgpu`` package. Its EP takes one device and then
  lets Dawn pick the physical GPU by power preference alone, so ortq lists the GPUs Dawn will see
  (Vulkan on Linux, ``vulkan.py``; ONNX Runtime's DXGI-based devices elsewhere), predicts Dawn's
  choice (discrete before integrated before anything else for high-performance, integrated first
  for minimum-power, ties in enumeration order) and refuses a spec that no preference reaches.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ortq.devices.adapters import (
    DISCRETE_MIN_BYTES,
    PREFERENCES,
    Adapter,
    dxgi_adapter_rows,
    explain,
    format_luid,
    select_adapter,
)
from ortq.errors import AdapterNotFound, ConfigurationError, ProviderUnavailable

log = logging.getLogger("ortq.worker")

WEBGPU_EP = "WebGpuExecutionProvider"
#: The WebGPU EP (0.4) offers a device only for a GPU that ONNX Runtime's own discovery found
#: (on Linux: /sys/class/drm, which has no software driver and often no GPU in a VM) unless this
#: is set; then it offers one on the CPU's hardware device and Dawn still picks the adapter.
WEBGPU_ALLOW_SOFTWARE = "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER"
#: Session config key of the WebGPU EP's power preference, and its values for ortq's specs.
WEBGPU_POWER_PREFERENCE = "ep.webgpuexecutionprovider.powerPreference"
DAWN_PREFERENCE = {"high-performance": "high-performance", "minimum-power": "low-power"}
#: Session config key that makes ONNX Runtime record which EP took which node.
RECORD_ASSIGNMENT = "session.record_ep_graph_assignment_info"

_HARDWARE_TYPES = {"CPU": "cpu", "GPU": "gpu", "NPU": "npu"}
#: Libraries registered in this process: resolved path -> the EPs whose devices its registration added.
_registered: dict[str, list[str]] = {}


@dataclass(frozen=True)
class EpDeviceInfo:
    """What ONNX Runtime says about one ``OrtEpDevice``, as plain data (recorded in tests)."""

    ep_name: str
    hardware_type: str  # "cpu" | "gpu" | "npu"
    vendor: str
    vendor_id: int
    device_id: int
    metadata: dict[str, str] = field(default_factory=dict)
    ep_metadata: dict[str, str] = field(default_factory=dict)


def ep_device_info(device: Any) -> EpDeviceInfo:
    hardware = device.device
    return EpDeviceInfo(
        ep_name=device.ep_name,
        hardware_type=_HARDWARE_TYPES.get(str(hardware.type).rsplit(".", 1)[-1], "other"),
        vendor=hardware.vendor,
        vendor_id=int(hardware.vendor_id),
        device_id=int(hardware.device_id),
        metadata=dict(hardware.metadata),
        ep_metadata=dict(device.ep_metadata),
    )


def _memory(text: str | None) -> int | None:
    """DXGI's ``DxgiVideoMemory`` metadata, e.g. "24105 MB", in bytes."""
    if not text:
        return None
    number, _, unit = text.strip().partition(" ")
    scale = {"KB": 1024, "MB": 1024**2, "GB": 1024**3}.get(unit.strip().upper(), 1)
    try:
        return int(number) * scale
    except ValueError:
        return None


def adapter_from_ep_device(info: EpDeviceInfo, index: int, provider: str) -> Adapter:
    """The adapter row of one EP device: kind from the hardware type and DXGI's ``Discrete`` flag
    (else video memory), LUID and preference rank where ONNX Runtime's metadata has them."""
    meta = info.metadata
    memory = _memory(meta.get("DxgiVideoMemory"))
    if info.hardware_type == "gpu":
        if meta.get("Discrete") in ("0", "1"):
            kind = "discrete" if meta["Discrete"] == "1" else "integrated"
        else:
            kind = "gpu" if memory is None else "discrete" if memory >= DISCRETE_MIN_BYTES else "integrated"
    else:
        kind = info.hardware_type
    luid = meta.get("LUID")
    rank = meta.get("DxgiHighPerformanceIndex")
    return Adapter(
        provider=provider,
        index=index,
        name=meta.get("Description") or f"{info.vendor} {info.hardware_type.upper()}".strip(),
        kind=kind,
        luid=format_luid(int(luid.strip())) if luid and luid.strip().lstrip("-").isdigit() else None,
        vendor_id=info.vendor_id,
        device_id=info.device_id,
        memory_bytes=memory,
        high_performance_rank=int(rank) if rank and rank.isdigit() else None,
        ep_name=info.ep_name,
    )


def _reason(exc: BaseException) -> str:
    """ONNX Runtime's message without its ``[ONNXRuntimeError] : 1 : FAIL :`` prefix."""
    text = str(exc).strip()
    return (text.rsplit(" : ", 1)[-1] if text.startswith("[ONNXRuntimeError]") else text).rstrip(".")


def ep_failure(provider: str, text: str) -> str:
    """ONNX Runtime's error from creating a plugin EP, shortened to its cause (without the C++
    source paths), with what to check."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    cause = lines[0] if lines else text
    if "was false. " in cause:
        cause = cause.rsplit("was false. ", 1)[1]
    elif cause.startswith("[ONNXRuntimeError]"):
        cause = cause.rsplit(" : ", 1)[-1]
    if provider == "webgpu" and "Failed to get a WebGPU adapter" in cause:
        cause += (
            " (Dawn rejected every Vulkan device: the driver is too old for WebGPU; Mesa's lavapipe needs Mesa >= 23, "
            "Debian 12's own 22.3 lacks shaderUniform*ArrayDynamicIndexing; vulkaninfo --summary shows the driver)"
        )
    elif provider == "webgpu":
        cause += " (check the GPU's driver: vulkaninfo --summary on Linux)"
    return cause


def register_library(ort: Any, library: str, name: str, advice: str = "") -> list[str]:
    """Register ``library`` with ONNX Runtime once per process; ProviderUnavailable with
    ONNX Runtime's reason (a missing file, an incompatible ONNX Runtime, ...) and ``advice``.
    Returns the names of the EPs whose devices its registration added (remembered: the same
    answer for a library registered before)."""
    if not hasattr(ort, "register_execution_provider_library"):
        raise ProviderUnavailable(
            f"plugin execution providers need onnxruntime >= 1.23 (register_execution_provider_library); "
            f"this is onnxruntime {ort.__version__}. {advice}".strip()
        )
    path = str(Path(library).resolve())
    if path in _registered:
        return _registered[path]
    before = {d.ep_name for d in ort.get_ep_devices()}
    try:
        ort.register_execution_provider_library(name, path)
    except Exception as exc:  # ONNX Runtime's own exception types
        if "already registered" not in str(exc):
            raise ProviderUnavailable(
                f"onnxruntime {ort.__version__} could not register the execution provider library {path}: "
                f"{_reason(exc)}. {advice}".strip()
            ) from exc
    _registered[path] = sorted({d.ep_name for d in ort.get_ep_devices()} - before)
    return _registered[path]


def open_library(ort: Any, library: str, ep_name: str | None) -> tuple[str, str, list[Adapter]]:
    """Register a plugin EP ``library`` (``--provider plugin --ep-library``) and list the devices of
    its EP ``ep_name`` (None: the one EP it has): (the registration's name, the EP's name, its
    devices as ``plugin`` adapters). ConfigurationError when the EP is not there or not named."""
    registration = ep_name or Path(library).stem
    added = register_library(ort, library, registration)
    if ep_name is None:
        if len(added) != 1:
            raise ConfigurationError(f"{library} offers the EPs {added}: say which with --ep-name")
        ep_name = added[0]
    if ep_name not in {d.ep_name for d in ort.get_ep_devices()}:
        offered = added or "none new"
        raise ConfigurationError(f"no device of an EP named {ep_name!r} after registering {library} ({offered})")
    return registration, ep_name, plugin_adapters(ort, ep_name, "plugin")


def choose_plugin_adapter(spec: str | None, adapters: Sequence[Adapter], ep_name: str) -> Adapter:
    """The plugin EP's device ``--adapter spec`` names; without one, its first that is not the CPU."""
    if spec is not None:
        return select_adapter(spec, adapters, "plugin")
    return default_plugin_adapter(adapters, ep_name)


def ep_devices(ort: Any, ep_name: str) -> list[Any]:
    """The ``OrtEpDevice``s of ``ep_name``, in ONNX Runtime's order (the adapter index)."""
    return [d for d in ort.get_ep_devices() if d.ep_name == ep_name]


def plugin_adapters(ort: Any, ep_name: str, provider: str) -> list[Adapter]:
    return [adapter_from_ep_device(ep_device_info(d), i, provider) for i, d in enumerate(ep_devices(ort, ep_name))]


def default_plugin_adapter(adapters: Sequence[Adapter], ep_name: str) -> Adapter:
    """Without ``--adapter``: the EP's first device that is not the CPU (never the CPU unasked)."""
    for adapter in adapters:
        if adapter.kind != "cpu":
            return adapter
    if adapters:
        raise AdapterNotFound(
            explain(f"{ep_name} offers only CPU devices; to run it there anyway, say so with --adapter cpu", adapters)
        )
    raise AdapterNotFound(f"{ep_name} offers no device on this machine (get_ep_devices() lists none for it)")


# --------------------------------------------------------------------------- WebGPU


def webgpu_library() -> str:
    """The WebGPU plugin library's path (``onnxruntime-ep-webgpu``), or ProviderUnavailable."""
    try:
        import onnxruntime_ep_webgpu
    except ImportError:
        raise ProviderUnavailable(
            "--provider webgpu needs the onnxruntime-ep-webgpu package (pip install 'ortq[webgpu]'; "
            "it needs onnxruntime >= 1.24.4)"
        ) from None
    return str(onnxruntime_ep_webgpu.get_library_path())


WEBGPU_ADVICE = "The WebGPU EP needs onnxruntime >= 1.24.4: pip install --upgrade 'onnxruntime>=1.24.4'"


def vulkan_adapters() -> list[Adapter]:
    """The Vulkan devices Dawn will choose from on Linux, as ``webgpu`` adapters; ProviderUnavailable
    naming what to install when there is no loader or no driver."""
    from ortq.devices import vulkan

    install = (
        "Install the Vulkan loader and a driver: on Debian/Ubuntu `apt install libvulkan1` and the GPU's Vulkan "
        "driver (NVIDIA's own driver; mesa-vulkan-drivers for AMD and Intel, and for lavapipe, Mesa's CPU renderer)"
    )
    try:
        devices = vulkan.enumerate_vulkan()
    except OSError as exc:
        raise ProviderUnavailable(f"--provider webgpu runs on Vulkan on Linux, and {exc}. {install}") from exc
    if not devices:
        raise ProviderUnavailable(f"--provider webgpu: the Vulkan loader found no device (no Vulkan driver). {install}")
    kinds = {"cpu": "software", "other": "gpu"}
    return [
        Adapter(
            provider="webgpu",
            index=d.index,
            name=d.name,
            kind=kinds.get(d.device_type, d.device_type),
            software=d.device_type == "cpu",
            # NVIDIA's Vulkan deviceUUID is the GPU's UUID, which nvidia-smi and NVML print as GPU-<uuid>.
            uuid=f"GPU-{d.uuid}" if d.vendor_id == 0x10DE else d.uuid,
            vendor_id=d.vendor_id,
            device_id=d.device_id,
            memory_bytes=d.memory_bytes,
            ep_name=WEBGPU_EP,
        )
        for d in devices
    ]


def webgpu_adapters(ort: Any) -> list[Adapter]:
    """The GPUs the WebGPU EP's Dawn can pick from: Vulkan's on Linux, ONNX Runtime's elsewhere
    (on Windows completed from DXGI by LUID: the software flag, kind and preference order)."""
    if sys.platform == "linux":
        return vulkan_adapters()
    rows = plugin_adapters(ort, WEBGPU_EP, "webgpu")
    try:
        by_luid = {a.luid: a for a in dxgi_adapter_rows()}
    except OSError:
        return rows
    return [
        replace(row, kind=d.kind, software=d.software, memory_bytes=d.memory_bytes or row.memory_bytes,
                high_performance_rank=d.high_performance_rank, minimum_power_rank=d.minimum_power_rank)
        if (d := by_luid.get(row.luid)) is not None and row.luid is not None else row
        for row in rows
    ]  # fmt: skip


def register_webgpu(ort: Any) -> None:
    if sys.platform == "linux" and WEBGPU_ALLOW_SOFTWARE not in os.environ:
        # ortq has found the Vulkan device itself; without this the EP offers no device at all where
        # ONNX Runtime's /sys/class/drm discovery finds none (a software driver, many VMs).
        os.environ[WEBGPU_ALLOW_SOFTWARE] = "1"
    register_library(ort, webgpu_library(), "ortq-webgpu", WEBGPU_ADVICE)


def dawn_choice(adapters: Sequence[Adapter], preference: str) -> Adapter:
    """The adapter Dawn returns for ``preference``: by type (discrete first for high-performance,
    integrated first for minimum-power, then other GPUs, then software), ties in enumeration order."""
    first, second = ("discrete", "integrated") if preference == "high-performance" else ("integrated", "discrete")
    rank = {first: 0, second: 1, "software": 3, "cpu": 3}
    return min(adapters, key=lambda a: (rank.get(a.kind, 2), a.index or 0))


def resolve_webgpu(spec: str | None, adapters: Sequence[Adapter]) -> tuple[Adapter, str]:
    """The adapter ``spec`` means and the power preference that makes Dawn pick it (default:
    high-performance, the EP's own default); ConfigurationError for an adapter no preference reaches."""
    candidates = [a for a in adapters if a.provider == "webgpu"]
    if not candidates:
        raise AdapterNotFound(explain("no WebGPU adapter", adapters))
    wanted = (spec or "high-performance").strip().lower()
    if wanted in PREFERENCES:
        return dawn_choice(candidates, wanted), wanted
    chosen = select_adapter(spec or "", candidates, "webgpu")
    for preference in PREFERENCES:
        if dawn_choice(candidates, preference) == chosen:
            return chosen, preference
    reach = "; ".join(f"{p} gives {dawn_choice(candidates, p).name}" for p in PREFERENCES)
    raise ConfigurationError(
        explain(
            f"--adapter {spec!r} is {chosen.name}, but the WebGPU EP lets Dawn pick the GPU by power preference "
            f"alone ({reach}); no preference reaches this one. Use another provider for it (--provider cuda or dml)",
            adapters,
        )
    )


# --------------------------------------------------------------------------- sessions


def add_plugin_provider(ort: Any, options: Any, plan: Any) -> None:
    """Register ``plan``'s libraries and give ``options`` its EP device, provider options and
    session config entries (``plan`` is an ortq.worker.session.SessionPlan of a plugin provider)."""
    for name, library in plan.libraries:
        register_library(ort, library, name, WEBGPU_ADVICE if plan.provider == "webgpu" else "")
    for key, value in plan.config_entries:
        options.add_session_config_entry(key, value)
    if plan.ep_name is None:  # winml by policy: ONNX Runtime chooses among the registered EPs
        return
    devices = ep_devices(ort, plan.ep_name)
    index = plan.ep_device or 0
    if index >= len(devices):
        raise ProviderUnavailable(f"{plan.ep_name} offers {len(devices)} device(s) now; device {index} is gone")
    options.add_provider_for_devices([devices[index]], plan.provider_options())  # the user's after ortq's own


def node_placement(session: Any) -> dict[str, int] | None:
    """How many of the model's nodes each EP took (``session.record_ep_graph_assignment_info``,
    onnxruntime >= 1.24); None where ONNX Runtime cannot say."""
    getter = getattr(session, "get_provider_graph_assignment_info", None)
    if getter is None:
        return None
    counts: dict[str, int] = {}
    for subgraph in getter():
        counts[subgraph.ep_name] = counts.get(subgraph.ep_name, 0) + len(subgraph.get_nodes())
    return counts or None

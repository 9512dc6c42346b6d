"""What an adapter is, the rows DXGI, NVML and the CPU give, and which one an ``--adapter`` spec means.

Adapter indices follow the system's enumeration order, which differs between machines and
changes when adapters come and go; ortq resolves a spec (name, LUID/UUID, kind, preference,
or an index) against a fresh enumeration at every worker start, and refuses a spec that
matches no adapter or several.

- DirectML: DXGI (``dxgi.py``), index = DML ``device_id``; where onnxruntime >= 1.23 lists
  DML devices through ``get_ep_devices()``, their metadata is cross-checked.
- CUDA: NVIDIA's NVML binding (``nvidia-ml-py``), in PCI bus order, renumbered through
  ``CUDA_VISIBLE_DEVICES``; the worker sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA numbers
  devices the same way.
- CPU: always one row.

WebGPU's and plugin EPs' rows are made from their EP devices in ``plugin_ep.py``, which builds on
this module; ``enumeration.py`` lists every source together.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ortq import tables
from ortq.errors import AdapterNotFound, AmbiguousAdapter, ConfigurationError

log = logging.getLogger("ortq.worker")

#: Dedicated memory from which a non-software DXGI adapter counts as discrete when ONNX Runtime
#: does not say (integrated GPUs report a small carve-out, typically 128-512 MiB).
DISCRETE_MIN_BYTES = 1024**3

PREFERENCES = ("high-performance", "minimum-power")
KINDS = ("discrete", "integrated", "npu", "software", "cpu")


@dataclass(frozen=True)
class Adapter:
    """One device a worker could run on, with the index its provider takes."""

    provider: str  # "dml" | "cuda" | "webgpu" | "plugin" | "winml" | "cpu"
    index: int | None  # DML/CUDA device_id, the position among a plugin EP's devices; None for the CPU
    name: str
    kind: str  # "discrete" | "integrated" | "gpu" (not known which) | "npu" | "software" | "cpu"
    software: bool = False
    luid: str | None = None  # DXGI: "0x" + 16 hex digits (HighPart << 32 | LowPart)
    uuid: str | None = None  # NVML: "GPU-..."
    vendor_id: int | None = None
    device_id: int | None = None  # PCI device id
    memory_bytes: int | None = None
    #: Position in the system's high-performance / minimum-power order (DXGI), when known.
    high_performance_rank: int | None = None
    minimum_power_rank: int | None = None
    #: The ONNX Runtime execution provider of a plugin EP's device.
    ep_name: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def format_luid(value: int) -> str:
    return f"0x{value & 0xFFFFFFFFFFFFFFFF:016x}"


def _parse_int(text: str) -> int:
    return int(text, 16) if text.lower().startswith("0x") else int(text)


# --------------------------------------------------------------------------- enumeration


def _dxgi_adapters(ort_devices: list[dict[str, str]] | None) -> list[Adapter]:
    from ortq.devices import dxgi

    raw = dxgi.enumerate_dxgi()
    high = dxgi.preference_order(dxgi.DXGI_GPU_PREFERENCE_HIGH_PERFORMANCE)
    low = dxgi.preference_order(dxgi.DXGI_GPU_PREFERENCE_MINIMUM_POWER)
    discrete_by_index = {}
    for meta in ort_devices or []:
        if "DxgiAdapterNumber" in meta and "Discrete" in meta:
            discrete_by_index[int(meta["DxgiAdapterNumber"])] = meta["Discrete"] in ("1", "true", "True")
    adapters = []
    for a in raw:
        if a.software:
            kind = "software"
        elif a.index in discrete_by_index:
            kind = "discrete" if discrete_by_index[a.index] else "integrated"
        else:
            kind = "discrete" if a.dedicated_video_memory >= DISCRETE_MIN_BYTES else "integrated"
        adapters.append(
            Adapter(
                provider="dml",
                index=a.index,
                name=a.description,
                kind=kind,
                software=a.software,
                luid=format_luid(a.luid),
                vendor_id=a.vendor_id,
                device_id=a.device_id,
                memory_bytes=a.dedicated_video_memory,
                high_performance_rank=high.index(a.luid) if high and a.luid in high else None,
                minimum_power_rank=low.index(a.luid) if low and a.luid in low else None,
            )
        )
    _cross_check(adapters, ort_devices)
    return adapters


def dxgi_adapter_rows() -> list[Adapter]:
    """The DXGI adapters as DirectML rows (OSError off Windows)."""
    return _dxgi_adapters(ort_dml_device_metadata())


def _cross_check(adapters: list[Adapter], ort_devices: list[dict[str, str]] | None) -> None:
    """Warn where ONNX Runtime's view of the DML devices disagrees with DXGI's."""
    for meta in ort_devices or []:
        if "DxgiAdapterNumber" not in meta or "LUID" not in meta:
            continue
        index = int(meta["DxgiAdapterNumber"])
        match = next((a for a in adapters if a.index == index), None)
        if match is None or match.luid is None:
            log.warning("ONNX Runtime lists DML adapter %d, which DXGI does not", index)
        elif _parse_int(meta["LUID"]) != int(match.luid, 16):
            log.warning("DML adapter %d: DXGI LUID %s, ONNX Runtime LUID %s", index, match.luid, meta["LUID"])


def ort_dml_device_metadata() -> list[dict[str, str]] | None:
    """Metadata of the DML devices onnxruntime >= 1.23 lists, or None where it cannot."""
    try:
        import onnxruntime
    except ImportError:
        return None
    get_ep_devices = getattr(onnxruntime, "get_ep_devices", None)
    if get_ep_devices is None:
        return None
    found = []
    for device in get_ep_devices():
        if device.ep_name == "DmlExecutionProvider":
            found.append({**dict(device.device.metadata), **dict(device.ep_metadata)})
    return found


def visible_cuda_order(nvml_uuids: Sequence[str], visible: str | None) -> list[int]:
    """NVML indices in CUDA's numbering under ``CUDA_VISIBLE_DEVICES`` (PCI bus order).

    Entries are indices or (prefixes of) UUIDs; as in CUDA, the list stops at the first entry
    that matches nothing.
    """
    if visible is None:
        return list(range(len(nvml_uuids)))
    order: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit():
            index = int(entry)
            if index >= len(nvml_uuids):
                break
        else:
            matches = [i for i, uuid in enumerate(nvml_uuids) if uuid.lower().startswith(entry.lower())]
            if len(matches) != 1:
                break
            index = matches[0]
        if index in order:
            break
        order.append(index)
    return order


def nvml_adapters() -> list[Adapter]:
    """The NVIDIA GPUs NVML lists, numbered as CUDA will number them; none without nvidia-ml-py or a driver."""
    try:
        import pynvml
    except ImportError:
        log.debug("nvidia-ml-py is not installed: no CUDA devices listed")
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("no NVIDIA driver (%s): no CUDA devices", exc)
        return []
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name, uuid = pynvml.nvmlDeviceGetName(handle), pynvml.nvmlDeviceGetUUID(handle)
            pci = pynvml.nvmlDeviceGetPciInfo(handle)
            devices.append(
                (
                    name.decode() if isinstance(name, bytes) else name,
                    uuid.decode() if isinstance(uuid, bytes) else uuid,
                    int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    int(pci.pciDeviceId),
                )
            )
    finally:
        pynvml.nvmlShutdown()
    order = visible_cuda_order([d[1] for d in devices], os.environ.get("CUDA_VISIBLE_DEVICES"))
    return [
        Adapter(
            provider="cuda",
            index=cuda_index,
            name=devices[n][0],
            kind="discrete",
            uuid=devices[n][1],
            vendor_id=0x10DE,
            device_id=devices[n][3] >> 16,
            memory_bytes=devices[n][2],
        )
        for cuda_index, n in enumerate(order)
    ]


def cpu_adapter() -> Adapter:
    """The one CPU row: its model name and the machine's memory."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), name)
    except OSError:
        pass
    memory = None
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Adapter(provider="cpu", index=None, name=name or "CPU", kind="cpu", memory_bytes=memory)


# --------------------------------------------------------------------------- selection


def format_table(adapters: Sequence[Adapter]) -> str:
    rows = [
        (
            f"{a.provider}:{a.ep_name}" if a.provider in ("plugin", "winml") else a.provider,
            a.index,
            a.name,
            a.kind,
            None if a.memory_bytes is None else f"{a.memory_bytes / 1024**3:.1f} GiB",
            a.luid or a.uuid,
        )
        for a in adapters
    ]
    return tables.format_table(("provider", "index", "name", "kind", "memory", "luid / uuid"), rows)


def _by_preference(candidates: list[Adapter], spec: str) -> Adapter:
    """The first adapter in the system's order for ``spec``, or ortq's own when DXGI gave none."""
    rank_of: Callable[[Adapter], int | None] = (
        (lambda a: a.high_performance_rank) if spec == "high-performance" else (lambda a: a.minimum_power_rank)
    )
    ranked = [a for a in candidates if rank_of(a) is not None]
    if ranked:
        return min(ranked, key=lambda a: rank_of(a) or 0)

    # No system order: hardware before software; discrete and most memory first for
    # performance, integrated and least memory first for power.
    def key(a: Adapter) -> tuple[int, int, int]:
        memory = a.memory_bytes or 0
        if spec == "high-performance":
            return (a.software, a.kind != "discrete", -memory)
        return (a.software, a.kind != "integrated", memory)

    return min(candidates, key=key)


def select_adapter(spec: str, adapters: Sequence[Adapter], provider: str) -> Adapter:
    """The one adapter of ``provider`` that ``spec`` names.

    ``spec``: an index; ``luid:<hex or decimal>``; ``uuid:<GPU-... or prefix>``;
    ``name:<substring>`` (case-insensitive); ``discrete`` / ``integrated``;
    ``high-performance`` / ``minimum-power``.
    Raises AdapterNotFound / AmbiguousAdapter with the table of adapters.
    """
    candidates = [a for a in adapters if a.provider == provider]
    spec = spec.strip()
    low = spec.lower()
    if low in PREFERENCES:
        if not candidates:
            raise AdapterNotFound(explain(f"no {provider} adapter for {spec!r}", adapters))
        return _by_preference(candidates, low)
    matches = _matching(spec, candidates)
    if not matches:
        raise AdapterNotFound(explain(f"no {provider} adapter matches {spec!r}", adapters))
    if len(matches) > 1:
        message = f"{len(matches)} {provider} adapters match {spec!r}; be more specific"
        raise AmbiguousAdapter(explain(message, adapters))
    return matches[0]


def _matching(spec: str, candidates: Sequence[Adapter]) -> list[Adapter]:
    """The ``candidates`` that a (stripped) spec other than a preference names: by index, LUID,
    UUID prefix, name substring or kind. ConfigurationError for a spec of none of those forms."""
    low = spec.lower()
    if spec.isdigit():
        return [a for a in candidates if a.index == int(spec)]
    if low.startswith("luid:"):
        try:
            wanted = _parse_int(spec[5:])
        except ValueError:
            raise ConfigurationError(f"bad LUID in {spec!r}: use luid:0x<hex> or luid:<decimal>") from None
        return [a for a in candidates if a.luid is not None and int(a.luid, 16) == wanted]
    if low.startswith("uuid:"):
        return [a for a in candidates if a.uuid and a.uuid.lower().startswith(low[5:])]
    if low.startswith("name:"):
        return [a for a in candidates if low[5:] in a.name.lower()]
    if low in KINDS:
        return [a for a in candidates if a.kind == low]
    raise ConfigurationError(
        f"unknown adapter spec {spec!r}: use an index, luid:..., uuid:..., name:..., "
        "discrete, integrated, npu, software, cpu, high-performance or minimum-power"
    )


def explain(message: str, adapters: Sequence[Adapter]) -> str:
    return f"{message}. Adapters on this machine:\n{format_table(adapters)}"


def unenumerated_dml_options(spec: str) -> dict[str, str] | None:
    """DML provider options that let DirectML itself choose, for a preference spec, when
    DXGI cannot be enumerated; None when the spec needs an enumeration."""
    low = spec.strip().lower()
    if low == "high-performance":
        return {"performance_preference": "high_performance", "device_filter": "gpu"}
    if low == "minimum-power":
        return {"performance_preference": "minimum_power", "device_filter": "gpu"}
    return None

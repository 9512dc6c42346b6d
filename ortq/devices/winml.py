"""``--provider winml``: the execution providers Windows ML offers this machine (Windows 11 24H2+).

Windows ML keeps a catalog of vendor EPs (Qualcomm's QNN, Intel's OpenVINO, AMD's Vitis AI,
NVIDIA's TensorRT RTX, ...) that Windows downloads and updates for the hardware it finds. The
``windowsml`` package (``pip install 'ortq[winml]'``, with its ``onnxruntime-windowsml`` build)
reads it: each entry has an EP name, a version, a ready state (Ready, NotReady: installed but
not prepared, NotPresent: not downloaded) and a certification. ortq:

1. reads the catalog and keeps the certified EPs (Windows ML's own default), or only the one
   ``--ep-name`` names, certified or not (:func:`choose_entries`);
2. makes each ready (``ensure_ready()``: may download it) and registers its library with ONNX
   Runtime; an EP that fails is left out with a warning, unless it was named;
3. chooses the device among every non-CPU ``OrtEpDevice`` then listed (the registered EPs' and
   the built-in DirectML's) by the ``--adapter`` spec, or, without one, leaves the choice to ONNX
   Runtime's ``--policy`` (:func:`choose_device`);
4. the session is then checked like every other (ortq/worker/session.py): never silently on the CPU.

Steps 1 and 3 are plain functions of recorded data, tested on recorded catalogs; steps 2 and 4
need Windows with the Windows App SDK runtime (docs/adapters.md says what was verified where).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ortq.devices.adapters import Adapter, select_adapter
from ortq.devices.plugin_ep import (
    EpDeviceInfo,
    adapter_from_ep_device,
    default_plugin_adapter,
    ep_device_info,
    register_library,
)
from ortq.errors import AdapterNotFound, ProviderUnavailable

log = logging.getLogger("ortq.worker")

INSTALL = "pip install 'ortq[winml]' (windowsml and onnxruntime-windowsml; Windows 11 24H2 or later)"


@dataclass(frozen=True)
class CatalogEntry:
    """One EP in Windows ML's catalog, as ``windowsml.ExecutionProvider`` describes it."""

    name: str  # the ONNX Runtime EP name, e.g. "OpenVINOExecutionProvider"
    version: str
    ready_state: str  # "Ready" | "NotReady" | "NotPresent"
    certification: str  # "Certified" | "Uncertified" | "Unknown"
    library_path: str  # empty until the EP is ready


def choose_entries(entries: Sequence[CatalogEntry], ep_name: str | None) -> list[CatalogEntry]:
    """The catalog EPs to make ready and register: the certified ones, or the one ``ep_name``
    names (certified or not). ProviderUnavailable when that leaves none."""
    if ep_name is not None:
        named = [e for e in entries if e.name == ep_name]
        if not named:
            offered = ", ".join(f"{e.name} ({e.certification})" for e in entries) or "none"
            raise ProviderUnavailable(f"Windows ML's catalog has no {ep_name} on this machine; it offers: {offered}")
        if named[0].certification != "Certified":
            log.warning("%s is %s by Windows ML; using it because --ep-name named it", ep_name, named[0].certification)
        return named
    certified = [e for e in entries if e.certification == "Certified"]
    if not certified and entries:
        log.warning("Windows ML offers only uncertified EPs (%s): name one with --ep-name", [e.name for e in entries])
    return certified


def _usable(devices: Sequence[EpDeviceInfo], ep_name: str | None) -> list[EpDeviceInfo]:
    return [d for d in devices if d.ep_name != "CPUExecutionProvider" and ep_name in (None, d.ep_name)]


def winml_adapters(devices: Sequence[EpDeviceInfo], ep_name: str | None) -> list[Adapter]:
    """Every non-CPU EP device as a ``winml`` adapter (only ``ep_name``'s when given), indexed in order."""
    return [adapter_from_ep_device(d, i, "winml") for i, d in enumerate(_usable(devices, ep_name))]


def choose_device(devices: Sequence[EpDeviceInfo], spec: str | None, ep_name: str | None) -> tuple[Adapter, int] | None:
    """The adapter ``spec`` names (without one, ``ep_name``'s first non-CPU device) and its index
    among its own EP's devices (what ``add_provider_for_devices`` is given); None when neither is
    given: ONNX Runtime's policy chooses."""
    usable = _usable(devices, ep_name)
    adapters = winml_adapters(devices, ep_name)
    if spec is None and ep_name is None:
        return None
    if not adapters:
        raise AdapterNotFound(f"{ep_name or 'no EP of Windows ML'} offers no device besides the CPU on this machine")
    if spec is not None:
        chosen = select_adapter(spec, adapters, "winml")
    else:
        chosen = default_plugin_adapter(adapters, str(ep_name))
    device = usable[chosen.index or 0]
    same_ep = [d for d in devices if d.ep_name == device.ep_name]
    return chosen, next(i for i, d in enumerate(same_ep) if d is device)


def read_catalog() -> tuple[list[CatalogEntry], list[Any]]:
    """Windows ML's catalog (entries and the ``windowsml`` handles to make them ready), or
    ProviderUnavailable saying what is missing."""
    try:
        import windowsml
    except ImportError:
        raise ProviderUnavailable(f"--provider winml needs the windowsml package: {INSTALL}") from None
    except OSError as exc:  # its DLL did not load: no Windows App SDK runtime, too old a Windows, Wine
        raise ProviderUnavailable(f"Windows ML's runtime did not load ({exc}); it needs Windows 11 24H2") from exc
    catalog = windowsml.EpCatalog()
    providers = catalog.find_all_providers()
    entries = [
        CatalogEntry(p.name, p.version, p.ready_state.name, p.certification.name, p.library_path) for p in providers
    ]
    log.info("Windows ML catalog: %s", [(e.name, e.version, e.ready_state, e.certification) for e in entries])
    return entries, [catalog, *providers]


def register_catalog(ort: Any, ep_name: str | None) -> list[tuple[str, str]]:
    """Make the chosen catalog EPs ready and register them; returns (name, library) of each."""
    entries, handles = read_catalog()
    registered: list[tuple[str, str]] = []
    for entry in choose_entries(entries, ep_name):
        handle = next(h for h in handles[1:] if h.name == entry.name)
        try:
            if entry.ready_state != "Ready":
                log.info("Windows ML: making %s %s ready (it may be downloaded)", entry.name, entry.version)
                handle.ensure_ready()
            library = handle.library_path
            register_library(ort, library, entry.name)
        except (OSError, ProviderUnavailable) as exc:
            if ep_name is not None:
                raise ProviderUnavailable(f"Windows ML could not prepare {entry.name}: {exc}") from exc
            log.warning("Windows ML: %s left out: %s", entry.name, exc)
            continue
        registered.append((entry.name, library))
    return registered


def resolve_winml(
    ort: Any, spec: str | None, ep_name: str | None
) -> tuple[tuple[tuple[str, str], ...], tuple[Adapter, int] | None]:
    """Register Windows ML's EPs and choose the device: (libraries, (adapter, index) or None)."""
    libraries = tuple(register_catalog(ort, ep_name))
    devices = [ep_device_info(d) for d in ort.get_ep_devices()]
    return libraries, choose_device(devices, spec, ep_name)

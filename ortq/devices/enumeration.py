"""Every adapter this machine has, from each source: what ``ortq adapters`` prints, and what a
worker (and a pool's plan) resolves its ``--adapter`` spec against.

- DirectML (DXGI), CUDA (NVML) and the CPU: ``adapters.py``.
- WebGPU (``onnxruntime-ep-webgpu`` installed): the GPUs its Dawn picks from (``plugin_ep.py``).
- Plugin EPs (``--ep-library``): the devices ONNX Runtime's ``get_ep_devices()`` gives them.

This sits above ``plugin_ep.py`` (which makes its rows from ``adapters.py``'s), so that neither of
those two imports the other back.
"""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

from ortq.devices import plugin_ep
from ortq.devices.adapters import Adapter, cpu_adapter, dxgi_adapter_rows, nvml_adapters
from ortq.errors import OrtqError


def _webgpu_adapters(notes: list[str]) -> list[Adapter]:
    """The GPUs the WebGPU EP can run on; none, with a note in ``notes`` saying why, where it cannot."""
    if importlib.util.find_spec("onnxruntime_ep_webgpu") is None:
        notes.append("no WebGPU adapters listed: onnxruntime-ep-webgpu is not installed (pip install 'ortq[webgpu]')")
        return []
    try:
        if platform.system() == "Linux":
            return plugin_ep.vulkan_adapters()
        import onnxruntime

        plugin_ep.register_webgpu(onnxruntime)
        return plugin_ep.webgpu_adapters(onnxruntime)
    except OrtqError as exc:
        notes.append(f"WebGPU adapters not enumerated: {exc}")
        return []


def _plugin_adapters(library: str, ep_name: str | None) -> list[Adapter]:
    """The devices of the plugin EP(s) in ``library`` (only ``ep_name``'s when given)."""
    import onnxruntime

    added = plugin_ep.register_library(onnxruntime, library, ep_name or Path(library).stem)
    names = [ep_name] if ep_name else added
    return [a for name in names for a in plugin_ep.plugin_adapters(onnxruntime, name, "plugin")]


def enumerate_adapters(ep_library: str | None = None, ep_name: str | None = None) -> tuple[list[Adapter], list[str]]:
    """Every adapter found, and notes on what could not be enumerated (never raises, except for
    an ``ep_library`` that cannot be registered: that one was asked for by name)."""
    adapters: list[Adapter] = []
    notes: list[str] = []
    try:
        adapters += dxgi_adapter_rows()
    except OSError as exc:
        notes.append(f"DirectML adapters not enumerated: {exc}")
    adapters += nvml_adapters()
    if not any(a.provider == "cuda" for a in adapters):
        notes.append("no CUDA devices (no NVIDIA driver, no GPU visible, or nvidia-ml-py not installed)")
    adapters += _webgpu_adapters(notes)
    if ep_library is not None:
        adapters += _plugin_adapters(ep_library, ep_name)
    adapters.append(cpu_adapter())
    return adapters, notes

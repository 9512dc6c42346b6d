"""Device discovery: which adapters this machine has, and which one an ``--adapter`` spec means.

- :mod:`ortq.devices.adapters`: the adapter row, DirectML's (DXGI), CUDA's (NVML) and the CPU's
  rows, and resolving a spec against them;
- :mod:`ortq.devices.dxgi`, :mod:`ortq.devices.vulkan`: DXGI's and Vulkan's devices through ctypes;
- :mod:`ortq.devices.plugin_ep`: plugin execution providers' devices (WebGPU, ``--ep-library``);
- :mod:`ortq.devices.winml`: Windows ML's catalog of EPs;
- :mod:`ortq.devices.enumeration`: every source together (``ortq adapters``, a worker's start).

Nothing here imports ONNX Runtime at import time, nor anything of the worker: ``ortq adapters``
and ``ortq pool`` use it without one.
"""

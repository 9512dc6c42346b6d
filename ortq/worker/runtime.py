"""Which ONNX Runtime distribution is installed, checked before it is imported.

``onnxruntime``, ``onnxruntime-gpu`` and ``onnxruntime-directml`` all install the same
``onnxruntime`` import package; with two of them installed, whichever was installed last
has silently overwritten parts of the other. A worker refuses to start in that state.
"""

from __future__ import annotations

import importlib
import platform
from importlib import metadata
from types import ModuleType

from ortq.errors import RuntimeConflict, RuntimeMissing

#: The distribution each provider needs, for the advice a conflict prints.
DISTRIBUTION_FOR_PROVIDER = {
    "dml": "onnxruntime-directml",
    "cuda": "onnxruntime-gpu",
    "cpu": "onnxruntime",
    "webgpu": "onnxruntime",
    "plugin": "onnxruntime",
    "winml": "onnxruntime-windowsml",
}


def installed_runtimes() -> list[tuple[str, str]]:
    """(name, version) of every installed distribution that ships the ``onnxruntime`` package.

    Recognised by its files (``onnxruntime/capi/...``), so add-ons such as
    ``onnxruntime-extensions`` or ``onnxruntime-genai`` do not count.
    """
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if not name.startswith("onnxruntime"):
            continue
        files = dist.files or []
        if any(str(f).replace("\\", "/").startswith("onnxruntime/capi/") for f in files):
            found[name] = dist.version
    return sorted(found.items())


def check_single_runtime(provider: str) -> tuple[str, str]:
    """Return the one installed runtime, or raise RuntimeMissing / RuntimeConflict with what to do."""
    runtimes = installed_runtimes()
    wanted = DISTRIBUTION_FOR_PROVIDER.get(provider, "onnxruntime")
    if not runtimes:
        raise RuntimeMissing(
            f"no ONNX Runtime is installed; install {wanted} "
            "(pip install 'ortq[worker]' on Windows or Linux CPU, 'ortq[cuda]' for NVIDIA on Linux)"
        )
    if len(runtimes) > 1:
        listed = ", ".join(f"{name} {version}" for name, version in runtimes)
        everything = " ".join(name for name, _ in runtimes)
        # Reinstalling the one to keep matters: the others have overwritten some of its files.
        raise RuntimeConflict(
            f"{len(runtimes)} ONNX Runtime distributions are installed ({listed}); they overwrite each "
            f"other's 'onnxruntime' package. For --provider {provider} keep only {wanted}: "
            f"pip uninstall -y {everything} && pip install {wanted}"
        )
    return runtimes[0]


def import_onnxruntime(provider: str) -> ModuleType:
    """Check the installation, then import and return ``onnxruntime``."""
    check_single_runtime(provider)
    return importlib.import_module("onnxruntime")


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
    if provider == "winml" and system != "Windows":
        return (
            f"Windows ML (--provider winml) is Windows-only (Windows 11 24H2 or later). On {os_name} use "
            "--provider webgpu, a plugin EP (--provider plugin), cuda or cpu"
        )
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

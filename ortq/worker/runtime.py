"""Which ONNX Runtime distribution is installed, checked before it is imported.

``onnxruntime``, ``onnxruntime-gpu`` and ``onnxruntime-directml`` all install the same
``onnxruntime`` import package; with two of them installed, whichever was installed last
has silently overwritten parts of the other. A worker refuses to start in that state.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from types import ModuleType

from ortq.errors import RuntimeConflict, RuntimeMissing

#: The distribution each provider needs, for the advice a conflict prints.
DISTRIBUTION_FOR_PROVIDER = {
    "dml": "onnxruntime-directml",
    "cuda": "onnxruntime-gpu",
    "cpu": "onnxruntime",
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

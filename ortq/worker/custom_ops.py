"""Custom-op libraries (``ortq worker --custom-ops``): operators a model uses that ONNX Runtime itself
lacks, registered with ``SessionOptions.register_custom_ops_library`` before the session is created.

The case they are here for: onnxruntime-extensions' image decoder (``DecodeImage``, domain
``com.microsoft.extensions``) at the head of a model's graph, so that a job carries a JPEG's 20-60
KB instead of the 602 KB of a decoded 3x224x224 float image (docs/wire-format.md, "Encoded
images"). ``--custom-ops onnxruntime_extensions`` means that package's own library; anything else is
the path of a shared library.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

from ortq.errors import CustomOpsUnavailable

#: ``--custom-ops`` values that name an installed package (its ``get_library_path()``), not a file,
#: and how to install each.
PACKAGES = {"onnxruntime_extensions": "pip install 'ortq[images]' (the onnxruntime-extensions package)"}

# ONNX Runtime's words for an operator no registered kernel or library provides, e.g.
# "com.microsoft.extensions:DecodeImage(-1) is not a registered function/op".
_UNREGISTERED_OP = re.compile(r"([\w.]+):(\w+)\(-?\d+\) is not a registered function/op")


def library_path(spec: str) -> str:
    """The custom-op library ``spec`` names: a package's (:data:`PACKAGES`) or a file's absolute path.
    Raises CustomOpsUnavailable when the package is missing or the file is not there."""
    if spec in PACKAGES:
        try:
            module = importlib.import_module(spec)
        except ImportError as exc:
            raise CustomOpsUnavailable(f"--custom-ops {spec}: {exc}; {PACKAGES[spec]}") from None
        return str(module.get_library_path())
    path = Path(spec).expanduser()
    if not path.is_file():
        names = " or ".join(PACKAGES)
        raise CustomOpsUnavailable(
            f"--custom-ops {spec}: no such file (give the path of a custom-op shared library, or {names})"
        )
    return str(path.resolve())


def register(options: Any, library: str) -> None:
    """Register ``library`` with the session options ``options``, or raise CustomOpsUnavailable."""
    try:
        options.register_custom_ops_library(library)
    except Exception as exc:  # ONNX Runtime's own Fail: not a shared library, no RegisterCustomOps, ...
        raise CustomOpsUnavailable(f"ONNX Runtime could not load the custom-op library {library}: {exc}") from exc


def unregistered_op_advice(message: str, library: str | None) -> str | None:
    """What to do when ONNX Runtime's ``message`` says the model uses an operator nobody registered;
    None for any other message."""
    found = _UNREGISTERED_OP.search(message)
    if found is None:
        return None
    domain, op = found.groups()
    if library is not None:
        return f"the model uses operator {op} of domain {domain}, which neither ONNX Runtime nor {library} provides"
    return (
        f"the model uses operator {op} of domain {domain}, which ONNX Runtime does not have: start the worker "
        "with --custom-ops onnxruntime_extensions (its operators are in the domains ai.onnx.contrib and "
        "com.microsoft.extensions; pip install 'ortq[images]') or --custom-ops PATH of the library that has it"
    )

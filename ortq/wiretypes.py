"""The ortq frame's vocabulary: its version, magic and limits, the dtypes it carries, and what a
decoded request or response is. ortq.wire encodes and decodes frames with these (and re-exports
them); they live apart so that the codec stays one readable module.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ortq.errors import InvalidInput, UnsupportedDtype

WIRE_VERSION: int = 1
MAGIC: bytes = b"ORTQ"
SUPPORTED_DTYPES: tuple[str, ...] = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
)
DEFAULT_MAX_FRAME_BYTES: int = 256 * 1024 * 1024
# Decoding a msgpack header builds Python objects several times its size (an empty array is one
# byte on the wire and ~64 bytes in memory), so the header gets its own, much smaller, limit.
MAX_HEADER_BYTES: int = 1024 * 1024
MAX_DIMS: int = 32

# The exact little-endian dtype each name stands for; a decoder builds its views with these, so
# arrays read the same on big-endian hosts.
WIRE_DTYPES: dict[str, np.dtype[Any]] = {name: np.dtype(name).newbyteorder("<") for name in SUPPORTED_DTYPES}
_NAMES_BY_KIND_SIZE: dict[tuple[str, int], str] = {(d.kind, d.itemsize): n for n, d in WIRE_DTYPES.items()}
ALIGN = 8
ZEROS = bytes(ALIGN)
PREFIX = struct.Struct("<4sI")
# A worker's error message can be a long traceback; it must still fit in the header limit.
MAX_ERROR_MESSAGE_CHARS = 64 * 1024


@dataclass(frozen=True)
class RemoteError:
    """Why a worker failed a job: the exception's class name and message, as sent in the frame."""

    type: str
    message: str


@dataclass(frozen=True)
class Request:
    """A decoded request: input tensors by name (read-only views of the frame) and run options."""

    inputs: dict[str, NDArray[Any]]
    options: dict[str, Any]

    @property
    def nonce(self) -> bytes | None:
        """The producer's ``options.nonce``, from which the worker makes its response's proof."""
        nonce = self.options.get("nonce")
        return nonce if isinstance(nonce, bytes) else None


@dataclass(frozen=True)
class Response:
    """A decoded response: outputs (empty when the job failed), the failure if any, and timings in seconds."""

    outputs: dict[str, NDArray[Any]]
    error: RemoteError | None
    timings: dict[str, float]
    #: ``wire.proof_of(model, the request's nonce)``: None when the request had no nonce, or the
    #: worker failed the job without reading it.
    proof: bytes | None = None
    #: Which version of the model answered (``served_by.version``), and the digest of its signature
    #: (``served_by.signature``); None from a worker before model versions, or one that said nothing.
    version: str | None = None
    signature: str | None = None

    @property
    def ok(self) -> bool:
        """True when the worker ran the model; False when ``error`` says why it did not."""
        return self.error is None


def dtype_name(dtype: np.dtype[Any]) -> str:
    """The wire name ('float32', ...) of a numpy dtype of either byte order, or UnsupportedDtype."""
    name = _NAMES_BY_KIND_SIZE.get((dtype.kind, dtype.itemsize))
    # A structured dtype with one field still has kind 'V', so kind + size identifies the type.
    if name is None:
        raise UnsupportedDtype(f"dtype {dtype} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    return name


def as_wire_array(name: str, value: object) -> NDArray[Any]:
    """``value`` as the little-endian C-contiguous array a frame carries; copies only when needed.

    Raises UnsupportedDtype (naming the tensor) for dtypes with no wire type, so a producer can
    check inputs before enqueueing anything.
    """
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"tensor names must be non-empty strings, got {short(name)}")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:  # ragged nested lists and the like
        raise InvalidInput(f"tensor {name!r} cannot be converted to an array: {exc}") from exc
    if arr.ndim > MAX_DIMS:  # what every decoder refuses, refused before it is sent
        raise InvalidInput(f"tensor {name!r} has {arr.ndim} dimensions; a frame carries at most {MAX_DIMS}")
    try:
        wire = WIRE_DTYPES[dtype_name(arr.dtype)]
    except UnsupportedDtype:
        raise UnsupportedDtype(
            f"tensor {name!r} has dtype {arr.dtype}, which ortq cannot carry; supported: {', '.join(SUPPORTED_DTYPES)}"
        ) from None
    # copy=False: an array already in wire layout is written straight from its own buffer.
    return arr.astype(wire, order="C", copy=False)


def short(value: object) -> str:
    """repr of attacker-controlled ``value``, cut so error messages and logs stay small."""
    try:
        text = repr(value)
    except RecursionError:  # msgpack nests up to 1023 deep; repr gives up near Python's recursion limit
        return f"<{type(value).__name__} nested too deeply to show>"
    return text if len(text) <= 80 else text[:77] + "..."

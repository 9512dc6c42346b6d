"""The ortq frame: one byte string carrying a request's or a response's tensors.

A frame is ``b"ORTQ"``, a little-endian u32 header length H, a msgpack header map of H bytes,
zero padding up to a multiple of 8, then the tensors' raw little-endian C-order bytes at the
offsets the header gives. docs/wire-format.md specifies it for implementers in other languages.

Frames come out of Redis, which anyone with access can write to, so the decoder treats them as
hostile: it raises only :class:`WireFormatError` (or its subclass :class:`PayloadTooLarge`), never
allocates from declared shapes, and returns arrays that are zero-copy views of the frame.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import Any, NoReturn, TypeGuard

import msgpack
import numpy as np
from numpy.typing import NDArray

from ortq import knownheaders
from ortq.errors import InvalidInput, PayloadTooLarge, WireFormatError
from ortq.wiretypes import ALIGN as _ALIGN
from ortq.wiretypes import (
    DEFAULT_MAX_FRAME_BYTES,
    MAGIC,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    SUPPORTED_DTYPES,
    WIRE_VERSION,
    RemoteError,
    Request,
    Response,
    as_wire_array,
    dtype_name,
)
from ortq.wiretypes import MAX_ERROR_MESSAGE_CHARS as _MAX_ERROR_MESSAGE_CHARS
from ortq.wiretypes import PREFIX as _PREFIX
from ortq.wiretypes import WIRE_DTYPES as _WIRE_DTYPES
from ortq.wiretypes import ZEROS as _ZEROS
from ortq.wiretypes import short as _short

#: The codec's functions, and the vocabulary of ortq.wiretypes re-exported: ``wire.Request``,
#: ``wire.SUPPORTED_DTYPES`` and the like are what other modules use.
__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "MAGIC",
    "MAX_DIMS",
    "MAX_HEADER_BYTES",
    "SUPPORTED_DTYPES",
    "WIRE_VERSION",
    "Layout",
    "RemoteError",
    "Request",
    "Response",
    "Served",
    "as_wire_array",
    "decode_request",
    "decode_request_in_full",
    "decode_response",
    "dtype_name",
    "encode_error",
    "encode_laid_out",
    "encode_request",
    "encode_response",
    "layout_of",
    "proof_of",
]


#: Bytes of a response's ``proof`` (SHA-256).
PROOF_BYTES = 32

#: Longest ``served_by`` value (a version name, a signature digest) a response may carry.
MAX_SERVED_CHARS = 64


@dataclass(frozen=True)
class Served:
    """What a worker's every response says of the model that answered: its version and the digest of
    its signature (ortq.signature.ModelSignature.digest), so that a producer can tell that the
    answer came from a model whose signature it checked its inputs against."""

    version: str
    signature: str

    def as_map(self) -> dict[str, str]:
        return {"version": self.version, "signature": self.signature}

    @cached_property
    def entry(self) -> bytes:
        """The header's ``served_by`` entry as msgpack bytes (key and value), appended as it is."""
        packed: bytes = msgpack.packb("served_by") + msgpack.packb(self.as_map())
        return packed


def proof_of(model: str, nonce: bytes) -> bytes:
    """What binds a response to its request: SHA-256 of the model's name, a newline and the request's
    nonce. The worker that read the request writes it in its response; the producer, who alone knows
    the nonce (request frames are write-only to producers, and no worker publishes a nonce), checks it.
    A response carrying it was made from that producer's own request frame, by a worker of that model."""
    return hashlib.sha256(model.encode() + b"\n" + nonce).digest()


def encode_request(inputs: Mapping[str, object], options: Mapping[str, Any] | None = None) -> bytes:
    """A request frame for ``inputs`` (anything np.asarray accepts) and msgpack-able ``options``."""
    opts = dict(options or {})
    if not all(isinstance(key, str) for key in opts):
        raise InvalidInput("option names must be strings")
    return _encode({"kind": "request", "inputs": inputs, "options": opts}, "inputs")


def encode_response(
    outputs: Mapping[str, NDArray[Any]],
    timings: Mapping[str, float] | None = None,
    proof: bytes | None = None,
    served: Served | None = None,
) -> bytes:
    """A successful response frame carrying ``outputs``, per-stage ``timings`` in seconds, the
    ``proof`` (``proof_of``) that binds it to its request and what ``served`` it."""
    return encode_laid_out(outputs, layout_of(outputs), _timings(timings), proof, served)


def encode_laid_out(
    outputs: Mapping[str, NDArray[Any]],
    layout: Layout | None,
    timings: dict[str, float],
    proof: bytes | None = None,
    served: Served | None = None,
) -> bytes:
    """encode_response for a caller that has looked up ``layout_of(outputs)`` already (the worker
    uses it for RQ's result too; None: no layout, the general encoder) and whose ``timings`` are
    the plain map of str to float the header carries."""
    if layout is None:
        body = {"kind": "response", "ok": True, "outputs": outputs, "timings": timings}
        return _encode(_with_proof(body, proof, served), "outputs")
    # The same bytes as _encode's: the header's map ends with the timings, the proof and served_by.
    head = layout.head if proof is None else layout.head_with_proof
    if served is not None:  # one entry more (a fixmap: the count is in its first byte)
        head = bytes((head[0] + 1,)) + head[1:]
    header = head + msgpack.packb(timings)
    if proof is not None:  # as msgpack's bin 8, as _encode writes it
        header += _PROOF_KEY + b"\xc4" + bytes((len(proof),)) + proof
    if served is not None:
        header += served.entry
    if len(header) > MAX_HEADER_BYTES:
        raise PayloadTooLarge(f"frame header is {len(header)} bytes; the limit is {MAX_HEADER_BYTES}")
    parts: list[bytes | memoryview] = [_PREFIX.pack(MAGIC, len(header)), header]
    parts.append(_ZEROS[: -(_PREFIX.size + len(header)) % _ALIGN])
    for pad, value in zip(layout.pads, outputs.values(), strict=True):
        parts += (pad, value.data)
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class Layout:
    """What a response says of outputs of given names, dtypes and shapes, worked out once for the
    jobs of a batch, whose outputs look alike: the header up to its timings (its map one entry
    longer in ``head_with_proof``), the padding before each tensor and, for RQ's result, each
    output's ``[dtype, shape]``."""

    head: bytes
    head_with_proof: bytes
    pads: tuple[bytes, ...]
    shapes: dict[str, list[Any]]


_PROOF_KEY = msgpack.packb("proof")
_LAYOUTS: dict[tuple[tuple[str, str, tuple[int, ...]], ...], Layout] = {}


def layout_of(outputs: Mapping[str, object]) -> Layout | None:
    """The Layout of ``outputs``; None unless they are C-contiguous arrays a frame carries as
    they are (encode_response converts any others)."""
    key = []
    for name, value in outputs.items():
        if type(value) is not np.ndarray or not value.flags.c_contiguous:
            return None
        key.append((name, value.dtype.str, value.shape))
    found = _LAYOUTS.get(tuple(key))
    if found is not None or any(as_wire_array(name, v) is not v for name, v in outputs.items()):
        return found
    descriptors, _ = _write_tensors(outputs)
    pads, end = [], 0
    for desc in descriptors.values():
        pads.append(_ZEROS[: desc["offset"] - end])
        end = desc["offset"] + desc["nbytes"]
    body = {"v": WIRE_VERSION, "kind": "response", "ok": True, "outputs": descriptors, "timings": None}
    head = msgpack.packb(body, use_bin_type=True)[:-1]  # less the timings' value (a nil)
    shapes = {name: [desc["dtype"], desc["shape"]] for name, desc in descriptors.items()}
    if len(_LAYOUTS) >= 64:  # a model with many output shapes: the cache stays small
        _LAYOUTS.clear()
    layout = _LAYOUTS[tuple(key)] = Layout(head, bytes([head[0] + 1]) + head[1:], tuple(pads), shapes)
    return layout


def encode_error(
    error_type: str,
    message: str,
    timings: Mapping[str, float] | None = None,
    proof: bytes | None = None,
    served: Served | None = None,
) -> bytes:
    """A failed response frame (with the ``proof`` of the request it answers, when its request was
    read); very long messages are cut so the frame always fits the header limit."""
    if len(message) > _MAX_ERROR_MESSAGE_CHARS:
        message = message[:_MAX_ERROR_MESSAGE_CHARS] + " [truncated]"
    error = {"type": error_type[:256], "message": message}
    return _encode(
        _with_proof({"kind": "response", "ok": False, "error": error, "timings": _timings(timings)}, proof, served),
        None,
    )


def _with_proof(body: dict[str, Any], proof: bytes | None, served: Served | None = None) -> dict[str, Any]:
    if proof is not None:
        body["proof"] = proof
    if served is not None:
        body["served_by"] = served.as_map()
    return body


def decode_request(frame: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Request:
    """The request in ``frame``; raises WireFormatError (PayloadTooLarge over ``max_bytes``)."""
    known = knownheaders.known_request(frame, max_bytes)
    return known if known is not None else decode_request_in_full(frame, max_bytes=max_bytes)[0]


def decode_request_in_full(
    frame: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> tuple[Request, knownheaders.KnownHeader | None]:
    """decode_request by every check, never through a remembered header (for a caller that has
    looked for one already: ortq.worker.jobs), with the header it remembered (None: it may not)."""
    header, data = _parse(frame, max_bytes, "request")
    options = header.get("options", {})
    if not isinstance(options, dict) or not all(isinstance(key, str) for key in options):
        raise WireFormatError(
            "header 'options' must be a map with string keys", "header 'options' is not a map with string keys"
        )
    _check_nonce(options.get("nonce"), "options 'nonce'")
    request = Request(inputs=_read_tensors(header, "inputs", data), options=options)
    return request, knownheaders.learn(frame, header, data)


def decode_response(frame: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Response:
    """The response in ``frame``; raises WireFormatError (PayloadTooLarge over ``max_bytes``)."""
    header, data = _parse(frame, max_bytes, "response")
    timings = header.get("timings", {})
    if not isinstance(timings, dict) or not all(isinstance(k, str) and _is_number(v) for k, v in timings.items()):
        raise WireFormatError("header 'timings' must be a map of string to number")
    proof = header.get("proof")
    if proof is not None and not (isinstance(proof, bytes) and len(proof) == PROOF_BYTES):
        _fail(f"header 'proof' must be {PROOF_BYTES} bytes (msgpack bin), got {_short(proof)}")
    version, signature = _served_by(header.get("served_by"))
    ok = header.get("ok")
    if ok is True:
        return Response(_read_tensors(header, "outputs", data), None, _float_map(timings), proof, version, signature)
    if ok is not False:
        raise WireFormatError(f"header 'ok' must be true or false, got {_short(ok)}")
    error = header.get("error")
    if not isinstance(error, dict) or not all(isinstance(error.get(k), str) for k in ("type", "message")):
        raise WireFormatError("a failed response needs 'error': {'type': str, 'message': str}")
    return Response({}, RemoteError(error["type"], error["message"]), _float_map(timings), proof, version, signature)


def _served_by(value: object) -> tuple[str | None, str | None]:
    """A response's ``served_by`` (absent: a worker before model versions) as (version, signature)."""
    if value is None:
        return None, None
    if not isinstance(value, dict) or not all(
        isinstance(value.get(k), str) and 0 < len(value[k]) <= MAX_SERVED_CHARS for k in ("version", "signature")
    ):
        _fail(f"header 'served_by' must be {{'version': str, 'signature': str}}, got {_short(value)}")
    return value["version"], value["signature"]


#: Bounds of a nonce (a producer's random bytes, which the worker's proof is made from).
NONCE_BYTES = (8, 64)


def _check_nonce(value: object, where: str) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, bytes) or not NONCE_BYTES[0] <= len(value) <= NONCE_BYTES[1]:
        _fail(
            f"header {where} must be {NONCE_BYTES[0]}-{NONCE_BYTES[1]} bytes (msgpack bin), got {_short(value)}",
            f"the nonce is not {NONCE_BYTES[0]}-{NONCE_BYTES[1]} bytes (msgpack bin)",
        )
    return value


def _encode(body: dict[str, Any], tensor_key: str | None) -> bytes:
    """The frame for header ``body``, whose ``tensor_key`` entry (arrays by name) becomes descriptors."""
    chunks: list[bytes | memoryview] = []
    if tensor_key is not None:
        body[tensor_key], chunks = _write_tensors(body[tensor_key])
    try:
        header = msgpack.packb({"v": WIRE_VERSION, **body}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:  # options msgpack cannot represent
        raise InvalidInput(f"header cannot be encoded as msgpack: {exc}") from exc
    if len(header) > MAX_HEADER_BYTES:
        raise PayloadTooLarge(f"frame header is {len(header)} bytes; the limit is {MAX_HEADER_BYTES}")
    pad = -(_PREFIX.size + len(header)) % _ALIGN
    return b"".join([_PREFIX.pack(MAGIC, len(header)) + header, _ZEROS[:pad], *chunks])


def _write_tensors(
    tensors: Mapping[str, object],
) -> tuple[dict[str, dict[str, Any]], list[bytes | memoryview]]:
    """Descriptors and data chunks (8-aligned, in map order) for ``tensors``; no tensor data is copied."""
    descriptors: dict[str, dict[str, Any]] = {}
    chunks: list[bytes | memoryview] = []
    offset = 0
    for name, value in tensors.items():
        arr = as_wire_array(name, value)
        pad = -offset % _ALIGN
        if pad:
            chunks.append(_ZEROS[:pad])
            offset += pad
        descriptors[name] = {
            "dtype": dtype_name(arr.dtype),
            "shape": list(arr.shape),
            "offset": offset,
            "nbytes": arr.nbytes,
        }
        if arr.nbytes:
            chunks.append(arr.data)  # a memoryview of the array's own buffer
            offset += arr.nbytes
    return descriptors, chunks


def _parse(frame: bytes | bytearray | memoryview, max_bytes: int, kind: str) -> tuple[dict[str, Any], memoryview]:
    """The validated header map and the data section of ``frame``, which must be of ``kind``."""
    try:
        view = memoryview(frame).cast("B")
    except TypeError:  # not a buffer (a str from a decode_responses=True client) or not contiguous
        _fail(f"a frame must be a contiguous bytes-like object, got {type(frame).__name__}")
    if view.nbytes > max_bytes:
        raise PayloadTooLarge(f"frame is {view.nbytes} bytes; the limit is {max_bytes}")
    if view[:4] != MAGIC[: len(view[:4])]:
        _fail("not an ortq frame (bad magic)", "not an ortq frame (bad magic)")
    if view.nbytes < _PREFIX.size:
        _fail(f"truncated frame: {view.nbytes} bytes, shorter than the 8-byte prefix", "truncated frame")
    size = _PREFIX.unpack_from(view)[1]
    data_start = _PREFIX.size + size + (-(_PREFIX.size + size) % _ALIGN)
    if data_start > view.nbytes:
        _fail(
            f"truncated frame: header length {size} needs {data_start} bytes, frame has {view.nbytes}",
            "truncated frame",
        )
    if size > MAX_HEADER_BYTES:
        raise PayloadTooLarge(f"frame header is {size} bytes; the limit is {MAX_HEADER_BYTES}")
    header = _unpack_header(view[_PREFIX.size : _PREFIX.size + size])
    version = header.get("v")
    if version != WIRE_VERSION or not _is_int(version):
        _fail(
            f"unsupported wire version {_short(version)}; this decoder supports version {WIRE_VERSION}",
            f"unsupported wire version (this worker reads version {WIRE_VERSION})",
        )
    if header.get("kind") != kind:
        _fail(f"expected a {kind} frame, got kind {_short(header.get('kind'))}", f"not a {kind} frame (its kind)")
    return header, view[data_start:]


def _unpack_header(raw: memoryview) -> dict[str, Any]:
    """The header map; every msgpack failure becomes a WireFormatError."""
    size = len(raw)
    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            use_list=True,
            # No container or string can hold more items or bytes than the header has bytes.
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size // 2,
            # The format has no extension types; max_ext_len=0 also stops msgpack's Timestamp.
            max_ext_len=0,
            ext_hook=_reject_ext,
            object_pairs_hook=_map_without_duplicates,
        )
    except msgpack.ExtraData:
        _fail("header holds more than one msgpack object", "header holds more than one msgpack object")
    except Exception as exc:  # msgpack raises ValueError, TypeError, StackError, UnicodeDecodeError...
        # unpackb reports running out of data only through this message; anything else is garbage.
        if "incomplete input" in str(exc):
            _fail("truncated header: msgpack data ends early", "truncated header")
        _fail(f"header is not valid msgpack: {type(exc).__name__}: {str(exc)[:120]}", "header is not valid msgpack")
    if not isinstance(header, dict):
        _fail(f"header must be a msgpack map, got {type(header).__name__}", "header is not a msgpack map")
    return header


def _read_tensors(header: dict[str, Any], key: str, data: memoryview) -> dict[str, NDArray[Any]]:
    """Zero-copy views into ``data`` for the descriptor map ``header[key]``, each fully validated."""
    descriptors = header.get(key)
    if not isinstance(descriptors, dict):
        _fail(
            f"header {key!r} must be a map of tensor descriptors, got {type(descriptors).__name__}",
            f"header {key!r} is not a map of tensor descriptors",
        )
    arrays: dict[str, NDArray[Any]] = {}
    for name, desc in descriptors.items():
        where = _Where(name, key)  # formatted only for an error message
        if not isinstance(name, str) or not name:
            _fail(f"{where}: tensor names must be non-empty strings", "a tensor name is not a non-empty string")
        arrays[name] = _read_tensor(where, desc, data)
    return arrays


def _read_tensor(where: _Where, desc: object, data: memoryview) -> NDArray[Any]:
    """A zero-copy view into ``data`` for one tensor's descriptor ``desc``, each of its fields
    checked against the format, and its bytes against the data section, first."""
    if not isinstance(desc, dict):
        _fail(f"{where}: descriptor must be a map, got {type(desc).__name__}", "a tensor descriptor is not a map")
    dtype, shape, offset, nbytes = (desc.get(k) for k in ("dtype", "shape", "offset", "nbytes"))
    if not isinstance(dtype, str) or dtype not in _WIRE_DTYPES:
        _fail(
            f"{where}: dtype {_short(dtype)} is not one of {', '.join(SUPPORTED_DTYPES)}",
            "a tensor's dtype is not one the format has",
        )
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        _fail(
            f"{where}: shape must be a list of at most {MAX_DIMS} dims, got {_short(shape)}",
            f"a tensor's shape is not a list of at most {MAX_DIMS} dims",
        )
    if not all(_is_int(d) and d >= 0 for d in shape):
        _fail(
            f"{where}: shape entries must be non-negative integers, got {_short(shape)}",
            "a tensor's shape holds something other than non-negative integers",
        )
    if not _is_int(offset) or not _is_int(nbytes) or offset < 0:
        _fail(
            f"{where}: offset and nbytes must be integers, offset >= 0",
            "a tensor's offset or nbytes is not a valid integer",
        )
    wire = _WIRE_DTYPES[dtype]
    count = prod(shape)  # Python ints: a hostile shape cannot overflow
    if count * wire.itemsize != nbytes:
        needed = count * wire.itemsize
        _fail(
            f"{where}: declared shape {_short(shape)} needs {needed} bytes but nbytes is {nbytes}",
            "a tensor's shape and nbytes disagree",
        )
    # numpy refuses shapes whose non-zero dims multiply past the address space, even when empty.
    if prod(max(d, 1) for d in shape) * wire.itemsize > sys.maxsize:
        _fail(f"{where}: shape {_short(shape)} is too large", "a tensor's shape is too large")
    if offset + nbytes > len(data):
        _fail(
            f"{where}: bytes {offset}..{offset + nbytes} lie past the data section ({len(data)} bytes)",
            "a tensor's bytes lie past the data section",
        )
    return np.frombuffer(data, dtype=wire, count=count, offset=offset).reshape(shape)


class _Where:
    """Which tensor of a header an error is about, formatted when the message is."""

    __slots__ = ("key", "name")

    def __init__(self, name: object, key: str) -> None:
        self.name, self.key = name, key

    def __format__(self, spec: str) -> str:
        return f"tensor {_short(self.name)} in {self.key!r}"


def _timings(timings: Mapping[str, float] | None) -> dict[str, float]:
    """Timings as the plain str -> float map the header carries."""
    return {str(k): float(v) for k, v in (timings or {}).items()}


def _float_map(values: dict[str, int | float]) -> dict[str, float]:
    """Decoded timings as floats; other encoders may write whole seconds as msgpack ints."""
    return {k: float(v) for k, v in values.items()}


def _is_int(value: object) -> TypeGuard[int]:
    """An integer that is not a bool (msgpack true would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A msgpack int or float, bools excluded."""
    return _is_int(value) or isinstance(value, float)


def _map_without_duplicates(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """object_pairs_hook for headers: a repeated key would let two decoders see different tensors."""
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("a header map repeats a key")
    return result


def _reject_ext(code: int, data: bytes) -> NoReturn:
    """ext_hook for headers: the format defines no msgpack extension types."""
    raise ValueError(f"msgpack extension type {code} is not allowed in a header")


def _fail(message: str, plain: str | None = None) -> NoReturn:
    """Raise WireFormatError (``plain``: the same in fixed words, nothing of the frame quoted); a
    function so every validation branch is one line."""
    raise WireFormatError(message, plain)

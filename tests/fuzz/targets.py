"""What the fuzzers check for one input, shared by the atheris harness (fuzz_wire.py) and the
plain-pytest replay of the corpus (tests/test_fuzz.py), so that both hold inputs to one contract.

Every input is tried three ways: as a request frame, as a response frame, and as an RQ job hash
(see :func:`job_hash`). The only allowed failure of a frame is a WireFormatError (a request
that decodes may then fail a model's signature check with InvalidInput); ``JobRecord.parse``
must never raise. Anything else, including a failed assertion here, is a crash.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

import msgpack
from numpy.typing import NDArray

from ortq import keys, wire
from ortq.errors import InvalidInput, PayloadTooLarge, WireFormatError
from ortq.rqjob import JobRecord
from ortq.signature import ModelSignature, TensorSpec

#: The job hash fields a worker reads, picked by a field's first byte in :func:`job_hash`.
JOB_FIELDS: tuple[bytes, ...] = (
    b"data",
    b"enqueued_at",
    b"created_at",
    b"timeout",
    b"ttl",
    b"result_ttl",
    b"failure_ttl",
    b"success_callback_name",
    b"failure_callback_name",
    b"stopped_callback_name",
    b"status",
    b"origin",
)


def _signature(*inputs: tuple[str, str, tuple[int | str, ...]]) -> ModelSignature:
    return ModelSignature(inputs=tuple(TensorSpec(n, d, s) for n, d, s in inputs), outputs=())


#: The signatures of tests/onnx_models.py's tiny and multi_dtype models, spelled out so the
#: harness does not import onnx: a decoded request is checked against both, as a worker would.
SIGNATURES: tuple[ModelSignature, ...] = (
    _signature(("x", "float32", ("batch", 4))),
    _signature(
        ("f16", "float16", ("n",)),
        ("i64", "int64", ("n", 2)),
        ("u8", "uint8", (3,)),
        ("flag", "bool", ("n",)),
        ("f64", "float64", ()),
    ),
)


def check_input(data: bytes) -> None:
    """Everything the fuzzers do with one input; raises (or asserts) only on a crash."""
    check_request(data)
    check_response(data)
    check_job_hash(data)


def check_request(frame: bytes) -> None:
    """``frame`` as a request: refused with WireFormatError, or decoded consistently and re-encodable."""
    try:
        request = wire.decode_request(frame)
    except WireFormatError:
        return
    _check_views(request.inputs, frame)
    for signature in SIGNATURES:
        with contextlib.suppress(InvalidInput):
            signature.check_inputs(request.inputs)
    try:
        again = wire.decode_request(wire.encode_request(request.inputs, request.options))
    except PayloadTooLarge:  # the canonical encoding of a packed hostile header can be larger
        return
    _assert_same_tensors(request.inputs, again.inputs)
    assert _packed(again.options) == _packed(request.options)


def check_response(frame: bytes) -> None:
    """``frame`` as a response: refused with WireFormatError, or decoded consistently and re-encodable."""
    try:
        response = wire.decode_response(frame)
    except WireFormatError:
        return
    _check_views(response.outputs, frame)
    assert all(isinstance(v, float) for v in response.timings.values())
    if response.error is None:
        again = wire.decode_response(wire.encode_response(response.outputs, response.timings))
        _assert_same_tensors(response.outputs, again.outputs)
    else:
        assert not response.outputs
        again = wire.decode_response(wire.encode_error(response.error.type, response.error.message, response.timings))
        assert again.error is not None
        # encode_error cuts long texts (types to 256, messages to 64 Ki characters) and keeps their start.
        assert response.error.type.startswith(again.error.type)
        assert again.error.message.startswith(response.error.message[: 64 * 1024])
    assert _packed(again.timings) == _packed(response.timings)


def job_hash(data: bytes) -> dict[bytes, bytes]:
    """A job hash built from fuzz bytes: a run of fields, each one byte picking its name from
    :data:`JOB_FIELDS`, one byte giving its value's length, then the value (cut short at the end)."""
    fields: dict[bytes, bytes] = {}
    at = 0
    while at + 2 <= len(data):
        name, size = JOB_FIELDS[data[at] % len(JOB_FIELDS)], data[at + 1]
        fields[name] = data[at + 2 : at + 2 + size]
        at += 2 + size
    return fields


def encode_job_hash(fields: dict[bytes, bytes]) -> bytes:
    """The fuzz input :func:`job_hash` turns into ``fields`` (values up to 255 bytes): for seeds."""
    return b"".join(bytes([JOB_FIELDS.index(k), len(v)]) + v for k, v in fields.items())


def check_job_hash(data: bytes) -> None:
    """``JobRecord.parse`` of the hash in ``data`` never raises, and lets only ortq's job run."""
    fields = job_hash(data)
    record = JobRecord.parse("fuzz", fields)
    if record.forbidden is None:
        raw = fields.get(b"data", b"")
        with contextlib.suppress(zlib.error):
            raw = zlib.decompress(raw)
        func_name, instance, _args, _kwargs = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        assert func_name == keys.JOB_FUNC and instance is None
        assert not any(fields.get(name) for name in JOB_FIELDS[7:10])  # the callback names


def _check_views(tensors: dict[str, NDArray[Any]], frame: bytes) -> None:
    """Decoded tensors are read-only little-endian views that lie within the frame."""
    for name, array in tensors.items():
        assert isinstance(name, str) and name
        assert not array.flags.writeable
        assert array.nbytes <= len(frame)
        assert array.ndim <= wire.MAX_DIMS
        assert array.dtype.byteorder in "<|=" and wire.dtype_name(array.dtype) == array.dtype.name


def _assert_same_tensors(first: dict[str, NDArray[Any]], second: dict[str, NDArray[Any]]) -> None:
    assert list(first) == list(second)
    for name, array in first.items():
        other = second[name]
        # Compared as bytes: NaN payloads and -0.0 must survive a round trip unchanged.
        assert (array.dtype, array.shape) == (other.dtype, other.shape)
        assert array.tobytes() == other.tobytes()


def _packed(value: object) -> bytes:
    """Decoded msgpack values compared by their encoding, which NaN floats do not spoil."""
    return msgpack.packb(value, use_bin_type=True)

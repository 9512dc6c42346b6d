"""Tests for ortq.wire: round trips, zero-copy decoding, and hostile frames.

Frames are also built by hand with struct + msgpack, the way an implementation in another language
would, so that the byte format itself (not just encoder/decoder agreement) is pinned down.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ortq.errors import InvalidInput, PayloadTooLarge, UnsupportedDtype, WireFormatError
from ortq.wire import (
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
    decode_request,
    decode_response,
    dtype_name,
    encode_error,
    encode_request,
    encode_response,
)

pytestmark = pytest.mark.rqcompat  # also in the second pass: the oldest numpy and msgpack allowed

ITEMSIZES = {name: np.dtype(name).itemsize for name in SUPPORTED_DTYPES}


def build_frame(header: Any, data: bytes = b"", *, pad: bool = True) -> bytes:
    """A frame assembled from the spec alone: magic, u32le length, msgpack header, padding, data."""
    packed = msgpack.packb(header, use_bin_type=True)
    prefix = b"ORTQ" + struct.pack("<I", len(packed)) + packed
    padding = b"\0" * (-len(prefix) % 8) if pad else b""
    return prefix + padding + data


def request_header(inputs: Any, **extra: Any) -> dict[str, Any]:
    return {"v": 1, "kind": "request", "inputs": inputs, "options": {}, **extra}


def desc(dtype: Any = "float32", shape: Any = (2,), offset: Any = 0, nbytes: Any = 8) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "offset": offset, "nbytes": nbytes}


def header_of(frame: bytes) -> dict[str, Any]:
    (size,) = struct.unpack_from("<I", frame, 4)
    result: dict[str, Any] = msgpack.unpackb(frame[8 : 8 + size])
    return result


def random_array(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random values of ``dtype`` whose first entries are the type's extremes (NaN/Inf for floats)."""
    if dtype == "bool":
        arr = rng.integers(0, 2, size=shape).astype(bool)
        arr.flat[:2] = [True, False]
        return arr
    if dtype.startswith("float"):
        arr = rng.normal(0, 1e3, size=shape).astype(dtype)
        finfo = np.finfo(dtype)
        arr.flat[:6] = [np.nan, np.inf, -np.inf, finfo.max, finfo.tiny, -0.0]
        return arr
    info = np.iinfo(dtype)
    arr = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    arr.flat[:2] = [info.min, info.max]
    return arr


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert got.dtype == want.dtype.newbyteorder("<")
    assert np.array_equal(got, want, equal_nan=got.dtype.kind == "f")


def roundtrip(arr: Any, name: str = "x") -> np.ndarray:
    return decode_request(encode_request({name: arr})).inputs[name]


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_round_trip_every_dtype(dtype: str) -> None:
    want = random_array(np.random.default_rng(len(dtype)), dtype, (4, 5))
    got = roundtrip(want)
    assert_same(got, want)
    assert dtype_name(got.dtype) == dtype
    assert header_of(encode_request({"x": want}))["inputs"]["x"] == desc(dtype, (4, 5), 0, 20 * ITEMSIZES[dtype])


def test_extreme_values_survive() -> None:
    assert roundtrip(np.array([2**64 - 1, 0], dtype=np.uint64)).tolist() == [2**64 - 1, 0]
    assert roundtrip(np.array([-(2**63), 2**63 - 1])).tolist() == [-(2**63), 2**63 - 1]
    halves = roundtrip(np.array([65504, -65504, 6e-8, np.nan], dtype=np.float16))
    assert halves[:3].tolist() == pytest.approx([65504, -65504, 5.96e-8], rel=1e-2)
    assert np.isnan(halves[3])


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "uint8"])
def test_zero_dim(dtype: str) -> None:
    want = np.array(7, dtype=dtype)
    got = roundtrip(want)
    assert got.shape == ()
    assert got.dtype == np.dtype(dtype)
    assert got.item() == want.item()
    assert header_of(encode_request({"x": want}))["inputs"]["x"]["shape"] == []


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (0, 0)])
def test_empty(shape: tuple[int, ...]) -> None:
    got = roundtrip(np.zeros(shape, dtype=np.float32))
    assert got.shape == shape
    assert got.dtype == np.float32
    assert got.size == 0


def test_empty_tensors_between_others() -> None:
    a, b = np.arange(3, dtype=np.int8), np.arange(4, dtype=np.float64)
    got = decode_request(encode_request({"a": a, "e": np.zeros((0, 5)), "b": b})).inputs
    assert list(got) == ["a", "e", "b"]
    assert got["a"].tolist() == [0, 1, 2]
    assert got["e"].shape == (0, 5)
    assert got["b"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(20, dtype=np.float32)[::3],
        lambda: np.arange(12, dtype=np.int32).reshape(3, 4).T,
        lambda: np.arange(24, dtype=np.uint16).reshape(2, 3, 4)[:, ::-1, 1:3],
        lambda: np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
        lambda: np.arange(10, dtype=np.float64).astype(">f4"),
        lambda: np.arange(-5, 5, dtype=">i8"),
        lambda: np.arange(12, dtype=">u2").reshape(3, 4)[::2, ::-1],
        lambda: np.array([1.5, -2.25, np.nan], dtype=">f2"),
    ],
    ids=["step", "transpose", "reversed-slice", "fortran", "be-f4", "be-i8", "be-u2-strided", "be-f2"],
)
def test_non_contiguous_and_big_endian(make: Any) -> None:
    want = make()
    got = roundtrip(want)
    assert_same(got, want)
    assert got.dtype.str[0] in "<|"


def test_python_values_are_converted() -> None:
    got = decode_request(encode_request({"l": [[1, 2], [3, 4]], "f": 2.5, "b": [True, False]})).inputs
    assert got["l"].dtype == np.int64 and got["l"].tolist() == [[1, 2], [3, 4]]
    assert got["f"].dtype == np.float64 and got["f"].shape == () and got["f"].item() == 2.5
    assert got["b"].dtype == np.bool_ and got["b"].tolist() == [True, False]


def test_tensor_order_and_alignment() -> None:
    arrays = {"c": np.arange(3, dtype=np.int8), "a": np.arange(5, dtype=np.float16), "b": np.ones((2, 3))}
    frame = encode_request(arrays)
    header = header_of(frame)
    assert list(header["inputs"]) == ["c", "a", "b"]
    offsets = [d["offset"] for d in header["inputs"].values()]
    assert offsets == [0, 8, 24]
    (size,) = struct.unpack_from("<I", frame, 4)
    data_start = 8 + size + (-(8 + size) % 8)
    assert data_start % 8 == 0
    assert frame[8 + size : data_start] == b"\0" * (data_start - 8 - size)
    assert frame[data_start + 3 : data_start + 8] == b"\0" * 5  # padding between tensors is zeros
    assert len(frame) == data_start + 24 + 48  # nothing after the last tensor


def test_options_round_trip() -> None:
    options = {"run": {"tag": "a", "levels": [1, 2.5, None, True]}, "blob": b"\x00\x01", "n": -3}
    frame = encode_request({"x": np.zeros(1)}, options)
    assert decode_request(frame).options == options
    assert decode_request(encode_request({"x": np.zeros(1)})).options == {}
    assert decode_request(build_frame({"v": 1, "kind": "request", "inputs": {}})).options == {}


def test_request_and_response_types() -> None:
    req = decode_request(encode_request({}))
    assert req == Request(inputs={}, options={})
    resp = decode_response(encode_response({}))
    assert resp.ok and resp.outputs == {} and resp.error is None and resp.timings == {}


def test_response_ok_with_outputs_and_timings() -> None:
    outputs = {
        "logits": np.arange(6, dtype=np.float32).reshape(2, 3),
        "ids": np.array([3, 1], dtype=np.int64),
    }
    timings = {"queue": 0.25, "decode": 1e-5, "run": 2.0, "encode": 3}
    resp = decode_response(encode_response(outputs, timings))
    assert isinstance(resp, Response) and resp.ok and resp.error is None
    assert list(resp.outputs) == ["logits", "ids"]
    assert resp.outputs["logits"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert resp.outputs["ids"].tolist() == [3, 1]
    assert resp.timings == {"queue": 0.25, "decode": 1e-5, "run": 2.0, "encode": 3.0}
    assert all(type(v) is float for v in resp.timings.values())


def test_error_response_round_trip() -> None:
    resp = decode_response(encode_error("ModelLoadError", "model.onnx: bad protobuf", {"queue": 0.5}))
    assert not resp.ok
    assert resp.error == RemoteError("ModelLoadError", "model.onnx: bad protobuf")
    assert resp.outputs == {}
    assert resp.timings == {"queue": 0.5}
    header = header_of(encode_error("E", "m"))
    assert header == {
        "v": 1,
        "kind": "response",
        "ok": False,
        "error": {"type": "E", "message": "m"},
        "timings": {},
    }


def test_huge_error_message_is_truncated_not_refused() -> None:
    resp = decode_response(encode_error("RuntimeError", "x" * (5 * MAX_HEADER_BYTES)))
    assert resp.error is not None
    assert resp.error.message.startswith("x" * 1000) and resp.error.message.endswith("[truncated]")
    assert len(resp.error.message) < MAX_HEADER_BYTES


def test_timings_ints_from_other_encoders_become_floats() -> None:
    frame = build_frame({"v": 1, "kind": "response", "ok": True, "outputs": {}, "timings": {"run": 2}})
    assert decode_response(frame).timings == {"run": 2.0}


# --- zero copy ----------------------------------------------------------------------------------


def test_decoded_arrays_share_memory_and_are_read_only() -> None:
    frame = encode_request({"a": np.arange(10, dtype=np.float32), "b": np.ones((2, 2), dtype=np.int16)})
    inputs = decode_request(frame).inputs
    backing = np.frombuffer(frame, np.uint8)
    for arr in inputs.values():
        assert np.shares_memory(arr, backing)
        assert not arr.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            arr[...] = 0
    outputs = decode_response(encode_response({"y": np.arange(4.0)})).outputs
    assert not outputs["y"].flags.writeable


def test_bytearray_and_memoryview_frames_give_views() -> None:
    frame = bytearray(encode_request({"a": np.arange(4, dtype=np.int32)}))
    arr = decode_request(frame).inputs["a"]
    assert np.shares_memory(arr, np.frombuffer(frame, np.uint8))
    assert arr.flags.writeable
    arr[0] = 99  # writes through to the frame: it is a view, not a copy
    assert decode_request(bytes(frame)).inputs["a"].tolist() == [99, 1, 2, 3]
    view_arr = decode_request(memoryview(bytes(frame))).inputs["a"]
    assert view_arr.tolist() == [99, 1, 2, 3] and not view_arr.flags.writeable


def test_as_wire_array_converts_only_when_needed() -> None:
    native = np.arange(6, dtype="<f4")
    assert as_wire_array("x", native) is native
    swapped = as_wire_array("x", native.astype(">f4")[::2])
    assert swapped.dtype.str == "<f4" and swapped.flags.c_contiguous
    assert swapped.tolist() == [0.0, 2.0, 4.0]


# --- encoder refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        np.array([object(), 1], dtype=object),
        np.array(["a", "bc"]),
        np.array([b"ab"]),
        np.array([1 + 2j]),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
        np.array([5], dtype="timedelta64[s]"),
        np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),
        np.zeros(2, dtype="V4"),
        np.zeros(2, dtype=np.longdouble) if np.dtype(np.longdouble).itemsize > 8 else np.zeros(2, "c16"),
        "text",
    ],
    ids=[
        "object",
        "str",
        "bytes",
        "complex",
        "datetime",
        "timedelta",
        "structured",
        "void",
        "longdouble",
        "pystr",
    ],
)
def test_unsupported_dtypes_rejected(value: Any) -> None:
    with pytest.raises(UnsupportedDtype) as info:
        encode_request({"pixels": value})
    message = str(info.value)
    assert "'pixels'" in message and str(np.asarray(value).dtype) in message
    assert "float32" in message and "uint64" in message
    with pytest.raises(UnsupportedDtype, match="'out'"):
        encode_response({"out": value})


@pytest.mark.skipif(np.lib.NumpyVersion(np.__version__) < "2.0.0", reason="numpy 1.x makes no array of 33 dimensions")
def test_tensors_of_more_dimensions_than_a_decoder_takes_are_refused_when_encoded() -> None:
    ok = np.zeros((1,) * MAX_DIMS, np.float32)
    assert decode_request(encode_request({"x": ok})).inputs["x"].shape == ok.shape
    deep = np.zeros((1,) * (MAX_DIMS + 1), np.float32)
    with pytest.raises(InvalidInput, match=f"'x' has {MAX_DIMS + 1} dimensions"):
        encode_request({"x": deep})
    with pytest.raises(InvalidInput, match=f"'y' has {MAX_DIMS + 1} dimensions"):
        encode_response({"y": deep})


def test_dtype_name() -> None:
    assert dtype_name(np.dtype(">f4")) == "float32"
    assert dtype_name(np.dtype("?")) == "bool"
    assert [dtype_name(np.dtype(n)) for n in SUPPORTED_DTYPES] == list(SUPPORTED_DTYPES)
    with pytest.raises(UnsupportedDtype, match="complex64"):
        dtype_name(np.dtype(np.complex64))


@pytest.mark.parametrize("name", ["", 3, None, b"x"])
def test_bad_tensor_names_rejected(name: Any) -> None:
    with pytest.raises(InvalidInput, match="non-empty"):
        encode_request({name: np.zeros(1)})


def test_bad_options_rejected() -> None:
    with pytest.raises(InvalidInput, match="option names"):
        encode_request({}, {1: "a"})  # type: ignore[dict-item]
    with pytest.raises(InvalidInput, match="msgpack"):
        encode_request({}, {"a": object()})


def test_ragged_input_rejected() -> None:
    with pytest.raises(InvalidInput, match="'x'"):
        encode_request({"x": [[1], [1, 2]]})


# --- hostile frames -----------------------------------------------------------------------------

SMALL_FRAME = encode_request({"x": np.array([1.0, 2.0], dtype=np.float32), "i": np.arange(3, dtype=np.int8)})


def test_every_truncation_is_rejected() -> None:
    (size,) = struct.unpack_from("<I", SMALL_FRAME, 4)
    data_start = 8 + size + (-(8 + size) % 8)
    for cut in range(len(SMALL_FRAME)):
        with pytest.raises(WireFormatError) as info:
            decode_request(SMALL_FRAME[:cut])
        message = str(info.value)
        if cut < data_start:
            assert "truncated" in message, (cut, message)
        else:
            assert "past the data section" in message, (cut, message)
    assert decode_request(SMALL_FRAME).inputs["i"].tolist() == [0, 1, 2]


def test_trailing_bytes_after_data_are_ignored() -> None:
    assert decode_request(SMALL_FRAME + b"\0" * 5).inputs["x"].tolist() == [1.0, 2.0]


GOOD = request_header({"x": desc()})
GARBAGE: list[tuple[bytes, str]] = [
    (b"", "truncated"),
    (b"OR", "truncated"),
    (b"ORTQ", "truncated"),
    (b"ORTQ\x00\x00", "truncated"),
    (b"XRTQ\x00\x00\x00\x00", "bad magic"),
    (b"ortq" + SMALL_FRAME[4:], "bad magic"),
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "bad magic"),
    (b"ORTQ" + struct.pack("<I", 1000) + b"\x80" * 10, "truncated"),
    (b"ORTQ" + struct.pack("<I", 2**32 - 1), "truncated"),
    (b"ORTQ" + struct.pack("<I", 0), "truncated header"),
    (b"ORTQ" + struct.pack("<I", 1) + b"\xc1" + b"\0" * 7, "not valid msgpack"),
    (b"ORTQ" + struct.pack("<I", 3) + b"\x92\x01\x02" + b"\0" * 5, "must be a msgpack map"),
    (b"ORTQ" + struct.pack("<I", 2) + b"\x81\xa1" + b"\0" * 6, "truncated header"),
    (b"ORTQ" + struct.pack("<I", 2) + b"\x80\x80" + b"\0" * 6, "more than one msgpack object"),
    (b"ORTQ" + struct.pack("<I", 4) + b"\x81\x01\x02\x03" + b"\0" * 4, "not valid msgpack"),  # int key
    (b"ORTQ" + struct.pack("<I", 4) + b"\xa3\xff\xfe\xfd" + b"\0" * 4, "not valid msgpack"),  # bad utf-8
    (b"ORTQ" + struct.pack("<I", 3) + b"\xd4\x05\x00" + b"\0" * 5, "not valid msgpack"),  # ext type
    (build_frame(msgpack.Timestamp(1, 0)), "not valid msgpack"),
    (b"ORTQ" + struct.pack("<I", 2048) + b"\x91" * 2048, "not valid msgpack"),  # nesting too deep
    (b"ORTQ" + struct.pack("<I", 8) + b"\xdd\xff\xff\xff\xff\x00\x00\x00", "not valid msgpack"),  # 4G array
    (build_frame(GOOD, b"\0" * 8)[:-9], "truncated"),  # padding missing
    # {"v": 1, "v": 2}: decoders that keep the first or the last key would disagree.
    (b"ORTQ" + struct.pack("<I", 7) + b"\x82\xa1v\x01\xa1v\x02" + b"\0" * 1, "repeats a key"),
]


@pytest.mark.parametrize(("frame", "needle"), GARBAGE, ids=[f"g{i}" for i in range(len(GARBAGE))])
def test_garbage_rejected(frame: bytes, needle: str) -> None:
    with pytest.raises(WireFormatError, match=needle):
        decode_request(frame)
    with pytest.raises(WireFormatError):
        decode_response(frame)


BAD_HEADERS: list[tuple[Any, str]] = [
    ({"kind": "request", "inputs": {}}, "version None"),
    ({**GOOD, "v": 2}, "unsupported wire version 2; this decoder supports version 1"),
    ({**GOOD, "v": True}, "version True"),
    ({**GOOD, "v": 1.0}, "version 1.0"),
    ({**GOOD, "v": "1"}, "version '1'"),
    ({**GOOD, "kind": "response"}, "expected a request frame"),
    ({**GOOD, "kind": 1}, "expected a request frame"),
    ({k: v for k, v in GOOD.items() if k != "kind"}, "expected a request frame"),
    ({**GOOD, "inputs": [1, 2]}, "'inputs' must be a map"),
    ({k: v for k, v in GOOD.items() if k != "inputs"}, "'inputs' must be a map"),
    ({**GOOD, "options": [1]}, "'options' must be a map"),
    ({**GOOD, "options": {b"k": 1}}, "'options' must be a map"),
    (request_header({"": desc()}), "non-empty"),
    (request_header({b"x": desc()}), "non-empty"),
    (request_header({"x": [1, 2]}), "descriptor must be a map"),
    (request_header({"x": {"shape": [2], "offset": 0, "nbytes": 8}}), "dtype None"),
    (request_header({"x": desc(dtype="float128")}), "dtype 'float128'"),
    (request_header({"x": desc(dtype=1)}), "dtype 1"),
    (request_header({"x": desc(dtype="<f4")}), "dtype '<f4'"),
    (request_header({"x": {**desc(), "shape": None}}), "shape must be a list"),
    (request_header({"x": {**desc(), "shape": 2}}), "shape must be a list"),
    (request_header({"x": desc(shape=[-2], nbytes=-8)}), "non-negative integers"),
    (request_header({"x": desc(shape=[True, 2])}), "non-negative integers"),
    (request_header({"x": desc(shape=[2.0])}), "non-negative integers"),
    (request_header({"x": desc(shape=["2"])}), "non-negative integers"),
    (request_header({"x": desc(shape=[1] * 33)}), "at most 32 dims"),
    (request_header({"x": desc(offset="0")}), "offset and nbytes must be integers"),
    (request_header({"x": desc(offset=None)}), "offset and nbytes must be integers"),
    (request_header({"x": desc(nbytes=8.0)}), "offset and nbytes must be integers"),
    (request_header({"x": desc(nbytes=True)}), "offset and nbytes must be integers"),
    (request_header({"x": desc(offset=-8)}), "offset >= 0"),
    (request_header({"x": desc(nbytes=12)}), "declared shape [2] needs 8 bytes but nbytes is 12"),
    (request_header({"x": desc(shape=[2**40, 2**40], nbytes=8)}), "needs 4835703278458516698824704 bytes"),
    (request_header({"x": desc(shape=[2**64 - 1] * 32, nbytes=8)}), "but nbytes is 8"),
    (request_header({"x": desc(shape=[0, 2**62, 4], nbytes=0)}), "too large"),
    (request_header({"x": desc(offset=4)}), "past the data section"),
    (request_header({"x": desc(offset=2**64 - 1)}), "past the data section"),
    (request_header({"x": desc(shape=[4], nbytes=16)}), "past the data section"),
    (request_header({"x": desc(shape=[0], offset=9, nbytes=0)}), "past the data section"),
]


@pytest.mark.parametrize(("header", "needle"), BAD_HEADERS, ids=[f"h{i}" for i in range(len(BAD_HEADERS))])
def test_bad_headers_rejected(header: Any, needle: str) -> None:
    with pytest.raises(WireFormatError) as info:
        decode_request(build_frame(header, b"\0" * 8))
    assert needle in str(info.value)
    assert type(info.value) is WireFormatError


RESPONSE = {"v": 1, "kind": "response"}
BAD_RESPONSES: list[tuple[Any, str]] = [
    ({**RESPONSE, "kind": "request", "ok": True, "outputs": {}}, "expected a response frame"),
    ({**RESPONSE, "outputs": {}}, "'ok' must be true or false"),
    ({**RESPONSE, "ok": 1, "outputs": {}}, "'ok' must be true or false"),
    ({**RESPONSE, "ok": True}, "'outputs' must be a map"),
    ({**RESPONSE, "ok": True, "outputs": {"y": desc(offset=8)}}, "tensor 'y' in 'outputs'"),
    ({**RESPONSE, "ok": False}, "needs 'error'"),
    ({**RESPONSE, "ok": False, "error": "boom"}, "needs 'error'"),
    ({**RESPONSE, "ok": False, "error": {"type": "E"}}, "needs 'error'"),
    ({**RESPONSE, "ok": False, "error": {"type": 1, "message": "m"}}, "needs 'error'"),
    ({**RESPONSE, "ok": True, "outputs": {}, "timings": [1.0]}, "'timings' must be a map"),
    ({**RESPONSE, "ok": True, "outputs": {}, "timings": {"run": "1s"}}, "'timings' must be a map"),
    ({**RESPONSE, "ok": True, "outputs": {}, "timings": {"run": True}}, "'timings' must be a map"),
]


@pytest.mark.parametrize(("header", "needle"), BAD_RESPONSES, ids=[f"r{i}" for i in range(len(BAD_RESPONSES))])
def test_bad_responses_rejected(header: Any, needle: str) -> None:
    with pytest.raises(WireFormatError) as info:
        decode_response(build_frame(header, b"\0" * 8))
    assert needle in str(info.value)


def test_kind_mismatch_between_encoders_and_decoders() -> None:
    with pytest.raises(WireFormatError, match="expected a response frame, got kind 'request'"):
        decode_response(encode_request({"x": np.zeros(2)}))
    with pytest.raises(WireFormatError, match="expected a request frame, got kind 'response'"):
        decode_request(encode_response({"x": np.zeros(2)}))
    with pytest.raises(WireFormatError, match="expected a request frame"):
        decode_request(encode_error("E", "m"))


def test_attacker_strings_are_cut_in_messages() -> None:
    with pytest.raises(WireFormatError) as info:
        decode_request(build_frame(request_header({"x": desc(dtype="f" * 100_000)})))
    assert len(str(info.value)) < 400


def test_non_bytes_frames_rejected() -> None:
    for frame in ["ORTQ....", 12, None, np.zeros((4, 4))[:, ::2]]:
        with pytest.raises(WireFormatError, match="bytes-like"):
            decode_request(frame)  # type: ignore[arg-type]


def test_max_bytes() -> None:
    size = len(SMALL_FRAME)
    assert decode_request(SMALL_FRAME, max_bytes=size).inputs["x"].tolist() == [1.0, 2.0]
    with pytest.raises(PayloadTooLarge, match=f"{size} bytes; the limit is {size - 1}"):
        decode_request(SMALL_FRAME, max_bytes=size - 1)
    # The size check comes before any parsing: garbage over the limit is "too large", not "bad magic".
    with pytest.raises(PayloadTooLarge):
        decode_response(b"garbage!" * 10, max_bytes=79)
    assert DEFAULT_MAX_FRAME_BYTES == 256 * 1024 * 1024


def test_header_size_limit() -> None:
    too_big = build_frame({**GOOD, "junk": "a" * MAX_HEADER_BYTES})
    with pytest.raises(PayloadTooLarge, match="header"):
        decode_request(too_big)
    with pytest.raises(PayloadTooLarge, match="header"):
        encode_request({}, {"junk": "a" * MAX_HEADER_BYTES})


def test_unknown_keys_are_ignored() -> None:
    header = request_header({"x": {**desc(), "layout": "nchw"}}, trace_id="abc", v2_field=[1, 2])
    data = struct.pack("<2f", 1.0, 2.0)
    req = decode_request(build_frame(header, data))
    assert req.inputs["x"].tolist() == [1.0, 2.0]


# --- the format itself --------------------------------------------------------------------------


def test_hand_built_frame_decodes() -> None:
    """Written as another language would write it, following docs/wire-format.md only."""
    header = {
        "v": 1,
        "kind": "request",
        "inputs": {
            "ids": {"dtype": "int64", "shape": [2, 2], "offset": 0, "nbytes": 32},
            "mask": {"dtype": "bool", "shape": [3], "offset": 32, "nbytes": 3},
            "scale": {"dtype": "float16", "shape": [], "offset": 40, "nbytes": 2},
        },
        "options": {"priority": 5},
    }
    packed = msgpack.packb(header)
    frame = bytearray(b"ORTQ")
    frame += struct.pack("<I", len(packed))
    frame += packed
    frame += b"\0" * (-len(frame) % 8)
    frame += struct.pack("<4q", 1, -2, 2**62, -(2**63))
    frame += b"\x01\x00\x01" + b"\0" * 5
    frame += struct.pack("<e", 0.5)
    req = decode_request(bytes(frame))
    assert req.options == {"priority": 5}
    assert req.inputs["ids"].dtype == np.int64 and req.inputs["ids"].tolist() == [[1, -2], [2**62, -(2**63)]]
    assert req.inputs["mask"].dtype == np.bool_ and req.inputs["mask"].tolist() == [True, False, True]
    assert req.inputs["scale"].dtype == np.float16 and req.inputs["scale"].shape == ()
    assert req.inputs["scale"].item() == 0.5


def test_tightly_packed_unaligned_offsets_decode() -> None:
    """Decoders must use the offsets given and must not assume 8-byte alignment."""
    data = b"\x07" + struct.pack("<d", 3.25) + struct.pack("<3H", 1, 2, 65535)
    header = request_header(
        {
            "b": {"dtype": "uint8", "shape": [1], "offset": 0, "nbytes": 1},
            "d": {"dtype": "float64", "shape": [1], "offset": 1, "nbytes": 8},
            "h": {"dtype": "uint16", "shape": [3], "offset": 9, "nbytes": 6},
            "again": {"dtype": "float64", "shape": [], "offset": 1, "nbytes": 8},
        }
    )
    got = decode_request(build_frame(header, data)).inputs
    assert got["b"].tolist() == [7]
    assert got["d"].tolist() == [3.25]
    assert got["h"].tolist() == [1, 2, 65535]
    assert got["again"].item() == 3.25


DOC_EXAMPLE_HEX = (
    "4f525451"  # magic
    "4b000000"  # header length 75
    "84a17601a46b696e64a772657175657374a6696e7075747381a17884a56474797065a7666c6f61743332a57368617065"
    "9102a66f666673657400a66e627974657308a76f7074696f6e7380"  # header
    "0000000000"  # padding to offset 88
    "0000803f00000040"  # x = [1.0, 2.0] as <f4
)


def test_encoder_output_is_byte_exact() -> None:
    """The worked example in docs/wire-format.md; changing the encoder's bytes must be deliberate."""
    frame = encode_request({"x": np.array([1.0, 2.0], dtype=np.float32)})
    assert frame.hex() == DOC_EXAMPLE_HEX
    assert frame[:4] == MAGIC == b"ORTQ" and WIRE_VERSION == 1
    assert len(frame) == 96 and frame[88:] == struct.pack("<2f", 1.0, 2.0)


def test_supported_dtypes_list() -> None:
    assert SUPPORTED_DTYPES == (
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


# --- properties ---------------------------------------------------------------------------------


def decode_either(frame: bytes) -> None:
    """Decode as both kinds; anything but a WireFormatError (or a result) fails the test."""
    for decode in (decode_request, decode_response):
        try:
            result = decode(frame)
        except WireFormatError:
            continue
        assert isinstance(result, Request | Response)
        tensors = result.inputs if isinstance(result, Request) else result.outputs
        for arr in tensors.values():
            assert arr.nbytes <= len(frame)


FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(frame: bytes) -> None:
    decode_either(frame)
    decode_either(MAGIC + frame)


SEEDS = [
    SMALL_FRAME,
    encode_response({"y": np.arange(3, dtype=np.uint16), "z": np.zeros((2, 0))}, {"run": 0.1}),
    encode_error("ValueError", "bad"),
]


@FAST
@given(
    st.sampled_from(SEEDS),
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(-8, 8),
)
def test_mutated_frames_never_crash(seed: bytes, edits: list[tuple[int, int]], resize: int) -> None:
    frame = bytearray(seed)
    for index, value in edits:
        frame[index % len(frame)] = value
    frame = frame[: len(frame) + resize] if resize < 0 else frame + bytes(resize)
    decode_either(bytes(frame))


scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
values = st.recursive(
    scalars | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
descriptors = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from([*SUPPORTED_DTYPES, "complex64"]) | values,
        "shape": st.lists(st.integers(-2, 2**63) | scalars, max_size=4) | values,
        "offset": st.integers(-2, 40) | values,
        "nbytes": st.integers(-2, 40) | values,
    },
)
headers = st.fixed_dictionaries(
    {"v": st.just(1) | values, "kind": st.sampled_from(["request", "response"]) | values},
    optional={
        "inputs": st.dictionaries(st.text(max_size=3), descriptors | values, max_size=3) | values,
        "outputs": st.dictionaries(st.text(max_size=3), descriptors | values, max_size=3) | values,
        "options": values,
        "ok": st.booleans() | values,
        "error": st.fixed_dictionaries({"type": values, "message": values}) | values,
        "timings": st.dictionaries(st.text(max_size=3), scalars) | values,
    },
)


@FAST
@given(headers, st.binary(max_size=48))
def test_structured_headers_never_crash(header: dict[str, Any], data: bytes) -> None:
    decode_either(build_frame(header, data))

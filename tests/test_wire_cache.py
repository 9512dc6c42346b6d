"""The worker's per-job shortcuts decide nothing on their own: a request frame whose header was
seen before (ortq.wire's remembered headers), a response whose outputs look like the last job's
(``wire.layout_of``) and a job hash like the last one (``JobRecord.parse``) come out exactly as
without them, and a forged input that differs from a remembered one anywhere is checked in full.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ortq import knownheaders, rqjob, wire
from ortq.errors import WireFormatError
from ortq.rqjob import JobRecord

PIXELS = np.arange(64, dtype=np.float32).reshape(1, 64)


def producer_frame(nonce: bytes | None = None, inputs: dict[str, Any] | None = None) -> bytes:
    """A request as ortq's producers write it (ortq.producer.checks.encode_job)."""
    return wire.encode_request(inputs or {"pixels": PIXELS}, {"nonce": nonce or os.urandom(16)})


def outcome(frame: bytes | bytearray, *, cold: bool) -> tuple[Any, ...]:
    """What decoding ``frame`` gives, comparable; ``cold``: with nothing remembered."""
    if cold:
        knownheaders.KNOWN.clear()
    try:
        request = wire.decode_request(frame, max_bytes=4096)
    except WireFormatError as exc:
        return type(exc), str(exc)
    arrays = {k: (v.dtype.str, v.shape, v.tobytes(), v.flags.writeable) for k, v in request.inputs.items()}
    return "decoded", request.options, arrays


def warm_and_cold(frame: bytes | bytearray, known: bytes) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``frame`` decoded after ``known`` was (so that its header is remembered), and on its own."""
    knownheaders.KNOWN.clear()
    wire.decode_request(known)
    warm = outcome(frame, cold=False)
    return warm, outcome(frame, cold=True)


def test_a_producers_requests_decode_through_their_remembered_header() -> None:
    first, second = producer_frame(), producer_frame(b"n" * 16)
    knownheaders.KNOWN.clear()
    wire.decode_request(first)
    assert len(knownheaders.KNOWN) == 1
    warm = wire.decode_request(second)
    assert warm.nonce == b"n" * 16 and warm.options == {"nonce": b"n" * 16}
    assert outcome(second, cold=False) == outcome(second, cold=True)
    assert not warm.inputs["pixels"].flags.writeable and warm.inputs["pixels"].base is not None


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_frame_differing_from_a_remembered_one_decodes_or_fails_as_without_it(data: st.DataObject) -> None:
    known = producer_frame(b"k" * 16)  # the same each example: hypothesis replays what it drew against it
    frame = bytearray(known)
    how = data.draw(st.sampled_from(["byte", "truncate", "append"]))
    if how == "byte":
        at = data.draw(st.integers(0, len(frame) - 1))
        frame[at] = data.draw(st.integers(0, 255).filter(lambda b: b != known[at]))
    elif how == "truncate":
        del frame[data.draw(st.integers(0, len(frame) - 1)) :]
    else:
        frame += data.draw(st.binary(min_size=1, max_size=16))
    # The worker reads large frames into bytearrays (ortq.worker.largeframes): both go the same way.
    warm, cold = warm_and_cold(data.draw(st.sampled_from([bytes, bytearray]))(frame), known)
    assert warm == cold


def test_a_frame_read_into_a_bytearray_decodes_through_the_header_remembered_from_bytes() -> None:
    first, second = producer_frame(), bytearray(producer_frame(b"m" * 16))
    knownheaders.KNOWN.clear()
    wire.decode_request(first)
    warm = wire.decode_request(second)
    assert len(knownheaders.KNOWN) == 1 and warm.nonce == b"m" * 16 and type(warm.nonce) is bytes
    assert outcome(second, cold=False) == outcome(second, cold=True)
    np.testing.assert_array_equal(warm.inputs["pixels"], PIXELS)
    assert warm.inputs["pixels"].base is not None  # a view of the frame's buffer, not a copy


def test_a_known_header_with_too_little_data_is_refused_as_without_it() -> None:
    known = producer_frame()
    warm, cold = warm_and_cold(known[:-4], known)
    assert warm == cold and warm[0] is WireFormatError and "lie past the data section" in warm[1]
    with pytest.raises(wire.PayloadTooLarge):
        wire.decode_request(known, max_bytes=len(known) - 1)


def test_only_a_nonce_as_the_headers_last_bytes_is_left_unread() -> None:
    """Where the last 16 bytes are something else's (a key after the options), or the header has
    other options, another encoding or no nonce, nothing is remembered."""
    nonce = os.urandom(16)
    header = msgpack.unpackb(producer_frame(nonce)[8:115])
    data = PIXELS.tobytes()
    forged = [
        {**header, "extra": nonce},
        {**header, "options": {"nonce": nonce, "other": 1}},
        {**header, "options": {"nonce": None}},
        {**header, "options": {}},
        {**header, "options": {"nonce": nonce[:12]}},
    ]
    for fields in forged:
        packed = msgpack.packb(fields, use_bin_type=True)
        frame = b"ORTQ" + struct.pack("<I", len(packed)) + packed
        frame += bytes(-len(frame) % 8) + data
        knownheaders.KNOWN.clear()
        wire.decode_request(frame)
        assert not knownheaders.KNOWN, fields
        other = frame[: len(packed) + 8 - 16] + os.urandom(16) + frame[len(packed) + 8 :]
        assert outcome(other, cold=False) == outcome(other, cold=True)
    # The same header with its version as a uint8 (0xcc 0x01, valid msgpack, not msgpack-python's).
    frame = producer_frame()
    packed = frame[8:115].replace(b"\xa1v\x01", b"\xa1v\xcc\x01", 1)
    odd = b"ORTQ" + struct.pack("<I", len(packed)) + packed + bytes(-(8 + len(packed)) % 8) + data
    knownheaders.KNOWN.clear()
    assert wire.decode_request(odd).nonce == frame[99:115]
    assert not knownheaders.KNOWN


def test_other_buffers_and_many_headers_take_the_full_path() -> None:
    known = producer_frame()
    knownheaders.KNOWN.clear()
    wire.decode_request(known)
    assert outcome(bytearray(known), cold=False) == outcome(bytearray(known), cold=True)
    assert wire.decode_request(memoryview(known)).options == wire.decode_request(known).options
    for rows in range(1, 80):  # a header of each shape: the cache stays bounded
        wire.decode_request(producer_frame(inputs={"x": np.zeros((rows, 2), np.int8)}))
    assert len(knownheaders.KNOWN) <= 64


OUTPUT_SETS: list[dict[str, Any]] = [
    {"probabilities": np.ones((32, 10), np.float32)[3:4], "label": np.arange(32)[3:4]},
    {"probabilities": np.ones((32, 10), np.float32)[3:9], "label": np.arange(32)[3:9]},
    {"a": np.zeros((0, 3), np.int8), "b": np.ones((2,), np.float64), "c": np.ones((3,), np.uint16)},
    {"flag": np.ones((1,), np.bool_), "h": np.ones((5,), np.float16)},
    {"x": np.ones((2, 2), ">f4")},  # converted: no layout
    {"x": np.ones((4, 4), np.float32)[:, ::2]},  # not contiguous: no layout
    {"x": [[1, 2], [3, 4]]},  # not an array: no layout
    {},
]


@pytest.mark.parametrize("outputs", OUTPUT_SETS)
@pytest.mark.parametrize("proof", [None, wire.proof_of("m", b"x" * 16)])
@pytest.mark.parametrize("timings", [None, {"queue": 0.5, "run": 1}, {}])
def test_a_response_is_the_same_bytes_through_a_layout(
    outputs: dict[str, Any], proof: bytes | None, timings: dict[str, float] | None
) -> None:
    wire._LAYOUTS.clear()
    body = {"kind": "response", "ok": True, "outputs": outputs, "timings": wire._timings(timings)}
    expected = wire._encode(wire._with_proof(body, proof), "outputs")
    assert wire.encode_response(outputs, timings, proof) == expected  # learns the layout
    assert wire.encode_response(outputs, timings, proof) == expected  # uses it
    layout = wire.layout_of(outputs)
    if layout is not None:
        shapes = {name: [wire.dtype_name(v.dtype), list(v.shape)] for name, v in outputs.items()}
        assert layout.shapes == shapes
    assert wire.encode_laid_out(outputs, layout, wire._timings(timings), proof) == expected  # a layout, or None
    assert wire.decode_response(expected).proof == proof


def test_a_job_hash_like_a_remembered_one_except_for_its_function_is_refused() -> None:
    good = {b"data": rqjob.MsgpackSerializer.dumps(["ortq.rqjob.infer", None, ["m"], {}]), b"result_ttl": b"60"}
    rqjob._SETTLED.clear()
    assert JobRecord.parse("a", good).forbidden is None
    forged = {**good, b"data": rqjob.MsgpackSerializer.dumps(["os.system", None, ["ls"], {}])}
    # Refused in the worker's own words: a job record is anyone's to write (docs/security.md).
    refused = str(JobRecord.parse("b", forged).forbidden)
    assert "a function other than ortq.rqjob.infer" in refused and "os.system" not in refused
    with_callback = {**good, b"success_callback_name": b"os.system"}
    assert "callback" in str(JobRecord.parse("c", with_callback).forbidden)
    assert JobRecord.parse("d", {**good, b"result_ttl": b"61"}).result_ttl == 61
    later = JobRecord.parse("e", {**good, b"enqueued_at": b"2026-01-02T03:04:05.000006Z"})
    assert later.job_id == "e" and later.enqueued_at is not None and later.enqueued_at.microsecond == 6
    for ttl in range(100):
        JobRecord.parse("f", {**good, b"ttl": str(ttl).encode()})
    assert len(rqjob._SETTLED) <= 64


@pytest.mark.parametrize("side", [2, 96], ids=["small", "over-GIL_FREE_COPY"])
def test_frames_of_a_remembered_header_join_as_their_decoded_inputs_would(side: int) -> None:
    """KnownHeader.joined (a batch's inputs, straight from its frames) equals np.concatenate of
    each frame's decoded inputs, tensor by tensor, for bytes and bytearray frames alike; with
    tensors under GIL_FREE_COPY bytes a frame (joined as bytes) and over it (by numpy)."""
    rng = np.random.default_rng(7)

    def inputs() -> dict[str, Any]:
        a = rng.standard_normal((2, 3, side, side)).astype(np.float32)
        return {"a": a, "ids": rng.integers(0, 9, (2,), np.int64)}

    assert (2 * 3 * side * side * 4 >= knownheaders.GIL_FREE_COPY) == (side > 2)

    frames: list[bytes | bytearray] = [producer_frame(inputs=inputs()) for _ in range(4)]
    frames[2] = bytearray(frames[2])
    knownheaders.KNOWN.clear()
    decoded = [wire.decode_request(frame).inputs for frame in frames]
    found = [knownheaders.known_frame(frame, 1 << 20) for frame in frames[1:]]
    assert all(f is not None and f[0] is found[0][0] for f in found)  # type: ignore[index]
    joined = found[0][0].joined(frames)  # type: ignore[index]
    assert list(joined) == ["a", "ids"]
    for name in joined:
        expected = np.concatenate([d[name] for d in decoded])
        assert joined[name].dtype == expected.dtype and joined[name].shape == expected.shape
        np.testing.assert_array_equal(joined[name], expected)


def test_a_traced_producers_requests_share_one_remembered_header() -> None:
    """Requests whose options carry a traceparent before the nonce (ortq.tracing) are remembered up
    to its value: frames of other spans decode through the same header, with what the full decode
    gives; a traceparent that is no ASCII, or bytes between it and the nonce changed, go the full way."""

    def traced(traceparent: str, nonce: bytes) -> bytes:
        return wire.encode_request({"pixels": PIXELS}, {"traceparent": traceparent, "nonce": nonce})

    span = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    knownheaders.KNOWN.clear()
    wire.decode_request(traced(span, b"k" * 16))
    assert len(knownheaders.KNOWN) == 1
    other = traced("00-" + "12" * 16 + "-" + "34" * 8 + "-00", b"n" * 16)
    warm = wire.decode_request(other)
    assert warm.options == {"traceparent": "00-" + "12" * 16 + "-" + "34" * 8 + "-00", "nonce": b"n" * 16}
    assert knownheaders.known_frame(other, 4096) is not None
    assert outcome(other, cold=False) == outcome(other, cold=True)
    end = 8 + int.from_bytes(other[4:8], "little")
    start = end - knownheaders.TRACED_TAIL
    for at, value in ((start, 0xC3), (start + 54, 0xFF), (end - 24, 0xA6), (end - 18, 0x11), (start - 1, 0x36)):
        changed = bytearray(other)
        changed[at] = value
        assert outcome(bytes(changed), cold=False) == outcome(bytes(changed), cold=True), at
        knownheaders.KNOWN.clear()
        wire.decode_request(traced(span, b"k" * 16))
    # Not taken for an untraced header, nor the other way round.
    untraced = producer_frame(b"u" * 16)
    assert knownheaders.known_frame(untraced, 4096) is None
    assert outcome(untraced, cold=False) == outcome(untraced, cold=True)

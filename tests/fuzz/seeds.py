"""Write the seed inputs the fuzz corpus grew from: ``python tests/fuzz/seeds.py DIR``.

Seeds are valid frames of every kind and dtype, a few hand-built edge cases (packed headers,
deep nesting), and job hashes in :func:`tests.fuzz.targets.job_hash`'s format. The corpus kept
in tests/fuzz/corpus/wire is these plus what the fuzzer found, minimized with ``-merge=1``.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import zlib
from pathlib import Path

import msgpack
import numpy as np

if __package__ in (None, ""):  # run as a script: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ortq import wire
from ortq.serializer import MsgpackSerializer
from tests.fuzz.targets import encode_job_hash


def raw_frame(header: object, data: bytes = b"") -> bytes:
    """A frame around any msgpack ``header``, as a hostile producer would build it."""
    packed = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    frame = wire.MAGIC + struct.pack("<I", len(packed)) + packed
    return frame + bytes(-len(frame) % 8) + data


def frames() -> list[bytes]:
    """Valid and almost-valid frames."""
    arrays = {name: np.arange(3).astype(name) for name in wire.SUPPORTED_DTYPES}
    nested = b"\x91" * 1000 + b"\x01"  # a 1000-deep list: repr of it overflows Python's recursion limit
    return [
        wire.encode_request({"x": np.ones((2, 4), np.float32)}),
        wire.encode_request(arrays, {"priority": 1, "tag": "a", "raw": b"\x00", "deep": [[1.5, None]]}),
        wire.encode_request({"empty": np.zeros((0, 4), np.float32), "scalar": np.float64(2.5)}),
        wire.encode_request(
            {
                "f16": np.ones(2, np.float16),
                "i64": np.ones((2, 2), np.int64),
                "u8": np.arange(3, dtype=np.uint8),
                "flag": np.array([True, False]),
                "f64": np.float64(1.0),
            }
        ),
        wire.encode_request({"x": np.ones(4, np.float32)}),  # wrong rank for the tiny model
        wire.encode_request({"x": np.ones((1, 4), np.int32)}),  # wrong dtype
        raw_frame(
            {"v": 1, "kind": "request", "inputs": {"": {"dtype": "bool", "shape": [], "offset": 0, "nbytes": 1}}},
            b"\x01",
        ),  # an empty name
        wire.encode_response({"y": np.arange(6, dtype=np.float32).reshape(2, 3)}, {"run": 0.5, "queue": 1e-3}),
        wire.encode_error("InvalidInput", "input 'x' has rank 1", {"decode": 0.0}),
        raw_frame(
            {"v": 1, "kind": "request", "inputs": {"x": {"dtype": "uint8", "shape": [3], "offset": 1, "nbytes": 3}}},
            b"\x00abc",
        ),
        raw_frame(
            {
                "v": 1,
                "kind": "request",
                "inputs": {"x": {"dtype": "int8", "shape": [2**62, 0] + [2] * 30, "offset": 0, "nbytes": 0}},
            }
        ),
        raw_frame({"v": 1, "kind": "response", "ok": True, "timings": {"run": 1}, "outputs": {}}),
        raw_frame(b"\x82" + msgpack.packb("v") + nested + msgpack.packb("kind") + msgpack.packb("request")),
        b"ORTQ",
        b"",
    ]


def job_hashes() -> list[bytes]:
    """Job hashes: ortq's own (plain and zlib-compressed data), other callables, odd fields."""
    ours = MsgpackSerializer.dumps(["ortq.rqjob.infer", None, ["tiny"], {}])
    now = b"2026-12-02T10:00:00.123456Z"
    return [
        encode_job_hash({b"data": ours, b"enqueued_at": now, b"result_ttl": b"600", b"timeout": b"30"}),
        encode_job_hash({b"data": zlib.compress(ours), b"ttl": b"-1", b"created_at": now}),
        encode_job_hash({b"data": MsgpackSerializer.dumps(["os.system", None, ["id"], {}])}),
        encode_job_hash({b"data": MsgpackSerializer.dumps(["ortq.rqjob.infer", "self", [], {}])}),
        encode_job_hash({b"data": ours, b"failure_callback_name": b"os.system"}),
        encode_job_hash({b"data": b"\x80\x04\x95" + ours, b"enqueued_at": b"yesterday", b"timeout": b"1e9"}),
    ]


def main(directory: str) -> None:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for seed in frames() + job_hashes():
        (out / hashlib.sha1(seed).hexdigest()).write_bytes(seed)


if __name__ == "__main__":
    main(sys.argv[1])

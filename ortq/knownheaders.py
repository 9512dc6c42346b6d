"""The worker's fast path for request headers it has seen: ortq.wire.decode_request asks here first.

A producer's requests differ only in their nonce, the header's last 16 bytes (ortq's producers
write ``options`` last, holding nothing but the nonce). A header that passed every check is
remembered by its bytes up to those 16, with what it declares; a frame whose bytes are the same
up there decodes the same (msgpack is read front to back, and a bin's payload is never looked
into), so it is only checked for what is its own: its length. Keys are exact bytes: a forged
header that differs anywhere else is not found and gets the full checks.

A traced producer's requests (ortq.tracing) also carry a W3C ``traceparent`` just before the nonce:
55 characters that differ from call to call. Such a header is remembered by its bytes up to that
value, with the fixed bytes between it and the nonce checked too. The worker uses no option but the
nonce (a tracing worker reads and checks the trace context itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import msgpack
import numpy as np

from ortq.wiretypes import PREFIX, WIRE_DTYPES, Request

NONCE_TAIL = 16
#: What lies between a traceparent's value and the nonce: the key ``nonce``, then bin 8 of 16 bytes.
NONCE_ENTRY = b"\xa5nonce\xc4\x10"
#: A traceparent (``00-<32 hex>-<16 hex>-<2 hex>``) as msgpack writes it: str 8 of 55 bytes.
TRACEPARENT_CHARS = 55
TRACED_TAIL = TRACEPARENT_CHARS + len(NONCE_ENTRY) + NONCE_TAIL
MAX_HEADER = 1024  # bounds what the cache holds: 64 keys of at most this
#: A tensor of at least this many bytes a frame is joined by np.concatenate, which copies without
#: the GIL, rather than by bytes.join, which holds it: joining a batch of 600 KB images held the
#: GIL for ~150 us a job, during which the feeder could not read the next batch's frames
#: (bench/gpu/throughput.py conv on the H200, docs/results/performance-history.md "Ninth pass").
GIL_FREE_COPY = 64 * 1024
KNOWN: dict[bytes, KnownHeader] = {}


#: Compared and hashed by identity (``eq=False``): one object per remembered header, so that the
#: worker can work out what a header's frames have in common once per batch (ortq.worker.jobs).
@dataclass(frozen=True, slots=True, eq=False)
class KnownHeader:
    """A remembered request header: where the tensors of every frame with it lie."""

    data_start: int
    data_end: int  # the data section's bytes its tensors need
    tensors: tuple[tuple[str, np.dtype[Any], int, int, tuple[int, ...]], ...]  # name, dtype, count, offset, shape
    traced: bool = False  # its options hold a traceparent before the nonce
    #: An untraced header's key in KNOWN: its frames' bytes up to the nonce (b"" for a traced one).
    key: bytes = b""

    def inputs(self, frame: bytes | bytearray) -> dict[str, np.ndarray]:
        """The tensors of ``frame`` (one known_frame found with this header): zero-copy views."""
        data = memoryview(frame)[self.data_start :]
        return {
            name: np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
            for name, dtype, count, offset, shape in self.tensors
        }

    def joined(self, frames: Sequence[bytes | bytearray]) -> dict[str, np.ndarray]:
        """The tensors of ``frames`` (each found with this header, whose tensors all have a first
        dimension) joined along it, as np.concatenate of their ``inputs`` would: one copy of the
        bytes, and no array per frame for tensors under GIL_FREE_COPY bytes."""
        joined = {}
        for name, dtype, count, offset, shape in self.tensors:
            start = self.data_start + offset
            end = start + count * dtype.itemsize
            shape_joined = (len(frames) * shape[0], *shape[1:])
            if end - start < GIL_FREE_COPY:
                data = b"".join([memoryview(frame)[start:end] for frame in frames])
                joined[name] = np.frombuffer(data, dtype=dtype).reshape(shape_joined)
            else:
                views = [np.frombuffer(frame, dtype=dtype, count=count, offset=start) for frame in frames]
                joined[name] = np.concatenate(views).reshape(shape_joined)
        return joined


def known_frame(frame: object, max_bytes: int, last: KnownHeader | None = None) -> tuple[KnownHeader, bytes] | None:
    """The remembered header of ``frame`` and its nonce, or None (for the full checks) when its
    header is not one or anything else is off. ``last``: the header the frame before it had (a
    batch's frames mostly share one), tried first: a frame that starts with its key's bytes is
    found with it, as it would be in KNOWN, without the key's slice and hash."""
    if not isinstance(frame, bytes | bytearray) or len(frame) > max_bytes:
        return None
    if last is not None and last.key and frame.startswith(last.key) and last.data_start + last.data_end <= len(frame):
        # Its key holds the header's length (bytes 4 to 8): the header ends where the key's does, plus the nonce.
        return last, bytes(frame[len(last.key) : len(last.key) + NONCE_TAIL])
    end = PREFIX.size + int.from_bytes(frame[4:8], "little")
    known = KNOWN.get(bytes(frame[: end - NONCE_TAIL]))
    # A traced producer's header; its traceparent must be ASCII (what the full decode takes from any
    # other UTF-8 is left to it: the same outcome either way).
    if (
        known is None
        and frame[end - NONCE_TAIL - len(NONCE_ENTRY) : end - NONCE_TAIL] == NONCE_ENTRY
        and frame[end - TRACED_TAIL : end - TRACED_TAIL + TRACEPARENT_CHARS].isascii()
    ):
        known = KNOWN.get(bytes(frame[: end - TRACED_TAIL]) + TRACED)
    if known is None or known.data_start + known.data_end > len(frame):
        return None
    return known, bytes(frame[end - NONCE_TAIL : end])


def known_request(frame: object, max_bytes: int) -> Request | None:
    """``frame`` decoded through a remembered header, or None (for the full checks)."""
    if not isinstance(frame, bytes | bytearray) or (found := known_frame(frame, max_bytes)) is None:
        return None
    known, nonce = found
    if not known.traced:
        return Request(known.inputs(frame), {"nonce": nonce})
    end = PREFIX.size + int.from_bytes(frame[4:8], "little")
    traceparent = bytes(frame[end - TRACED_TAIL : end - TRACED_TAIL + TRACEPARENT_CHARS]).decode("ascii")
    return Request(known.inputs(frame), {"traceparent": traceparent, "nonce": nonce})


def learn(frame: object, header: dict[str, Any], data: memoryview) -> KnownHeader | None:
    """Remember the checked request ``header`` of ``frame`` when its last bytes are its nonce and
    nothing else varies: the options are only the nonce, and msgpack writes the header back to
    the same bytes (so the nonce's 16 bytes are the last, and no other encoding of a value hides
    behind the same key). Returns what it remembered, None when it may not."""
    if not isinstance(frame, bytes | bytearray) or list(header)[-1] != "options":
        return None
    options = header["options"]
    traced = list(options) == ["traceparent", "nonce"]
    if not traced and options.keys() != {"nonce"}:
        return None
    nonce = options["nonce"]
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_TAIL:
        return None
    if traced and not (isinstance(options["traceparent"], str) and len(options["traceparent"]) == TRACEPARENT_CHARS):
        return None
    end = PREFIX.size + int.from_bytes(frame[4:8], "little")
    if end > MAX_HEADER or msgpack.packb(header, use_bin_type=True) != frame[PREFIX.size : end]:
        return None
    descriptors = header["inputs"]
    tensors = tuple(
        (name, WIRE_DTYPES[d["dtype"]], prod(d["shape"]), d["offset"], tuple(d["shape"]))
        for name, d in descriptors.items()
    )
    if len(KNOWN) >= 64:  # forged headers vary at will: the cache stays small
        KNOWN.clear()
    data_end = max((d["offset"] + d["nbytes"] for d in descriptors.values()), default=0)
    key = bytes(frame[: end - TRACED_TAIL]) + TRACED if traced else bytes(frame[: end - NONCE_TAIL])
    known = KNOWN[key] = KnownHeader(len(frame) - len(data), data_end, tensors, traced, b"" if traced else key)
    return known


#: Ends the key of a traced header, so that it cannot be taken for an untraced one's.
TRACED = b"\x00traced"

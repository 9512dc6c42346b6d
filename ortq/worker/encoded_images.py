"""Inputs that carry an encoded image (a JPEG's or PNG's bytes as a uint8 vector), once a custom-op
library is loaded (ortq.worker.custom_ops): which inputs they are, the warm-up image they get, and
the check each job's bytes pass before the run.

The check is there because onnxruntime-extensions 0.15.2's ``DecodeImage`` does not fail on every
bad JPEG: with libjpeg's default error handler, bytes that are no JPEG ("Not a JPEG file"), a
marker where none may be ("Unsupported marker type"), a cut header ("Improper call to JPEG library")
end the whole process with status 1, and a JPEG cut inside its image data (no end marker) makes it
loop forever (measured: docs/wire-format.md, "Encoded images"). So a JPEG's structure is walked here
first, as libjpeg will read it, and a job whose bytes would stop the worker fails alone with
``InvalidInput``. It is a check of the structure libjpeg stops on, not a decoder: a crafted header
could still find a fatal error it does not model; a job that ends workers is failed ``WorkerLost``
after its second recovery (ortq.worker.upkeep.MAX_RECOVERIES). PNG errors are raised by the decoder
itself as run errors, so a PNG is only checked for its signature.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from ortq.errors import InvalidInput

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: The most pixels an image may declare (Pillow's own limit against decompression bombs): a 30 KB
#: JPEG can declare 65,500 x 65,500, whose decoding would allocate 12 GB.
MAX_PIXELS = 89_478_485
#: The side of the warm-up image (what image classifiers take, so that a model that needs that size
#: after decoding warms up too).
WARMUP_IMAGE_SIDE = 224

_SOF = {0xC0, 0xC1, 0xC2}  # baseline, extended sequential, progressive (Huffman); libjpeg stops on the rest
_DHT, _SOS, _DQT, _DRI, _EOI = 0xC4, 0xDA, 0xDB, 0xDD, 0xD9
_SKIPPED = {0xFE, *range(0xE0, 0xF0)}  # COM and APPn: read past by their length
_KNOWN = {*_SOF, _DHT, _SOS, _DQT, _DRI, *_SKIPPED}  # what may follow a segment, besides EOI
_IN_SCAN = {0x00, *range(0xD0, 0xD8)}  # after 0xFF inside image data: a stuffed 0xFF, or a restart marker


def takes_encoded_bytes(dtype: str, shape: tuple[object, ...]) -> bool:
    """Whether an input of this signature carries an encoded file: a uint8 vector of any length."""
    return dtype == "uint8" and len(shape) == 1 and not (isinstance(shape[0], int) and shape[0] >= 0)


def check_encoded_image(name: str, value: np.ndarray) -> None:
    """Raise InvalidInput unless ``value`` is a PNG or a JPEG whose structure libjpeg reads without
    stopping the process (see the module's docstring)."""
    if value.ndim != 1 or value.dtype != np.uint8:  # an input of no declared shape takes any rank
        raise InvalidInput(
            f"input {name!r} carries an encoded image: a file's bytes as a 1-D uint8 tensor, "
            f"not {value.dtype.name}{list(value.shape)}"
        )
    data = value.tobytes()
    if data.startswith(PNG_SIGNATURE):
        return
    if not data.startswith(b"\xff\xd8"):
        raise InvalidInput(f"input {name!r}: {len(data)} bytes that are neither a JPEG nor a PNG file")
    try:
        _walk_jpeg(data)
    except (IndexError, struct.error):
        raise InvalidInput(f"input {name!r}: the JPEG ends inside a marker segment") from None
    except ValueError as exc:
        raise InvalidInput(f"input {name!r}: not a JPEG the decoder can read safely: {exc}") from None


def _walk_jpeg(data: bytes) -> None:
    """Follow the markers from after SOI to EOI; ValueError (or IndexError past the end) says why not."""
    read, pos = _JpegSoFar(), 2
    while True:
        marker, pos = _marker_at(data, pos)
        if marker == _EOI:
            if not read.scans:
                raise ValueError("no image data before its end marker")
            return
        if marker not in _KNOWN:
            raise ValueError(f"marker 0xff{marker:02x} at byte {pos - 2}, which the decoder does not support")
        body, pos = _segment_at(data, pos, marker)
        pos = read.segment(marker, body, data, pos)


def _marker_at(data: bytes, pos: int) -> tuple[int, int]:
    """The marker at ``pos`` (past its fill bytes) and the position after it; ValueError where no
    marker begins."""
    if data[pos] != 0xFF:
        raise ValueError(f"byte {pos}: expected a marker, found 0x{data[pos]:02x}")
    while data[pos] == 0xFF:  # fill bytes before a marker
        pos += 1
    return data[pos], pos + 1


def _segment_at(data: bytes, pos: int, marker: int) -> tuple[bytes, int]:
    """The body of ``marker``'s segment, whose length field is at ``pos``, and the position after
    it; ValueError for a length shorter than its field or longer than the bytes left."""
    (length,) = struct.unpack_from(">H", data, pos)
    body = data[pos + 2 : pos + length]
    if length < 2 or len(body) != length - 2:
        raise ValueError(f"marker 0xff{marker:02x} at byte {pos - 2} has a bad length")
    return body, pos + length


@dataclass
class _JpegSoFar:
    """What a walk has read of a JPEG that its later segments are checked against."""

    frame: dict[int, int] | None = None  # each component's quantization table, from the frame header
    progressive: bool = False
    scans: int = 0
    quantization: set[int] = field(default_factory=set)
    # libjpeg-turbo's standard tables, where a JPEG defines none
    huffman: set[tuple[int, int]] = field(default_factory=lambda: {(0, 0), (0, 1), (1, 0), (1, 1)})

    def segment(self, marker: int, body: bytes, data: bytes, end: int) -> int:
        """Check the segment of ``marker`` whose ``body`` ends at ``end`` and take in what it
        defines; returns where the next marker is (after a scan's image data, for SOS)."""
        if marker in _SOF:
            if self.frame is not None:
                raise ValueError("two frame headers")
            self.frame, self.progressive = _frame(body, marker), marker == 0xC2
        elif marker == _DQT:
            self.quantization |= _quantization_tables(body)
        elif marker == _DHT:
            self.huffman |= _huffman_tables(body)
        elif marker == _DRI:
            if len(body) != 2:  # a length of 4, its own two bytes included
                raise ValueError("a restart interval of the wrong length")
        elif marker == _SOS:
            if self.frame is None:
                raise ValueError("image data before the frame header")
            _scan_header(body, self.frame, self.quantization, self.huffman, self.progressive)
            self.scans += 1
            return _end_of_scan(data, end)
        return end


def _frame(body: bytes, marker: int) -> dict[int, int]:
    """SOF: 8-bit samples, a non-empty size within MAX_PIXELS, 1-4 components with sampling factors
    1-4; returns each component's quantization table."""
    precision, height, width, count = struct.unpack_from(">BHHB", body)
    if precision != 8 or not 1 <= count <= 4 or len(body) != 6 + 3 * count:
        raise ValueError(f"frame header 0xff{marker:02x}: {precision}-bit, {count} components")
    if height == 0 or width == 0 or height * width > MAX_PIXELS:
        raise ValueError(f"an image of {width} x {height} pixels (at most {MAX_PIXELS:,} are decoded)")
    tables, sampling = {}, []
    for at in range(6, 6 + 3 * count, 3):
        component, factors, table = body[at : at + 3]
        if not (1 <= factors >> 4 <= 4 and 1 <= factors & 15 <= 4) or table > 3 or component in tables:
            raise ValueError(f"frame header: component {component} is malformed")
        tables[component] = table
        sampling.append((factors >> 4, factors & 15))
    # libjpeg upsamples each component by a whole factor ("Fractional sampling not implemented yet"),
    # and an MCU holds at most 10 blocks.
    most = (max(h for h, _ in sampling), max(v for _, v in sampling))
    if any(most[0] % h or most[1] % v for h, v in sampling) or (count > 1 and sum(h * v for h, v in sampling) > 10):
        raise ValueError(f"sampling factors {sampling} the decoder cannot upsample")
    return tables


def _quantization_tables(body: bytes) -> set[int]:
    """A DQT segment's table indices (each 0-3, of 64 8- or 16-bit entries), checked to fill it exactly."""
    found, at = set(), 0
    while at < len(body):
        precision, index = body[at] >> 4, body[at] & 15
        if precision > 1 or index > 3:
            raise ValueError(f"a quantization table of precision {precision}, index {index}")
        found.add(index)
        at += 1 + 64 * (1 + precision)
    if at != len(body):
        raise ValueError("a quantization table segment of the wrong length")
    return found


def _huffman_tables(body: bytes) -> set[tuple[int, int]]:
    """A DHT segment's (class, index) tables, each checked as libjpeg checks them: class 0 (DC) or 1
    (AC), index 0-3, at most 256 symbols, codes that fit their lengths, DC symbols at most 15."""
    found: set[tuple[int, int]] = set()
    at = 0
    while at < len(body):
        kind, index = body[at] >> 4, body[at] & 15
        counts = body[at + 1 : at + 17]
        symbols = body[at + 17 : at + 17 + sum(counts)]
        if kind > 1 or index > 3 or len(counts) != 16 or len(symbols) != sum(counts) or sum(counts) > 256:
            raise ValueError(f"a malformed Huffman table (class {kind}, index {index})")
        code = 0
        for bits, count in enumerate(counts, 1):
            code += count
            if code > 1 << bits:
                raise ValueError(f"a Huffman table whose codes do not fit (class {kind}, index {index})")
            code <<= 1
        if kind == 0 and any(symbol > 15 for symbol in symbols):
            raise ValueError(f"a DC Huffman table with a symbol above 15 (index {index})")
        found.add((kind, index))
        at += 17 + len(symbols)
    return found


def _scan_header(
    body: bytes, frame: dict[int, int], quantization: set[int], huffman: set[tuple[int, int]], progressive: bool
) -> None:
    """SOS: 1-4 of the frame's components, tables that were defined, and a progressive scan's
    parameters as libjpeg requires them ("Invalid progressive parameters")."""
    count = body[0]
    if not 1 <= count <= 4 or len(body) != 4 + 2 * count:
        raise ValueError(f"a scan header of {count} components")
    for at in range(1, 1 + 2 * count, 2):
        component, selectors = body[at], body[at + 1]
        if component not in frame or frame[component] not in quantization:
            raise ValueError(f"a scan of component {component}, not in the frame or without its quantization table")
        if (0, selectors >> 4) not in huffman or (1, selectors & 15) not in huffman:
            raise ValueError(f"a scan of component {component} with an undefined Huffman table")
    start, end, approximation = body[-3:]
    high, low = approximation >> 4, approximation & 15
    if progressive and (
        (end != 0 if start == 0 else end < start or end > 63 or count != 1) or (high and low != high - 1) or low > 13
    ):
        raise ValueError(f"progressive parameters Ss={start} Se={end} Ah={high} Al={low}")


def _end_of_scan(data: bytes, pos: int) -> int:
    """The position of the marker that ends the image data starting at ``pos``; ValueError when the
    data ends first (the decoder would wait for more forever)."""
    while True:
        pos = data.find(b"\xff", pos)
        if pos < 0 or pos + 1 >= len(data):
            raise ValueError("the image data is cut off before the JPEG's end marker")
        following = data[pos + 1]
        if following in _IN_SCAN or following == 0xFF:
            pos += 1 if following == 0xFF else 2
            continue
        return pos


@cache
def warmup_image() -> np.ndarray:
    """A small valid PNG (a 224x224 RGB gradient) as a read-only uint8 vector: the warm-up and canary
    input of an encoded-image input, where zeros would fail the decoder. Made here, without an
    imaging library."""
    side = WARMUP_IMAGE_SIDE
    ramp = np.linspace(0, 255, side, dtype=np.uint8)
    pixels = np.stack(np.broadcast_arrays(ramp[None, :], ramp[:, None], ramp[::-1][None, :]), axis=-1)
    # PNG's "Up" filter (2): each row as its difference from the row above, which for these ramps is
    # almost all zeros and so compresses to ~1.4 KB (unfiltered, zlib leaves it at ~140 KB).
    flat = pixels.reshape(side, side * 3).astype(np.int16)
    up = np.diff(flat, axis=0, prepend=np.zeros((1, side * 3), np.int16)) % 256
    rows = np.concatenate([np.full((side, 1), 2, np.uint8), up.astype(np.uint8)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    png = PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows.tobytes())) + chunk(b"IEND", b"")
    image = np.frombuffer(png, dtype=np.uint8)
    image.flags.writeable = False
    return image

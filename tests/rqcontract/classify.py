"""Turn raw Redis values, TTLs and scores into comparable classes.

Two workers never write the same bytes (timestamps, pids, random execution ids), but a
worker that writes what RQ writes gives every field the same *class*: an RQ-format UTC
timestamp where RQ has one, an epoch float where RQ has one, the same small literal
(``finished``), the same integer (``result_ttl``), the same placeholder (``<job>``), the
same msgpack structure. A class is a :class:`Value`: a kind and, where the exact content
is part of the contract, a detail.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

# RQ's utcformat(): '%Y-%m-%dT%H:%M:%S.%fZ', always six fractional digits.
_RQ_ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
# Anything else that looks like an ISO date: a format RQ would not parse the same way.
_OTHER_ISO = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d.*")
_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?|-?inf|nan")
_LITERAL = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")
# Seconds since 1970 between 2001 and 2286; in milliseconds for stream ids and the like.
_EPOCH = (1e9, 1e10)
_EPOCH_MS = (1e12, 1e13)
# Fields whose content differs between any two runs by nature, not by contract.
VOLATILE_FIELDS = frozenset({"pid", "ip_address"})
# Results stream fields (rq.results.Result.serialize): base64 of the serializer's bytes, and
# base64 of zlib-compressed text.
_BASE64_FIELDS = frozenset({"return_value", "exc_string"})
# A duration named by the caller matches an observed one within this many seconds.
DURATION_TOLERANCE = 10
_TEXT_DETAIL_LIMIT = 160


@dataclass(frozen=True)
class Value:
    """One classified value: ``kind`` always compared, ``detail`` when it is not None."""

    kind: str
    detail: str | None = None

    def __str__(self) -> str:
        return self.kind if self.detail is None else f"{self.kind}({self.detail})"

    @classmethod
    def parse(cls, text: str) -> Value:
        """Inverse of ``str()``, for snapshots read back from JSON."""
        kind, paren, rest = text.partition("(")
        return cls(kind, rest[:-1] if paren else None)


class Identifiers:
    """Replaces identifiers (job ids, worker and queue names...) with placeholders, longest first."""

    def __init__(self, ids: Mapping[str, str]) -> None:
        if any(not identifier for identifier in ids):
            raise ValueError("an identifier must not be empty")
        self.ids = dict(ids)
        self._ordered = sorted(self.ids, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(i) for i in self._ordered)) if self._ordered else None

    def with_more(self, more: Mapping[str, str]) -> Identifiers:
        return Identifiers({**self.ids, **more})

    def mentioned_in(self, text: str) -> bool:
        return self._pattern is not None and self._pattern.search(text) is not None

    def replace(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: self.ids[m.group(0)], text)


def _decode(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def normalize_structure(obj: Any, ids: Identifiers) -> Any:
    """A decoded msgpack/JSON value with identifiers replaced and run-dependent numbers hidden."""
    if isinstance(obj, str):
        return ids.replace(obj)
    if isinstance(obj, bytes):
        return f"<{len(obj)} bytes>"
    if isinstance(obj, bool) or obj is None:
        return obj
    if isinstance(obj, int):
        return "<epoch>" if _EPOCH[0] <= abs(obj) < _EPOCH[1] else obj
    if isinstance(obj, float):
        return "<float>"
    if isinstance(obj, list | tuple):
        return [normalize_structure(item, ids) for item in obj]
    if isinstance(obj, dict):
        return {str(normalize_structure(k, ids)): normalize_structure(v, ids) for k, v in sorted(obj.items(), key=str)}
    return f"<{type(obj).__name__}>"


def _structure_detail(obj: Any, ids: Identifiers) -> str:
    return json.dumps(normalize_structure(obj, ids), sort_keys=True, separators=(",", ":"))


def _classify_text(text: str, ids: Identifiers) -> Value:
    if text in ids.ids:
        return Value("placeholder", ids.ids[text])
    if _RQ_ISO.fullmatch(text):
        return Value("iso-utc")
    if _OTHER_ISO.fullmatch(text):
        return Value("iso-other", re.sub(r"\d", "9", text))
    if (number := _number_value(text)) is not None:
        return number
    if text[:1] in "[{":
        try:
            return Value("json", _structure_detail(json.loads(text), ids))
        except ValueError:
            pass
    if _LITERAL.fullmatch(text):
        return Value("literal", text)
    if text.startswith("Traceback (most recent call last):"):
        return Value("traceback")
    normalized = ids.replace(text)
    if len(normalized) > _TEXT_DETAIL_LIMIT:
        return Value("text", f"{len(normalized)} chars")
    return Value("text", normalized)


def _number_value(text: str) -> Value | None:
    """The class of an integer or a float written as text, a time since the epoch (in seconds, or
    an integer's milliseconds) told apart; None for text that is no number."""
    if _INT.fullmatch(text):
        number = int(text)
        if _EPOCH[0] <= abs(number) < _EPOCH[1]:
            return Value("epoch-int")
        if _EPOCH_MS[0] <= abs(number) < _EPOCH_MS[1]:
            return Value("epoch-ms-int")
        return Value("int", text)
    if _FLOAT.fullmatch(text):
        number_f = float(text)
        if math.isfinite(number_f) and _EPOCH[0] <= abs(number_f) < _EPOCH[1]:
            return Value("epoch-float")
        return Value("float")
    return None


def _classify_binary(raw: bytes, ids: Identifiers) -> Value:
    try:
        inner = zlib.decompress(raw)
    except zlib.error:
        pass
    else:
        return Value("zlib", str(classify(inner, ids)))
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException):
        return Value("binary", f"{len(raw)} bytes")
    return Value("msgpack", _structure_detail(obj, ids))


def classify(raw: bytes, ids: Identifiers, field: str | None = None, *, stream: bool = False) -> Value:
    """The class of one stored value; ``field`` names the hash or stream field it came from."""
    if raw == b"":
        return Value("empty")
    if field in VOLATILE_FIELDS:
        return Value("volatile")
    if stream and field in _BASE64_FIELDS:
        try:
            decoded = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            return Value("not-base64", str(classify(raw, ids)))
        return Value("base64", str(classify(decoded, ids)))
    text = _decode(raw)
    if text is not None and all(c.isprintable() or c in "\t\n\r" for c in text):
        return _classify_text(text, ids)
    return _classify_binary(raw, ids)


def _bucket(seconds: float) -> str:
    if seconds <= 60:
        return "<=60s"
    if seconds <= 3600:
        return "minutes"
    if seconds <= 86400:
        return "hours"
    return "days"


def duration_class(seconds: float, durations: Mapping[str, int]) -> str:
    """A duration by the caller's name for it (``result_ttl``) when one matches, else a rough bucket."""
    for name, expected in durations.items():
        if abs(seconds - expected) <= DURATION_TOLERANCE:
            return name
    return _bucket(seconds)


def ttl_class(ttl: int, durations: Mapping[str, int]) -> str:
    """Redis TTL (seconds; -1 when the key never expires)."""
    if ttl < 0:
        return "none"
    return duration_class(ttl, durations)


def score_class(score: float, now: float, durations: Mapping[str, int]) -> str:
    """A sorted-set score: timestamps relative to ``now`` (``now+result_ttl``, ``past``), others as is."""
    if math.isinf(score):
        return "+inf" if score > 0 else "-inf"
    if _EPOCH_MS[0] <= abs(score) < _EPOCH_MS[1]:
        return "ms-" + score_class(score / 1000, now, durations)
    if not _EPOCH[0] <= abs(score) < _EPOCH[1]:
        return f"score={score:g}"
    offset = score - now
    if abs(offset) <= 5:
        return "now"
    if offset < 0:
        return "now-" + duration_class(-offset, durations)
    return "now+" + duration_class(offset, durations)

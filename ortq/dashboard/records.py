"""Reading what RQ keeps in Redis as hostile input, for the dashboard's pages.

RQ's readers raise on the first field they cannot parse (a fractional ``timeout``, a date that is
not one, a status RQ does not know, bytes that are not UTF-8, a key of another type), and inflate
zlib data without a limit. The dashboard's pages must show what they can read of such a record and
say what they cannot, not answer 500 or run out of memory: these helpers bound and decode the raw
values, and :class:`~ortq.dashboard.rqdash.DashboardJob` and ``DashboardWorker`` use them.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Callable, Mapping
from datetime import datetime

#: Largest field value (bytes) a page shows; a longer one is dropped, with a note saying so.
MAX_FIELD_BYTES = 64 * 1024
#: Largest exception text (after inflating) a page shows; a traceback is a few kB.
MAX_TEXT_BYTES = 64 * 1024
#: A job hash has ~30 fields; one with more is read field by field (the usual ones only).
MAX_FIELDS = 256
#: The fields of a job hash the pages use, read alone when a hash has more than MAX_FIELDS.
JOB_FIELDS = (
    "data", "status", "origin", "description", "created_at", "enqueued_at", "started_at", "ended_at",
    "meta", "exc_info", "dependency_ids", "worker_name",
)  # fmt: skip


class TooLarge(ValueError):
    """A value that inflates past its limit (a zlib bomb?)."""


def describe(exc: BaseException) -> str:
    """An exception as one short line for a page: ``Type: message``."""
    return clip(f"{type(exc).__name__}: {exc}", 300)


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def shown(value: bytes | str) -> str:
    """A raw value as a page may quote it in a note: its start, as Python writes bytes."""
    return clip(repr(value), 80)


def inflate(raw: bytes, limit: int) -> bytes | None:
    """``raw`` inflated, or None when it is not zlib data; TooLarge past ``limit`` bytes."""
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(raw, limit)
    except zlib.error:
        return None
    if inflater.eof:
        return data
    if inflater.unconsumed_tail:
        raise TooLarge(f"inflates past {limit} bytes")
    return None  # a truncated stream: not what RQ wrote


def exception_text(raw: bytes | None) -> str:
    """An exception string as RQ stores it: base64 of zlib (result stream), zlib (the job hash's
    ``exc_info``) or plain text; at most MAX_TEXT_BYTES of it, whatever ``raw`` holds."""
    if not raw:
        return ""
    try:
        candidates = [base64.b64decode(raw, validate=True), raw]
    except (binascii.Error, ValueError):
        candidates = [raw]
    for candidate in candidates:
        try:
            inflated = inflate(candidate, MAX_TEXT_BYTES)
        except TooLarge:
            return f"(an exception text that inflates past {MAX_TEXT_BYTES} bytes: not shown)"
        if inflated is not None:
            return inflated.decode(errors="replace")
    return clip(raw[:MAX_TEXT_BYTES].decode(errors="replace"), MAX_TEXT_BYTES)


def text(raw: bytes | str | None) -> str | None:
    """A field as text, whatever its bytes (undecodable ones replaced)."""
    if raw is None:
        return None
    return raw if isinstance(raw, str) else raw.decode(errors="replace")


def rq_time(raw: bytes | str | None) -> datetime | None:
    """A timestamp RQ wrote (ISO 8601), or None when there is none or it is not one."""
    try:
        return datetime.fromisoformat(text(raw) or "") if raw else None
    except ValueError:
        return None


def integer(raw: bytes | str | None) -> int | None:
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def bounded_fields(fields: Mapping[bytes, bytes], notes: list[str]) -> dict[bytes, bytes]:
    """A job hash with every value a page cannot afford to read taken out (each with a note):
    values over MAX_FIELD_BYTES, and ``data`` that inflates past it. ``exc_info`` is taken out too
    (RQ would inflate it without a limit): :func:`exception_text` reads it instead."""
    kept = {}
    for name, value in fields.items():
        if not isinstance(name, bytes) or not isinstance(value, bytes):
            notes.append(f"field {name!r} is not a plain value")
        elif len(value) > MAX_FIELD_BYTES:
            notes.append(f"{text(name)} is {len(value)} bytes, more than a page shows ({MAX_FIELD_BYTES}); left out")
        elif name == b"data":
            kept[name] = _bounded_data(value, notes)
        elif name != b"exc_info":
            kept[name] = value
    return kept


def _bounded_data(raw: bytes, notes: list[str]) -> bytes:
    """The job's ``data`` inflated once; b"" (with a note) when it inflates too far or twice: RQ
    would inflate what it gets once more, without a limit."""
    try:
        data = inflate(raw, MAX_FIELD_BYTES)
        if data is None:
            return raw
        if inflate(data, MAX_FIELD_BYTES) is None:
            return data
        notes.append("data is compressed twice; RQ writes it once: left out")
    except TooLarge as exc:
        notes.append(f"data {exc}; left out")
    return b""


def unreadable_fields(restores: Callable[[dict[bytes, bytes]], bool], fields: dict[bytes, bytes]) -> list[bytes]:
    """The names of the fields that stop RQ from reading a job hash: each one that ``restores``
    (RQ's reader, on ``data`` plus that field alone) refuses, so that the others can still be shown."""
    base = {b"data": fields.get(b"data", b"")}
    return [name for name in fields if name != b"data" and not restores({**base, name: fields[name]})]

"""What a producer knows of its answers on one Redis (wire protocol 4, docs/wire-format.md section
4.1): its reply streams (one a model, named by the producer's reply name), how far each has been
read, and the answers read for jobs nobody waits for yet, with no I/O of its own.

One wait at a time reads the streams (``begin_read``/``end_read``): its XREAD names every stream
of the producer, so whatever any other wait of the producer waits for comes back with it. A stream
added since it began (a model's first job) cuts it short (AsyncProducer: no read of its own begins
until the cut one has ended) or gets a read of its own beside it (Producer). The other waits wait
(``wait_change``) until a read brings one of their answers, or until the reader may be done (the
longest waiting one is woken at each read's end, to read next), and take their answers from the
book. Answers are kept for the producer's recent jobs
only (:data:`RECENT_JOBS`, :data:`KEPT_BYTES`): a job that dropped out of them, or another
producer's job, is found through its job hash instead (``ortq_answer``: the entry its answer is,
``waiting``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ortq import keys
from ortq.errors import OrtqError

#: How many of its own latest jobs a producer keeps answers for when a read brings them before
#: anyone waits for them (a submit's handle waited on later). Older ones are looked up.
RECENT_JOBS = 100_000
#: The most bytes of such answers kept; past it the oldest go (and are looked up when waited for).
KEPT_BYTES = 64 << 20
#: The most entries one XREAD returns from each stream.
READ_COUNT = 1000

#: An entry id below every other: a stream is read from its start.
START = b"0-0"


class ReplyBook:
    """One producer's reply streams on one Redis, named ``name`` (keys.new_reply_name)."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: Bumped whenever a read ends: a wait that saw an older one has something new to look at.
        self.generation = 0
        self._cursors: dict[str, bytes] = {}  # stream key -> the last entry id read
        self._models: dict[str, str] = {}  # stream key -> its model
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._kept: OrderedDict[str, bytes] = OrderedDict()  # job id -> its frame (b"": a large one)
        self._kept_bytes = 0
        #: Why a stream could not be read at the last read of it (a key that is no stream), and the
        #: generation that read ended in: a wait that began before it fails for it.
        self.broken: dict[str, tuple[OrtqError, int]] = {}
        self._covered: set[str] = set()  # the streams reads in flight name
        self._cuts: list[Callable[[], object]] = []  # what cuts each (cuttable) read in flight short
        #: The cuts called whose reads have not ended yet: each re-reads every stream (or, done,
        #: wakes the longest waiting wait to), so no read of its own is begun beside them.
        self._cut: list[Callable[[], object]] = []
        self._lock = threading.Lock()
        self._waiters: list[_Waiter] = []  # oldest first
        #: Why its waits end at once (the producer was closed), or None.
        self.closed: str | None = None
        self._by_id: dict[str, list[_Waiter]] = {}

    def stream(self, model: str) -> str:
        """The key of this producer's reply stream of ``model``."""
        return keys.reply_key(model, self.name)

    # ------------------------------------------------------------------ jobs

    def expect(self, model: str, job_ids: Iterable[str]) -> None:
        """Jobs of ``model`` about to be enqueued with this book's name: their answers are kept when
        a read brings them (called before the enqueue is sent: an answer may come before it returns)."""
        with self._lock:
            stream = self.stream(model)
            if stream not in self._cursors:
                self._cursors[stream] = START
                for cut in self._cuts:  # reads in flight do not name it: read it with the others
                    cut()
                self._cut += self._cuts
                self._cuts = []
            self._models[stream] = model
            for job_id in job_ids:
                self._recent[job_id] = None
            while len(self._recent) > RECENT_JOBS:
                self._drop(next(iter(self._recent)))

    def forget(self, job_ids: Iterable[str]) -> None:
        """Jobs whose answers will not come through this book (a unique submit found them enqueued
        by someone else): a wait for them looks them up."""
        with self._lock:
            for job_id in job_ids:
                self._drop(job_id)

    def is_recent(self, job_id: str) -> bool:
        """Whether ``job_id``'s answer comes through this book without a look-up."""
        return job_id in self._recent

    def take(self, job_ids: Iterable[str]) -> dict[str, bytes]:
        """The answers read for ``job_ids`` so far (each handed out once): job id -> its frame."""
        found: dict[str, bytes] = {}
        with self._lock:
            for job_id in job_ids:
                frame = self._kept.pop(job_id, None)
                if frame is not None:
                    self._kept_bytes -= len(frame)
                    self._recent.pop(job_id, None)
                    found[job_id] = frame
        return found

    def _drop(self, job_id: str) -> None:
        self._recent.pop(job_id, None)
        frame = self._kept.pop(job_id, None)
        if frame is not None:
            self._kept_bytes -= len(frame)

    # ------------------------------------------------------------------ reading

    def begin_read(self) -> dict[str, bytes] | None:
        """XREAD's streams argument: every stream of this book that no read in flight names, from
        where it was last read; None when reads in flight name them all (wait for them instead).
        Mostly one read is in flight; a stream new since it began (a model's first job) gets a read
        of its own rather than wait behind it."""
        with self._lock:
            streams = {stream: at for stream, at in self._cursors.items() if stream not in self._covered}
            if not streams or self._cut:
                # A read of its own beside a cut one would race it for AsyncProducer's connections
                # (redis-py's pool lets a newcomer take a freed one first): it would wait behind
                # the cut read's next XREAD, which may not name the new stream.
                return None
            self._covered.update(streams)
            return streams

    def end_read(
        self,
        streams: Iterable[str],
        entries: Iterable[tuple[str, bytes, bytes | None, bytes | None]] = (),
        ok: bool = False,
    ) -> None:
        """The read of ``streams`` begun ends (``ok``: Redis answered it), with the (stream, entry
        id, job id, frame) it brought: answers of recent jobs are kept, each stream's cursor moves
        past what was read."""
        delivered = []
        with self._lock:
            self._covered.difference_update(streams)
            if ok:
                for stream in streams:
                    self.broken.pop(stream, None)
            for stream, entry_id, job_id, frame in entries:
                if stream in self._cursors:
                    self._cursors[stream] = entry_id
                if job_id is None or frame is None:
                    continue
                text = keys.as_text(job_id)
                if text in self._recent and text not in self._kept:
                    self._kept[text] = frame
                    self._kept_bytes += len(frame)
                    delivered.append(text)
            while self._kept_bytes > KEPT_BYTES and self._kept:
                self._drop(next(iter(self._kept)))
            self._bump(delivered)

    def add_cut(self, cut: Callable[[], object]) -> None:
        """``cut`` ends a read in flight early: called when a stream is added (steps.Read)."""
        with self._lock:
            self._cuts.append(cut)

    def remove_cut(self, cut: Callable[[], object]) -> None:
        with self._lock:
            if cut in self._cut:
                self._cut.remove(cut)
            else:
                self._cuts.remove(cut)

    def restart(self) -> None:
        """Redis was unreachable: it may have restarted or failed over, and numbered new entries
        below the cursors; every stream is read again from its start (answers already handed out
        are not kept again)."""
        with self._lock:
            for stream in self._cursors:
                self._cursors[stream] = START

    def close(self, why: str) -> None:
        """End every wait at once: each raises BrokerUnavailable(``why``)."""
        with self._lock:
            self.closed = why
            for waiter in self._waiters:
                waiter.wake()

    def mark_broken(self, stream: str, error: OrtqError) -> None:
        """``stream`` is no stream (its waits so far fail) until a read names it again and succeeds."""
        with self._lock:
            self.broken[stream] = (error, self.generation + 1)  # the generation its read ends in

    def model_of(self, stream: str) -> str | None:
        return self._models.get(stream)

    # ------------------------------------------------------------------ waiting for a change

    def _bump(self, delivered: Iterable[str]) -> None:
        """A read ended: wake the waits it brought answers for, and the longest waiting other one
        (to read next, should the reader be done)."""
        self.generation += 1
        woken: list[_Waiter] = []
        for job_id in delivered:
            woken += self._by_id.get(job_id, ())
        if self._waiters:
            woken.append(self._waiters[0])
        for waiter in woken:
            waiter.wake()

    def _add(self, waiter: _Waiter) -> None:
        self._waiters.append(waiter)
        for job_id in waiter.ids:
            self._by_id.setdefault(job_id, []).append(waiter)

    def _remove(self, waiter: _Waiter) -> None:
        with self._lock:
            self._waiters.remove(waiter)
            for job_id in waiter.ids:
                others = self._by_id[job_id]
                others.remove(waiter)
                if not others:
                    del self._by_id[job_id]

    def wait_change(self, seen: int, seconds: float, job_ids: Sequence[str]) -> None:
        """Block until a read brings an answer for one of ``job_ids``, the reader may be done, or
        ``seconds`` pass; at once if a read ended since generation ``seen`` (Producer's waits)."""
        event = threading.Event()
        waiter = _Waiter(event.set, job_ids)
        with self._lock:
            if self.generation != seen:
                return
            self._add(waiter)
        try:
            event.wait(max(0.0, seconds))
        finally:
            self._remove(waiter)

    async def wait_change_async(self, seen: int, seconds: float, job_ids: Sequence[str]) -> None:
        """``wait_change`` for AsyncProducer's waits (one event loop: the book's changes are made in it)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(lambda: None if future.done() else future.set_result(None), job_ids)
        with self._lock:
            if self.generation != seen:
                return
            self._add(waiter)
        try:
            await asyncio.wait([future], timeout=max(0.0, seconds))
        finally:
            self._remove(waiter)


class _Waiter:
    __slots__ = ("ids", "wake")

    def __init__(self, wake: Callable[[], object], ids: Sequence[str]) -> None:
        self.wake = wake
        self.ids = ids


def entries_of(reply: Any) -> list[tuple[str, bytes, bytes | None, bytes | None]]:
    """(stream, entry id, job id, frame) of each entry in an XREAD reply (RESP2's ``[(stream,
    entries)]`` or RESP3's ``{stream: entries}``); a field missing is None."""
    out: list[tuple[str, bytes, bytes | None, bytes | None]] = []
    streams = [(k, unwrapped(v)) for k, v in reply.items()] if isinstance(reply, dict) else reply or []
    for stream, entries in streams:
        key = keys.as_text(stream)
        for entry in entries or []:
            try:
                entry_id, fields = entry[0], entry[1]
                job_id, frame = fields.get(keys.REPLY_ID_FIELD), fields.get(keys.REPLY_FRAME_FIELD)
            except (IndexError, KeyError, TypeError, AttributeError):
                continue
            if not isinstance(job_id, bytes):
                job_id = None
            if not isinstance(frame, bytes):
                frame = None
            out.append((key, entry_id if isinstance(entry_id, bytes) else str(entry_id).encode(), job_id, frame))
    return out


def unwrapped(entries: Any) -> Any:
    """A RESP3 XREAD reply's entries: redis-py wraps each stream's list of entries in one list more
    (``{stream: [[(id, fields), ...]]}``); an entry's first item is its id (bytes)."""
    if isinstance(entries, list) and len(entries) == 1 and isinstance(entries[0], list):
        inner = entries[0]
        if not inner or not isinstance(inner[0], bytes | str):
            return inner
    return entries


def entry_before(entry_id: bytes | str) -> str | None:
    """The id just below ``entry_id`` (``<ms>-<seq>``): XREAD from it returns that entry first; None
    for what is no entry id."""
    ms, _, seq = keys.as_text(entry_id).partition("-")
    if not (ms.isdigit() and seq.isdigit()):
        return None
    if int(seq) > 0:
        return f"{ms}-{int(seq) - 1}"
    if int(ms) == 0:
        return None
    return f"{int(ms) - 1}-18446744073709551615"

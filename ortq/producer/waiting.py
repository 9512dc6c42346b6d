"""How a producer waits for replies (wire protocol 4), as I/O-free steps (``steps``), for
``Producer`` and ``AsyncProducer`` alike: blocking XREADs of the producer's reply streams
(``replybook``), one wait reading at a time for all the others, through Redis outages until the
deadline. A job whose answer does not come through the producer's own streams (another producer's,
or one of its own older than the book keeps) is looked up in its job hash: ``ortq_answer`` names
its entry, read alone."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from ortq import keys, redisfaults, wire
from ortq.errors import BrokerUnavailable, CorruptRecord, ResultTimeout
from ortq.producer import responses
from ortq.producer.replybook import READ_COUNT, ReplyBook, entries_of, entry_before
from ortq.producer.steps import Await, Command, Pause, Read, Round, Steps

#: Seconds between look-ups of a job whose answer comes through another producer's stream: the
#: first soon, then doubling up to the last.
LOOK_AGAIN = (0.01, 0.5)


@dataclass(frozen=True)
class Wait:
    """One wait for the replies of some jobs: their ids, each one's model and proof (None: not
    checked), and its ``deadline`` (``time.monotonic()``), past which it raises ``late``'s words
    (None: how many had no result within ``timeout``, the seconds its caller gave) unless
    ``look_once``, which reads once even then."""

    job_ids: Sequence[str]
    models: Sequence[str]
    proofs: Sequence[bytes | None]
    deadline: float
    timeout: float
    late: str | None = None
    look_once: bool = False


def wait_for_responses(wait: Wait, *, book: ReplyBook, block: float, max_bytes: int) -> Steps[list[wire.Response]]:
    """The responses of ``wait``'s jobs, in order, each XREAD blocking at most ``block`` seconds, each
    frame at most ``max_bytes``."""
    state = _Waiting(wait, book, max_bytes)
    look_once = wait.look_once
    while True:
        if book.closed is not None:
            raise BrokerUnavailable(book.closed)
        seen = book.generation
        yield from state.collect()
        pending = state.pending()
        if not pending:
            return [state.found[job_id] for job_id in wait.job_ids]
        state.check_streams(pending)
        now = time.monotonic()
        remaining = wait.deadline - now
        if remaining <= 0 and not look_once:
            late = wait.late or f"{len(pending)} of {len(wait.job_ids)} jobs had no result within {wait.timeout:g} s"
            raise state.outage.error(late)
        if (yield from state.look_up(now)):
            continue
        look_once = False
        next_look = min(state.looks.values(), default=wait.deadline) - now
        yield from state.read(seen, max(0.001, min(remaining, block, next_look)), pending)


class _Waiting:
    """What one wait has found so far, and the jobs it looks up in their hashes (those whose answer
    may not come through the book: it keeps the producer's recent jobs' only, and another producer's
    go to its own stream) with when next."""

    def __init__(self, wait: Wait, book: ReplyBook, max_bytes: int) -> None:
        self.wait, self.book, self.max_bytes = wait, book, max_bytes
        self.proof_of = dict(zip(wait.job_ids, wait.proofs, strict=True))
        self.model_of = dict(zip(wait.job_ids, wait.models, strict=True))
        self.found: dict[str, wire.Response] = {}
        self.looks = {job_id: 0.0 for job_id in self.proof_of if not book.is_recent(job_id)}
        # From now on an answer in this producer's stream is kept for them too (before the look-up:
        # one that comes in between is not missed).
        for model in {self.model_of[j] for j in self.looks}:
            book.expect(model, [j for j in self.looks if self.model_of[j] == model])
        self.delay = dict.fromkeys(self.looks, LOOK_AGAIN[0])
        self.outage = redisfaults.Outage()
        self.began = book.generation

    def pending(self) -> list[str]:
        return [job_id for job_id in self.proof_of if job_id not in self.found]

    def collect(self) -> Steps[None]:
        """Take the answers read so far (by this wait's reads or another's)."""
        for job_id, frame in self.book.take(self.pending()).items():
            model, proof = self.model_of[job_id], self.proof_of[job_id]
            self.found[job_id] = yield from _response(job_id, model, frame, proof, self.max_bytes)
            self.looks.pop(job_id, None)

    def check_streams(self, pending: list[str]) -> None:
        """Raise what the last read found of a pending job's stream (no stream there)."""
        for job_id in pending:
            broken = self.book.broken.get(self.book.stream(self.model_of[job_id]))
            if broken is not None and broken[1] > self.began:  # found by a read since this wait began
                raise type(broken[0])(str(broken[0]))

    def look_up(self, now: float) -> Steps[bool]:
        """Look up the jobs due for it; whether any was."""
        due = [job_id for job_id, at in self.looks.items() if at <= now]
        if not due:
            return False
        try:
            answers = yield from _look_up(due, self.model_of, self.book, self.max_bytes, self.proof_of)
        except redis.RedisError as exc:
            yield from _pause(self.outage, exc, self.wait.deadline)
            return True
        for job_id in due:
            if (response := answers.get(job_id)) is not None:
                self.found[job_id] = response
                del self.looks[job_id]
            elif job_id in answers:  # to be answered in this producer's stream: it comes through it
                del self.looks[job_id]
            else:
                self.looks[job_id] = now + self.delay[job_id]
                self.delay[job_id] = min(self.delay[job_id] * 2, LOOK_AGAIN[1])
        return True

    def read(self, seen: int, seconds: float, pending: list[str]) -> Steps[None]:
        """One blocking XREAD of the book's streams, unless another wait is reading: then wait for it."""
        book = self.book
        streams = book.begin_read()
        if streams is None:
            yield Await(book, seen, seconds, pending)
            return
        entries: list[Any] = []
        ok = False
        try:
            reply = yield Read(book, streams, block=max(1, int(seconds * 1000)), count=READ_COUNT)
            entries, ok = entries_of(reply), True
        except redis.RedisError as exc:
            if redisfaults.is_down(exc):
                book.restart()
                yield from _pause(self.outage, exc, self.wait.deadline)
                return
            refusal = responses.read_refusal(exc)
            if refusal is not None:
                raise refusal from exc
            yield from _find_broken(book, streams)
            return
        finally:
            book.end_read(streams, entries, ok)
        self.outage.recovered()


def _pause(outage: redisfaults.Outage, exc: redis.RedisError, deadline: float) -> Steps[None]:
    yield Pause(max(0.0, min(outage.failed(exc, "could not read replies"), deadline - time.monotonic())))


def _find_broken(book: ReplyBook, streams: dict[str, bytes]) -> Steps[None]:
    """An XREAD refused for a key of the wrong type: each stream read alone, without blocking; one
    that is no stream is marked broken (its waits fail: CorruptRecord) until a read of it succeeds."""
    names = list(streams)
    probes = yield Round(lambda pipe: [pipe.xread({s: streams[s]}, count=1) for s in names], transaction=False)
    for stream, probe in zip(names, probes, strict=True):
        if isinstance(probe, redis.ResponseError) and redisfaults.is_wrong_type(probe):
            book.mark_broken(
                stream, CorruptRecord(f"the reply stream {stream} holds no stream: no ortq worker wrote it")
            )


def _look_up(
    due: list[str],
    model_of: dict[str, str],
    book: ReplyBook,
    max_bytes: int,
    proof_of: dict[str, bytes | None],
) -> Steps[dict[str, wire.Response | None]]:
    """Look ``due`` jobs up in their hashes: job id -> its response where the hash names its answer
    (read alone from its entry), None where the job is to be answered in this producer's own stream
    (it comes through the book); a job absent from the result is not answered yet."""
    # Two HGETs, not an HMGET: the producer's ACL rule grants HGET alone on job hashes.
    fields = yield Round(lambda pipe: _hgets(pipe, due), transaction=False)
    out: dict[str, wire.Response | None] = {}
    for job_id, name, answer in zip(due, fields[0::2], fields[1::2], strict=True):
        for got in (name, answer):
            if isinstance(got, redis.ResponseError) and redisfaults.is_wrong_type(got):
                raise CorruptRecord(f"the record of job {job_id} ({keys.job_key(job_id)}) is no hash")
            if isinstance(got, redis.RedisError):
                raise got  # look_up's: an outage is waited out, any other error raised
        if name is None or keys.reply_keep(name) is None:
            continue  # not enqueued yet, gone, or naming no stream: looked up again
        model = model_of[job_id]
        if answer is None:
            if keys.as_text(name) == book.name:
                out[job_id] = None
            continue
        frame = yield from _entry(keys.reply_key(model, keys.as_text(name)), answer, job_id)
        out[job_id] = yield from _response(job_id, model, frame, proof_of[job_id], max_bytes)
    return out


def _hgets(pipe: Any, job_ids: list[str]) -> None:
    for job_id in job_ids:
        pipe.hget(keys.job_key(job_id), "ortq_reply")
        pipe.hget(keys.job_key(job_id), "ortq_answer")


def _entry(stream: str, answer: bytes, job_id: str) -> Steps[bytes]:
    """The frame of entry ``answer`` (the job's ``ortq_answer``) of reply stream ``stream``."""
    before = entry_before(answer)
    if before is None:
        raise CorruptRecord(f"job {job_id}'s record names no entry of a reply stream ({answer!r})")
    reply = yield Command("xread", {stream: before}, count=1)
    for _, entry_id, entry_job, frame in entries_of(reply):
        if entry_id == answer and entry_job is not None and keys.as_text(entry_job) == job_id and frame is not None:
            return frame
    raise ResultTimeout(f"the answer of job {job_id} is no longer kept in {stream} (its producer's reply stream)")


def _response(job_id: str, model: str, frame: bytes, proof: bytes | None, max_bytes: int) -> Steps[wire.Response]:
    """The response an answer's frame holds (an empty frame: a large one, in the job's own stream)."""
    if not frame:
        key = keys.large_reply_key(model, job_id)
        try:
            reply = yield Command("xread", {key: "0-0"}, count=1)
        except redis.ResponseError as exc:
            if not redisfaults.is_wrong_type(exc):
                raise
            raise CorruptRecord(
                f"the large answer of job {job_id} ({key}) is no stream: no ortq worker wrote it"
            ) from exc
        frames = [f for _, _, _, f in entries_of(reply) if f]
        if not frames:
            raise CorruptRecord(f"the large answer of job {job_id} ({key}) is gone")
        frame = frames[0]
    return responses.read_response(frame, job_id, proof, max_bytes)

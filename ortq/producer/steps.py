"""What a producer asks of Redis, as steps with no I/O of their own, so that ``Producer`` and
``AsyncProducer`` are only transports of one command sequence each, not two copies of it.

A step sequence is a generator: it yields what to send (a :class:`Command`, a :class:`Round` of
pipelined commands, a :class:`Pause`, an :class:`Await` of another wait's read), is sent back the
reply, or thrown the exception that sending raised (redis-py's, the same class for both
producers), and returns its result. Every decision, argument and reply check is in the generator;
a producer runs it through a
:class:`Stepper` with blocking calls, the other awaiting them. Sequences compose with
``yield from``. The modules that hold them: ``lookups`` (signatures, workers, job status),
``submitting``, ``cancelling``, ``waiting`` (the blocking producer's wait for replies).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from ortq.producer import enqueue

T = TypeVar("T")


class Command:
    """One redis-py client method call: ``getattr(client, name)(*args, **kwargs)``; the reply is
    what it returns."""

    __slots__ = ("args", "kwargs", "name")

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.name = name
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"Command({self.name!r}, ...)"


class Read(Command):
    """A blocking XREAD of ``book``'s streams (a replybook.ReplyBook) that the book may cut short
    when a stream is added to it (AsyncProducer's read, on a connection it takes itself, is cancelled
    or never sent; the reply is then None, as for a block that ran out). A blocking producer reads
    a new stream beside it instead."""

    __slots__ = ("book",)

    def __init__(self, book: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__("xread", *args, **kwargs)
        self.book = book


class Round:
    """Commands sent in one round trip: ``queue(pipe)`` queues them on a redis-py pipeline (a
    MULTI/EXEC with ``transaction``); the reply is each command's, an error in the place of one
    that failed (``execute(raise_on_error=False)``).

    ``once``: sent once, never again by redis-py's own retries after a connection error or a
    timeout (the transport turns them off for it; the error reaches the steps). A MULTI whose
    EXEC ran but whose reply was lost would, sent again, enqueue its jobs a second time; the
    steps find out instead whether it ran (``submitting``)."""

    __slots__ = ("once", "queue", "transaction")

    def __init__(self, queue: Callable[[Any], object], *, transaction: bool, once: bool = False) -> None:
        self.queue = queue
        self.transaction = transaction
        self.once = once


class Pause:
    """Sleep ``seconds`` (blocking, or awaiting); the reply is None."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class Await:
    """Wait for another wait's read of ``book`` (a replybook.ReplyBook) to bring an answer of
    ``job_ids`` or to end (``ReplyBook.wait_change``), at most ``seconds`` (blocking, or awaiting);
    the reply is None."""

    __slots__ = ("book", "job_ids", "seconds", "seen")

    def __init__(self, book: Any, seen: int, seconds: float, job_ids: list[str]) -> None:
        self.book = book
        self.seen = seen
        self.seconds = seconds
        self.job_ids = job_ids


Request = Command | Round | Pause | Await
#: A step sequence that returns a T.
Steps = Generator[Request, Any, T]


class Stepper(Generic[T]):
    """Drives one step sequence for a transport, which loops: ``request = stepper.next()``; while it
    is not None, send it and hand the outcome back (``reply``, or ``fail`` with what sending
    raised); at None the sequence has returned :attr:`result` (or raised, out of ``next``)."""

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self._reply: Any = None
        self._error: Exception | None = None

    def next(self) -> Request | None:
        reply, error = self._reply, self._error
        self._reply = self._error = None
        try:
            return self._steps.send(reply) if error is None else self._steps.throw(error)
        except StopIteration as done:
            self.result: T = done.value
            return None

    def close(self) -> None:
        """End the sequence where it stands (its ``finally`` blocks run): its transport stopped
        driving it (a cancelled await)."""
        self._steps.close()

    def reply(self, reply: Any) -> None:
        self._reply = reply

    def fail(self, exc: Exception) -> None:
        self._error = exc


def function_calls(count: int, add: Callable[[Any, int, bool], None], *, once: bool = False) -> Steps[list[Any]]:
    """Calls of one of ortq's Redis functions, one per item, in one round trip by FCALL, and the
    items whose Redis lacks the function (no worker loaded it yet) in one more by EVAL of the same
    code. ``add(pipe, item, by_eval)`` queues one item's call; ``once``: each round is sent once
    (Round). Returns each item's reply (an error in its place)."""
    results: list[Any] = [None] * count
    todo = list(range(count))
    for by_eval in (False, True):
        if not todo:
            break
        replies = yield Round(_calls(add, todo, by_eval), transaction=False, once=once)
        for i, reply in zip(todo, replies, strict=True):
            results[i] = reply
        todo = [i for i in todo if isinstance(results[i], Exception) and enqueue.is_missing_function(results[i])]
    return results


def _calls(add: Callable[[Any, int, bool], None], items: list[int], by_eval: bool) -> Callable[[Any], None]:
    def queue(pipe: Any) -> None:
        for i in items:
            add(pipe, i, by_eval)

    return queue

"""Redis errors injected into an in-process worker's own Redis calls, one call at a time.

The worker talks to a real redis-server; here its client calls are wrapped at redis-py's public
boundary (``Redis.execute_command``, ``Pipeline.execute``, and ortq's reader of large frames),
above redis-py's own retries, so that what ortq's code sees is exactly what a connection reset
or a Redis restart shows it. A fault is one of:

- ``before``: the call fails without reaching Redis (a reset before the command was sent);
- ``after``: the call reaches Redis and runs there, then fails (the reply was lost): a script
  ran, a job was popped, and the worker does not know.

A *site* names where a call comes from: the worker thread that makes it and what it sends
(``ortq-feeder BLMOVE``, ``ortq-replier pipeline[DEL XADD EXPIRE finish]``, ``ortq-beat
EVALSHA rescue``). Only calls from threads whose name starts with ``ortq`` count: the test's
own producer and checks go through untouched.

A pipeline (not a transaction) that holds a command named in ``RedisFaults(cut_at=...)`` is also
a site cut at that command (``ortq-replier pipeline[finish PUBLISH WAIT] @WAIT``): the connection
breaks there, so the commands before it ran and those from it on did not (``before``), or it ran
too and the rest did not (``after``); either way no reply is read. ``cut_at=("PUBLISH", "WAIT")``
makes the confirmation that ``wait_replicas`` queues after an answer script (ortq/replication.py)
fail on its own, with the answer written.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
import redis.client

from ortq.rqcompat.book import SCRIPTS, script_source
from ortq.worker import intake

#: Script sha -> ortq's script name, for naming EVALSHA sites.
_SCRIPT_NAMES = {hashlib.sha1(script_source(name).encode()).hexdigest(): name for name in SCRIPTS}

MODES = ("before", "after")


def _word(args: tuple[Any, ...]) -> str:
    name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
    name = name.upper()
    if name in ("EVALSHA", "EVAL") and len(args) > 1:
        sha = args[1].decode() if isinstance(args[1], bytes) else str(args[1])
        return _SCRIPT_NAMES.get(sha, name)
    return name


@dataclass
class Fault:
    site: str
    mode: str
    #: Which occurrence of the site fails, counted from when the fault was armed (1: the next one).
    occurrence: int = 1
    fired: threading.Event = field(default_factory=threading.Event)


class RedisFaults:
    """Counts the worker's Redis calls by site and fails the one a ``Fault`` names; ``cut_at``:
    the commands at which a pipeline is also cut (see above)."""

    def __init__(self, cut_at: tuple[str, ...] = ()) -> None:
        self.cut_at = cut_at
        self.seen: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._fault: Fault | None = None
        self._count = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        execute_command = redis.Redis.execute_command
        pipeline_execute = redis.client.Pipeline.execute
        read_large_frames = intake.read_large_frames

        def patched_command(client: Any, *args: Any, **options: Any) -> Any:
            return self._call(f"{_word(args)}", lambda: execute_command(client, *args, **options))

        def patched_pipeline(pipe: Any, raise_on_error: bool = True) -> Any:
            # Each distinct command once, in order: a batch of 2 or 8 answers is one site.
            said = [_word(args) for args, _ in pipe.command_stack]
            words = " ".join(dict.fromkeys(said))

            def cut(index: int) -> Callable[[bool], object]:
                def run(including: bool) -> object:  # what went out before the connection broke
                    pipe.command_stack = pipe.command_stack[: index + including]
                    return pipeline_execute(pipe, False)

                return run

            transaction = pipe.transaction or pipe.explicit_transaction
            cuts = {} if transaction else {f"@{w}": cut(said.index(w)) for w in self.cut_at if w in said}
            return self._call(f"pipeline[{words}]", lambda: pipeline_execute(pipe, raise_on_error), cuts)

        def patched_frames(connection: Any, names: Any, limit: int) -> Any:
            return self._call("read_large_frames", lambda: read_large_frames(connection, names, limit))

        monkeypatch.setattr(redis.Redis, "execute_command", patched_command)
        monkeypatch.setattr(redis.client.Pipeline, "execute", patched_pipeline)
        monkeypatch.setattr(intake, "read_large_frames", patched_frames)

    def _call(self, what: str, call: Callable[[], Any], cuts: dict[str, Callable[[bool], object]] | None = None) -> Any:
        thread = threading.current_thread().name
        if not thread.startswith("ortq"):
            return call()
        site = f"{thread} {what}"
        cuts = cuts or {}
        sites = [site, *(f"{site} {at}" for at in cuts)]
        with self._lock:
            self.seen.update(sites)
            fault = self._fault
            hit = False
            if fault is not None and fault.site in sites:
                self._count += 1
                hit = self._count == fault.occurrence
                if hit:
                    self._fault = None
        if not hit:
            return call()
        assert fault is not None
        fault.fired.set()
        if fault.site != site:  # cut inside the pipeline: what went before the cut ran
            cuts[fault.site.removeprefix(f"{site} ")](fault.mode == "after")
            raise redis.ConnectionError(f"injected: the connection broke {fault.mode} {fault.site}")
        if fault.mode == "before":
            raise redis.ConnectionError(f"injected: connection reset before {site} was sent")
        call()
        raise redis.ConnectionError(f"injected: the reply to {site} was lost")

    @contextmanager
    def armed(self, fault: Fault) -> Iterator[Fault]:
        with self._lock:
            self._fault, self._count = fault, 0
        try:
            yield fault
        finally:
            with self._lock:
                self._fault = None

    def sites(self) -> list[str]:
        with self._lock:
            return sorted(self.seen)

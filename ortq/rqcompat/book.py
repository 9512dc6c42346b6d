"""RQ's per-job records, written server-side: the scripts in ``lua/`` bound to one connection,
one worker and one queue, with their arguments and replies in Python types.

RQ's own worker spends ~20 round trips on each job (execution record, registries, worker and job
hashes, result stream). Here the same writes happen inside one script call per stage: a job costs
three round trips in all (the dequeue, ``start`` with the read of its request frame, ``finish``).
What the scripts write is what RQ's ``prepare_execution``, ``prepare_job_execution``,
``handle_job_success``, ``handle_job_failure`` and ``Job.retry`` write, for RQ 2.12 and RQ 3
(tests/rqcontract compares them field by field).

The scripts build per-job key names from the ids they are given (a batch's ids are not known
before the script pops them), which ties ortq to a single Redis (no Cluster), as RQ's multi-key
transactions already do.
"""

from __future__ import annotations

import logging
import math
import os
import zlib
from base64 import b64encode
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import msgpack
import redis

from ortq import keys
from ortq.replication import NO_CONFIRM, Confirm
from ortq.rqcompat import contract, layout
from ortq.rqcompat.abandoned import TAG_DIGITS, Abandoned, execution_tag
from ortq.rqcompat.contract import JOB_FIELDS
from ortq.rqcompat.layout import QueueKeys, utcformat, utcnow
from ortq.settings import frame_argument

log = logging.getLogger("ortq.worker")

_LUA = Path(__file__).parent / "lua"

_JOB_FIELD_KEYS = tuple(name.encode() for name in JOB_FIELDS)

#: How long a started job's records live unless refreshed, for a job without a timeout: RQ's
#: SimpleWorker.get_heartbeat_ttl (with a timeout: timeout + 60 s). ortq's heartbeat refreshes them
#: every few seconds.
DEFAULT_JOB_TTL = layout.DEFAULT_WORKER_TTL + 60


@cache
def script_source(name: str) -> str:
    """The Lua of ``lua/<name>.lua`` with the contract's constants (contract.prelude) and the
    shared helpers of ``lua/common.lua`` before it."""
    return contract.prelude(name) + (_LUA / "common.lua").read_text() + "\n" + (_LUA / f"{name}.lua").read_text()


#: The names of ortq's scripts (lua/<name>.lua), each loaded with common.lua before it.
SCRIPTS = ("start", "finish", "fail", "recover", "reject", "rescue", "retries", "maintain", "executions")


def exc_string(text: str) -> str:
    """An error text as RQ's result stream stores it (base64 of zlib)."""
    return b64encode(zlib.compress(text.encode())).decode()


#: The records made for every job (StartedJob, Finished, ortq.worker's Taken and Pending) are
#: slotted and not frozen: a frozen dataclass's __init__ costs ~1 µs more, per job. Nothing
#: changes them once made.
@dataclass(slots=True)
class StartedJob:
    """One job ``start`` marked started: its ids, the job hash fields ortq reads (JOB_FIELDS;
    None where absent or, see ``oversized``, too large to read), and its heartbeat TTL."""

    job_id: str
    execution_id: str
    fields: dict[bytes, bytes]
    #: The name of a job hash field too large to be an ortq job's (it was not read), or None.
    oversized: str | None
    ttl: int
    started_at: datetime
    #: The size of its request frame: -1 when there is no request key, -2 when it is no string.
    frame_size: int
    #: The frame itself when start.lua returned it (a batch's small frames), else None.
    frame: bytes | None = None


@dataclass(frozen=True)
class Skipped:
    """A queue entry ``start`` took off the intermediate list without starting it, and why:
    ``id`` (not a job id), ``answered`` (its reply exists: a job runs once), ``gone`` (its record
    expired, as RQ skips it), ``type:<t>`` (its job key is no hash), ``status:<s>`` (a second entry
    of a job that already ran or runs), ``origin`` (its record names another queue)."""

    entry: bytes
    reason: str

    @property
    def answerable(self) -> bool:
        """A job id whose job key is no hash, or whose hash pins a version by a name no producer
        writes (``pin``: no worker would ever take it): whoever waits on it is told why
        (``reject``). Nothing else is written for a skipped entry: not for one that is no job id
        (no producer waits on it, and a reply stream for each would let anyone fill Redis), nor
        for a record that is some job's (answered, running, another model's)."""
        return self.reason.startswith("type:") or self.reason == "pin"


@dataclass(slots=True)
class Finished:
    """What ``finish`` needs of one successful job."""

    started: StartedJob
    frame: bytes
    ttl: int
    return_value: bytes | None  # RQ's result, already msgpack; None: no result record (Settings.rq_results)
    timings: dict[str, float] = field(default_factory=dict)  # for the worker's metrics


@dataclass(frozen=True)
class Retry:
    """A failed job goes back for another attempt: at once (``at`` None) or at an epoch time; its
    hash lives ``ttl`` seconds while it waits again (RQ gives it the job's ttl)."""

    retries_left: int
    at: float | None
    ttl: int = layout.DEFAULT_WORKER_TTL


#: Answers of at least this many bytes reach their reply stream through a stage key
#: (keys.answer_stage_key) instead of the finish script's arguments: Redis 7's Lua hashes every
#: byte of a string entering it, ~1.3 ns a byte (0.8 ms for a 602 KB answer; docs/performance.md).
STAGED_ANSWER_BYTES = 64 * 1024


#: Expired registry entries one maintain call removes at most per registry (~1 ms of Redis a
#: thousand; docs/reliability.md, "Hostile Redis").
MAINTAIN_LIMIT = 2000


class Book:
    """The scripts, bound to one connection, one worker and one queue; with ``executions``
    (Settings.rq_executions), RQ's execution records of each job are written too."""

    def __init__(
        self,
        connection: redis.Redis,
        worker_name: str,
        queue_name: str,
        executions: bool = True,
        version: str = "",
        parked_ttl: int = 24 * 3600,
        confirm: Confirm = NO_CONFIRM,
    ) -> None:
        """``version``: the model version the worker serves, whose parked jobs its starts take
        first, and that jobs pinned to another are parked for ('': none, every job starts);
        ``parked_ttl``: the most seconds a park makes a parked list live (a request's ttl; each park
        raises the list's expiry to that of the parked job's request, at most this: start.lua);
        ``confirm``: the replicas each answer must reach (Settings.wait_replicas) before finish
        and fail return, else they raise NotReplicated (to be sent again: the scripts are fenced)."""
        self.connection = connection
        self.confirm = confirm
        #: Executions whose failure fail.lua wrote but no replica confirmed: a second call finds
        #: them written already, and still reports them answered here.
        self._unconfirmed: set[str] = set()
        self.version = version
        self.parked_ttl = parked_ttl
        self.worker_name = worker_name
        self.queue = QueueKeys.of(queue_name)
        self.tag = execution_tag(worker_name)
        records = ("3" if layout.RQ3 else "2") + ("e" if executions else "")
        self._common: list[str | int] = [layout.PREFIX, records, keys.PREFIX, layout.DEFAULT_WORKER_TTL + 60]
        self._scripts = {name: connection.register_script(script_source(name)) for name in SCRIPTS}
        self._abandoned = Abandoned(connection, self.queue, worker_name)

    def _call(self, name: str, args: Iterable[Any], client: Any = None) -> Any:
        return self._scripts[name](keys=[], args=[*self._common, *args], client=client)

    # ------------------------------------------------------------------ one job's path

    def start(
        self, first_id: bytes, more: int, inline: int = 0, beside: Callable[[Any], object] = lambda pipe: None
    ) -> tuple[Any, datetime, list[Any]]:
        """Start ``first_id`` (already in the intermediate list; b"" for none) and up to ``more``
        jobs popped after it, in one round trip with what ``beside`` queues on the same pipeline.
        Returns the script's reply (for ``parse_start``; an error as an exception instance), the
        start's moment and the replies to ``beside``'s commands. The request frames of those others
        come back in the reply when at most ``inline`` bytes."""
        moment = utcnow()
        # RQ's execution ids (uuid4().hex there) are 32 random hex digits; ortq's are 32 hex digits
        # too: the worker's tag, then random ones (one read of the system's random source for all
        # of them), sent as one argument (start.lua cuts it).
        count, width = bool(first_id) + more, 32 - TAG_DIGITS
        randoms = os.urandom(width // 2 * count).hex()
        executions = "".join([self.tag + randoms[i : i + width] for i in range(0, width * count, width)])
        named = {
            "queue": self.queue.name,
            "worker": self.worker_name,
            "now": moment.timestamp(),
            "now_iso": utcformat(moment),
            "default_ttl": DEFAULT_JOB_TTL,
            "more": more,
            "inline": inline,
            "first": first_id,
            "executions": executions,
            "version": self.version,
            "parked_ttl": self.parked_ttl,
        }
        args = contract.arguments("start", named)
        reply, others = self._pipelined("start", args, after=beside)
        return reply, moment, others

    def _pipelined(
        self,
        name: str,
        args: list[Any],
        before: Callable[[Any], object] = lambda pipe: None,
        after: Callable[[Any], object] = lambda pipe: None,
    ) -> tuple[Any, list[Any]]:
        """Script ``name`` in one pipeline between what ``before`` and ``after`` queue (which must
        be safe to send twice): its reply (an error as an exception instance) and the replies to
        ``after``'s commands. The script goes by its sha alone: redis-py's pipeline sends SCRIPT
        EXISTS before every execute that holds a Script, one more round trip each time. Redis
        answers NOSCRIPT when it has lost the scripts (a restart, SCRIPT FLUSH) or none was sent
        yet: the script is loaded and the pipeline sent again (the script did not run)."""
        script = self._scripts[name]
        with self.connection.pipeline(transaction=False) as pipe:
            for _ in range(3):  # a Redis that keeps losing the script: its error is returned
                before(pipe)
                skipped = len(pipe)
                pipe.evalsha(script.sha, 0, *self._common, *args)
                after(pipe)
                replies = pipe.execute(raise_on_error=False)
                reply, *others = replies[skipped:]
                if not isinstance(reply, redis.exceptions.NoScriptError):
                    break
                script.sha = self.connection.script_load(script.script)
        # A refused command of ``before``'s (its key of the wrong type, or the ACL) is raised once
        # the script has run: what the script wrote stands (for finish, a job whose stage is
        # missing stays started, to be taken back).
        for earlier in replies[:skipped]:
            if isinstance(earlier, Exception):
                raise earlier
        return reply, others

    def parse_start(self, reply: Any, moment: datetime) -> tuple[list[StartedJob], list[Skipped]]:
        """start.lua's flat reply (contract.START_HEAD, the skipped pairs, contract.START_JOB per
        job with its field values) as records."""
        skipped_count = int(reply[1])
        at = len(contract.START_HEAD)
        # A reason quotes a status read from the job hash: any bytes at all.
        pairs = range(at, at + 2 * skipped_count, 2)
        skipped = [Skipped(reply[i], reply[i + 1].decode(errors="replace")) for i in pairs]
        at += 2 * skipped_count
        started = []
        previous: dict[bytes, bytes] = {}
        end, width = len(reply), len(contract.START_JOB)
        while at < end:
            job_id, execution, ttl, frame_size, frame, oversized, count = reply[at : at + width]
            at += width
            if count == 1:  # the previous job's values but enqueued_at (start.lua)
                fields = previous.copy()
                fields.pop(b"enqueued_at", None)
                if reply[at]:
                    fields[b"enqueued_at"] = reply[at]
            elif count:
                fields = {name: v for name, v in zip(_JOB_FIELD_KEYS, reply[at : at + count], strict=True) if v}
            else:  # an oversized field leaves no values at all (nothing was read): the job is failed for it
                fields = {}
            at += count
            if not oversized:
                previous = fields
            # Ids and field names are ASCII: start.lua started no id outside RQ's rule, and made the
            # execution ids of hex digits.
            started.append(
                StartedJob(
                    job_id.decode(),
                    execution.decode(),
                    fields,
                    oversized.decode() or None,
                    ttl,
                    moment,
                    frame_size,
                    frame or None,
                )
            )
        return started, skipped

    @staticmethod
    def backlog(reply: Any) -> int:
        """How many entries a start left on the queue (from its reply)."""
        return int(reply[0])

    def finish(self, jobs: Sequence[Finished], state: str = "idle") -> int:
        """Answer every job, then write what RQ writes for each finished job; one round trip.
        Returns how many were still this worker's to answer."""
        ended = utcnow()
        ended_at = ended.timestamp()
        per_job: list[Any] = []
        staged = []
        # A start's jobs share their moment: (working seconds, started) once per moment, by number.
        moments: dict[datetime, int] = {}
        pairs: list[str] = []
        replies: dict[bytes | None, tuple[str, int]] = {}
        for job in jobs:
            started = job.started
            # The reply stream its hash names (most batches: one producer's, checked once); none
            # ('', 0): answered nowhere (the worker's check fails such a job before it runs).
            named_reply = started.fields.get(b"ortq_reply")
            if (reply := replies.get(named_reply)) is None:
                keep = keys.reply_keep(named_reply)
                reply = replies[named_reply] = (
                    ("", 0) if keep is None or named_reply is None else (named_reply.decode(), keep)
                )
            if (moment := moments.get(started.started_at)) is None:
                started_at = started.started_at.timestamp()
                # Floats as redis-py would send them (repr), so that the records read as before.
                pairs += (repr(ended_at - started_at), repr(started_at))
                moment = moments[started.started_at] = len(moments) + 1
            value = b"" if job.return_value is None else b64encode(job.return_value)
            frame: bytes | memoryview = b""  # contract.FINISH_JOB: a staged job's frame is ''
            if len(job.frame) >= STAGED_ANSWER_BYTES:
                staged.append(job)
            else:
                frame = frame_argument(job.frame)
            per_job += (started.job_id, started.execution_id, job.ttl, moment, value, frame, *reply)
        named = {
            "queue": self.queue.name,
            "worker": self.worker_name,
            "state": state,
            "count": len(jobs),
            "ended_iso": utcformat(ended),
            "ended_at": repr(ended_at),
            "moment_count": len(moments),
        }
        args = contract.arguments("finish", named, [*pairs, *per_job])

        def stage(pipe: Any) -> None:  # large answers go in beside the script, never through Lua
            for job in staged:
                key = keys.answer_stage_key(job.started.job_id, job.started.execution_id)
                pipe.delete(key)  # sent twice after a NOSCRIPT: still one entry
                pipe.xadd(key, {"frame": frame_argument(job.frame)})
                pipe.expire(key, job.ttl)

        reply, confirmed = self._pipelined("finish", args, before=stage, after=self.confirm.queue)
        if isinstance(reply, Exception):
            raise reply
        self.confirm.check(confirmed)
        return int(reply)

    def fail(
        self,
        started: StartedJob,
        error: bytes,
        ttl: int,
        reason: str,
        retry: Retry | None,
        state: str = "idle",
        status: str = "failed",
    ) -> bool:
        """Answer ``error`` to a failed job and write RQ's failure records (the job's ``status``:
        failed, or stopped), or (``retry``) put it back for another attempt; False when another
        worker had taken it back meanwhile. True for a second send whose first failed the job here
        (its reply lost; a retry's first send cannot be told from a take-back: False)."""
        ended = utcnow()
        named = {
            "queue": self.queue.name,
            "worker": self.worker_name,
            "state": state,
            "id": started.job_id,
            "execution": started.execution_id,
            "error": error,
            "ttl": ttl,
            "exc_string": exc_string(reason),
            "now": ended.timestamp(),
            "now_iso": utcformat(ended),
            "started_at": started.started_at.timestamp(),
            "working": (ended - started.started_at).total_seconds(),
            "retry": "" if retry is None else "now" if retry.at is None else "at",
            # Whole seconds (RQ's scheduled registry), rounded up: a retry never runs before its backoff.
            "retry_at": "" if retry is None or retry.at is None else math.ceil(retry.at),
            "retries_left": "" if retry is None else retry.retries_left,
            "retry_ttl": "" if retry is None else retry.ttl,
            "status": status,
        }
        args = contract.arguments("fail", named)
        reply, confirmed = self._pipelined("fail", args, after=self.confirm.queue)
        if isinstance(reply, Exception):
            raise reply
        written = bool(reply) or started.execution_id in self._unconfirmed
        if written:
            self._unconfirmed.add(started.execution_id)  # until a replica has it
        self.confirm.check(confirmed)
        self._unconfirmed.discard(started.execution_id)
        return written

    def reject(self, skipped: Skipped, error: bytes, ttl: int) -> None:
        """Answer ``error`` to a skipped job that can be answered (Skipped.answerable), unless it
        has been answered already, so that its producer learns why; a job hash is marked failed."""
        moment = utcnow()
        self._call("reject", [self.queue.name, skipped.entry, error, ttl, moment.timestamp(), utcformat(moment)])

    # ------------------------------------------------------------------ recovery and upkeep

    def record_executions(self, running: Sequence[StartedJob]) -> int:
        """RQ's execution records of the jobs this worker holds, written at its heartbeat (see
        executions.lua: a job that ends before one has none); how many jobs got them."""
        jobs = [(job.job_id, job.execution_id, repr(job.started_at.timestamp()), job.ttl) for job in running]
        args = [self.queue.name, self.worker_name, utcnow().timestamp(), msgpack.packb(jobs)]
        return int(self._call("executions", args))

    def recover(
        self, job_id: str, execution_id: str, owner: str, max_recoveries: int, ttl: int, error: bytes, reason: str
    ) -> str | None:
        """Requeue (or, past ``max_recoveries``, fail with ``error``) a job whose worker died
        running it; None when it was not started any more (another worker took it back first)."""
        moment = utcnow()
        args = [self.queue.name, job_id, execution_id, owner, max_recoveries, ttl]
        result = self._call("recover", [*args, moment.timestamp(), utcformat(moment), error, exc_string(reason)])
        return None if result is None else keys.as_text(result)

    def rescue(self, grace: float, limit: int = 1000) -> tuple[list[str], int, bool]:
        """Requeue jobs a lost BLMOVE reply left in the intermediate list (see rescue.lua):
        (ids requeued, entries removed, whether to call again soon)."""
        rescued, removed, full = self._call("rescue", [self.queue.name, utcnow().timestamp(), grace, limit])
        return [keys.as_text(r) for r in rescued], int(removed), bool(full)

    def due_retries(self, limit: int = 100) -> int:
        """Move retries whose backoff has passed back to the queue; how many moved."""
        moment = utcnow()
        return int(self._call("retries", [self.queue.name, moment.timestamp(), limit, utcformat(moment)]))

    def maintain(self, limit: int = MAINTAIN_LIMIT) -> tuple[list[str], bool]:
        """RQ's registry cleanup for this queue, at most ``limit`` expired entries per registry: the
        names of keys removed for holding the wrong type, and whether to call again soon."""
        removed, more = self._call("maintain", [self.queue.name, utcnow().timestamp(), limit])
        return [keys.as_text(k) for k in removed], bool(more)

    def abandoned(
        self, dead_after: float, own: bool, held: frozenset[str] = frozenset(), limit: int = 1000
    ) -> list[tuple[str, str, str]]:
        """(job id, execution id, worker name) of this queue's started jobs whose worker has sent
        no heartbeat for ``dead_after`` seconds: :meth:`ortq.rqcompat.abandoned.Abandoned.find`."""
        return self._abandoned.find(dead_after, own, held, limit)

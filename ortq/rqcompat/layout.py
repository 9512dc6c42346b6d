"""RQ's key names and field formats, for the RQ series installed beside ortq (2.12 or 3.x).

ortq writes RQ's records itself (server-side, in the scripts next to this module) so that every RQ
tool (``rq info``, rq-dashboard, ``send_shutdown_command``, registries, results) sees an ortq
worker as an RQ worker. Everything that must match RQ's layout is named here and nowhere else;
tests/rqcontract compares what ortq writes with what RQ's own worker writes, field by field.

RQ 3 reads its key prefix from the ``RQ_KEY_PREFIX`` environment variable (default ``rq``) when
``rq`` is imported; RQ 2.12 has no such setting and always uses ``rq``.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from datetime import UTC, datetime

import rq
import rq.defaults

#: The RQ release installed, as (major, minor).
RQ_VERSION: tuple[int, int] = tuple(int(p) for p in rq.__version__.split(".")[:2])  # type: ignore[assignment]

#: What RQ 3 changed in the records a worker writes: an index of each worker's executions
#: (``<prefix>:worker:<name>:executions``, which is where RQ 3 finds a worker's current job), the
#: job id inside each execution hash, and no ``current_job`` fields in the worker hash.
RQ3 = RQ_VERSION >= (3, 0)

#: RQ's key prefix: RQ 3's ``RQ_KEY_PREFIX``, as RQ itself validated it; always ``rq`` before RQ 3.
PREFIX: str = getattr(rq.defaults, "RQ_KEY_PREFIX", "rq")

#: RQ's defaults for a worker's heartbeat TTL (seconds).
DEFAULT_WORKER_TTL: int = rq.defaults.DEFAULT_WORKER_TTL

#: RQ's timestamp format (``rq.utils.utcformat``): UTC, microseconds, a literal Z.
_TIMESTAMP = "%Y-%m-%dT%H:%M:%S.%fZ"

#: RQ's rule for job ids (``rq.job.Job.set_id``), with a length bound of ortq's own: ids end up in
#: key names and log lines.
JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def utcformat(moment: datetime) -> str:
    """``moment`` as RQ writes timestamps into hashes."""
    return moment.astimezone(UTC).strftime(_TIMESTAMP)


def utcnow() -> datetime:
    return datetime.now(UTC)


def is_job_id(value: str) -> bool:
    """True when ``value`` is an id RQ accepts (and ortq can put in key names)."""
    return JOB_ID.fullmatch(value) is not None


@dataclass(frozen=True)
class QueueKeys:
    """RQ's keys for one queue (``ortq:<model>``)."""

    name: str
    queue: str
    intermediate: str
    started: str
    finished: str
    failed: str
    scheduled: str
    canceled: str
    workers: str

    @classmethod
    def of(cls, name: str, prefix: str = PREFIX) -> QueueKeys:
        queue = f"{prefix}:queue:{name}"
        return cls(
            name=name,
            queue=queue,
            intermediate=queue + ":intermediate",
            started=f"{prefix}:wip:{name}",
            finished=f"{prefix}:finished:{name}",
            failed=f"{prefix}:failed:{name}",
            scheduled=f"{prefix}:scheduled:{name}",
            canceled=f"{prefix}:canceled:{name}",
            workers=f"{prefix}:workers:{name}",
        )


def job_key(job_id: str, prefix: str = PREFIX) -> str:
    return f"{prefix}:job:{job_id}"


def results_key(job_id: str, prefix: str = PREFIX) -> str:
    return f"{prefix}:results:{job_id}"


def execution_key(job_id: str, execution_id: str, prefix: str = PREFIX) -> str:
    return f"{prefix}:execution:{job_id}:{execution_id}"


def worker_key(name: str, prefix: str = PREFIX) -> str:
    return f"{prefix}:worker:{name}"


def worker_executions_key(name: str, prefix: str = PREFIX) -> str:
    """RQ 3's index of a worker's running executions."""
    return f"{prefix}:worker:{name}:executions"


def workers_key(prefix: str = PREFIX) -> str:
    return f"{prefix}:workers"


def queues_key(prefix: str = PREFIX) -> str:
    return f"{prefix}:queues"


def pubsub_channel(worker_name: str, prefix: str = PREFIX) -> str:
    """Where ``rq.command.send_command`` publishes commands for a worker."""
    return f"{prefix}:pubsub:{worker_name}"


def suspended_key(prefix: str = PREFIX) -> str:
    """Set by ``rq suspend``: workers take no new job while it exists."""
    return f"{prefix}:suspended"


def worker_birth_fields(birth: datetime, queue_names: list[str]) -> dict[str, str | int]:
    """The worker hash fields RQ's ``register_birth`` writes (``BaseWorker.serialize``)."""
    return {
        "birth": utcformat(birth),
        "last_heartbeat": utcformat(birth),
        "queues": ",".join(queue_names),
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "ip_address": "unknown",
        "version": rq.__version__,
        "python_version": sys.version,
    }

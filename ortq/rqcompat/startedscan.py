"""A bounded walk over a queue's started registry, for the recovery of orphans.

Each call looks at the next ``limit`` entries (a cursor by rank that wraps around), so that every
entry is looked at within a few calls however many there are; entries that are no
``<job id>:<execution id>`` of RQ's (anyone with write access may have added them: binary, too
long, no colon) are removed as they are met. Before this, a scan looked at the first thousand
entries only, and a thousand forged ones there stopped the recovery of every dead worker's job
behind them for good.
"""

from __future__ import annotations

import logging
from typing import cast

import redis

from ortq.rqcompat.layout import is_job_id

log = logging.getLogger("ortq.worker")


class StartedScan:
    """The cursor of one worker's walk over one started registry."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._next = 0

    def window(self, connection: redis.Redis, limit: int) -> list[tuple[str, str]]:
        """(job id, execution id) of the next ``limit`` entries, less the malformed ones, which are
        removed."""
        start = self._next
        raw = cast(list[bytes], connection.zrange(self.key, start, start + limit - 1))
        self._next = 0 if len(raw) < limit else start + limit  # past the end: from the start next time
        entries, malformed = [], []
        for entry in raw:
            job_id, _, execution = entry.decode(errors="replace").rpartition(":")
            if len(entry) <= 300 and is_job_id(job_id) and is_job_id(execution):
                entries.append((job_id, execution))
            else:
                malformed.append(entry)
        if malformed:
            connection.zrem(self.key, *malformed)
            self._next = max(0, self._next - len(malformed))  # the entries behind moved up
            log.warning("removed %d entries of %s that were no job's execution", len(malformed), self.key)
        return entries

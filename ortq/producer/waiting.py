"""How ``Producer`` waits for replies, as I/O-free steps (``steps``): blocking XREADs of the reply
streams of the oldest pending jobs, until every reply is in, through Redis outages until the
deadline. (``AsyncProducer`` waits through one reader task instead: ``replies``.)"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from ortq import redisfaults, wire
from ortq.errors import OrtqError
from ortq.producer import responses
from ortq.producer.steps import Command, Pause, Round, Steps

#: Most reply streams one XREAD names: the oldest pending jobs (replies mostly come in order; the
#: others are read as the window moves on). A wide window costs every wake-up as many keys sent and
#: looked up, for each of the jobs still pending: quadratic in a large drain.
XREAD_STREAMS = 16


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


def wait_for_responses(wait: Wait, *, block: float, max_bytes: int) -> Steps[list[wire.Response]]:
    """The responses of ``wait``'s jobs, in order, each XREAD blocking at most ``block`` seconds, each
    frame at most ``max_bytes``."""
    job_ids, deadline, look_once = wait.job_ids, wait.deadline, wait.look_once
    proof_of = dict(zip(job_ids, wait.proofs, strict=True))
    model_of = dict(zip(job_ids, wait.models, strict=True))
    found: dict[str, wire.Response] = {}
    outage = redisfaults.Outage()
    while True:
        pending = [job_id for job_id in proof_of if job_id not in found]
        if not pending:
            return [found[job_id] for job_id in job_ids]
        remaining = deadline - time.monotonic()
        if remaining <= 0 and not look_once:
            late = wait.late or f"{len(pending)} of {len(job_ids)} jobs had no result within {wait.timeout:g} s"
            raise outage.error(late)
        look_once = False
        reading = pending[:XREAD_STREAMS]
        try:
            # Blocks stay under the socket timeout, which would otherwise cut a long one short.
            block_ms = max(1, int(min(remaining, block) * 1000))
            streams = responses.reply_streams((model_of[job_id], job_id) for job_id in reading)
            reply = yield Command("xread", streams, block=block_ms)
        except redis.RedisError as exc:
            if redisfaults.is_down(exc):
                yield Pause(max(0.0, min(outage.failed(exc, "could not read replies"), deadline - time.monotonic())))
                continue
            raise (yield from _unreadable([(model_of[j], j) for j in reading], exc)) from exc
        outage.recovered()
        for job_id, frame in responses.frames_in(reply).items():
            if isinstance(frame, OrtqError):
                raise frame
            found[job_id] = responses.read_response(frame, job_id, proof_of.get(job_id), max_bytes)


def _unreadable(jobs: Sequence[tuple[str, str]], exc: redis.RedisError) -> Steps[OrtqError]:
    """Why XREAD refused to read the replies of these (model, job id): one of the reply keys is not
    a stream (written by someone else), or the Redis user may not read them."""
    refusal = responses.read_refusal(exc)
    if refusal is not None:
        return refusal
    try:
        probes = yield Round(lambda pipe: _probes(pipe, jobs), transaction=False)
    except redis.RedisError as again:
        return redisfaults.failure(again, "could not read replies")
    for (model, job_id), probe in zip(jobs, probes, strict=True):
        if (wrong := responses.wrong_reply(model, job_id, probe)) is not None:
            return wrong
    return redisfaults.failure(exc, "could not read replies")


def _probes(pipe: Any, jobs: Sequence[tuple[str, str]]) -> None:
    for model, job_id in jobs:
        responses.add_probe(pipe, model, job_id)

"""The producers' I/O-free steps (ortq/producer/steps.py): how a transport drives them, and that
``Producer`` and ``AsyncProducer`` stay transports of one copy of each command sequence."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import redis

from ortq.errors import CorruptRecord
from ortq.producer import cancelling
from ortq.producer.steps import Round, Stepper, Steps
from tests.conftest import REPO

#: Twin lines (scripts/producer_twins.py) the two producers' method bodies may have: their one-line
#: hand-overs to the steps, submit's keyword arguments passed on, infer's submit-then-wait. Logic
#: written into both classes again shows here first; share it as steps instead of raising this.
MAX_BODY_TWIN_LINES = 40


def test_the_producers_write_no_command_sequence_twice() -> None:
    run = subprocess.run(
        [sys.executable, "scripts/producer_twins.py", "--max-body", str(MAX_BODY_TWIN_LINES)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "twin lines" in run.stdout


def drive(steps: Steps[object], replies: list[object]) -> tuple[list[object], object]:
    """What ``steps`` ask for, given ``replies`` in turn (an exception: what sending raised), and
    what they return."""
    stepper = Stepper(steps)
    asked = []
    while (request := stepper.next()) is not None:
        asked.append(request)
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            stepper.fail(reply)
        else:
            stepper.reply(reply)
    assert not replies, "replies left over"
    return asked, stepper.result


class Recorder:
    """A stand-in pipeline that notes the commands a Round queues on it."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, tuple[object, ...]]] = []

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: self.commands.append((name, args))


def queued(request: object) -> list[tuple[str, tuple[object, ...]]]:
    assert isinstance(request, Round)
    pipe = Recorder()
    request.queue(pipe)
    return pipe.commands


def test_a_cancel_of_a_queued_job_is_an_lrem_sent_once_then_one_multi() -> None:
    asked, result = drive(cancelling.cancel("job-1", "m"), [[1], [1, 1, 1]])
    assert result is True
    assert isinstance(asked[0], Round) and asked[0].once and not asked[0].transaction
    assert queued(asked[0]) == [("lrem", ("rq:queue:ortq:m", 0, "job-1"))]
    assert isinstance(asked[1], Round) and asked[1].transaction


def test_a_cancels_records_are_written_again_after_a_lost_reply() -> None:
    """Off its queue, a job not marked canceled would wait nowhere: the MULTI goes once more."""
    asked, result = drive(cancelling.cancel("job-1", "m"), [[1], redis.ConnectionError("reset"), [1, 1, 1]])
    assert result is True and len(asked) == 3
    assert queued(asked[1]) == queued(asked[2])
    assert queued(asked[2])[1] == ("hset", ("rq:job:job-1", "status", "canceled"))


@pytest.mark.parametrize(
    ("again", "status", "cancelled"), [([1], None, True), ([0], b"queued", True), ([0], b"started", False)]
)
def test_a_cancels_lost_lrem_reply_is_sent_again_and_its_status_read(
    again: list[int], status: bytes | None, cancelled: bool
) -> None:
    """LREM answered 0 after a lost reply: the job's status says whether the first one took it off."""
    replies: list[object] = [redis.ConnectionError("reset"), again]
    if again == [0]:
        replies.append(status)
    if not cancelled:
        replies.append(None)  # its pin (HGET ortq_version): none, so parked nowhere
    replies.append([1, 1, 1] if cancelled else [0])  # the cancel's MULTI, or the stop request
    asked, result = drive(cancelling.cancel("job-1", "m", b"p" * 32), replies)
    assert result is cancelled
    assert queued(asked[1]) == queued(asked[0])


def test_a_stop_request_falls_back_to_eval_where_redis_lacks_the_function() -> None:
    missing = redis.ResponseError("Function not found")
    asked, result = drive(cancelling.request_stop("job-1", "m", b"p" * 32), [[missing], [1]])
    assert result is True
    assert all(isinstance(r, Round) and not r.transaction for r in asked) and len(asked) == 2


def test_what_sending_raised_is_the_steps_to_word() -> None:
    refused = redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
    with pytest.raises(CorruptRecord, match="is no list") as caught:
        drive(cancelling.cancel("job-1", "m"), [[refused]])
    assert caught.value.__cause__ is refused

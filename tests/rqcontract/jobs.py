"""The job functions RQ's reference worker runs (in-process: SimpleWorker, burst).

``while_running`` is called from inside every job, so the reference can snapshot a job while
it is started; reference.py sets it and clears it.
"""

from __future__ import annotations

from collections.abc import Callable

while_running: Callable[[], None] | None = None


def _running() -> None:
    if while_running is not None:
        while_running()


def succeed(value: int) -> dict[str, object]:
    """Returns a small map, as ortq's job function returns its reply summary."""
    _running()
    return {"value": value, "outputs": {"y": ["float32", [1, 4]]}}


class ContractJobError(RuntimeError):
    """The exception the failing reference job raises."""


def fail(message: str) -> None:
    _running()
    raise ContractJobError(message)

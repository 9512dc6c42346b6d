"""What the pool does when a worker process exits: a pure function of its exit status and history.

``ortq worker``'s exit statuses (docs/pool.md, ortq/errors.py):

- 0 with ``burst``: the queue is empty, the worker is done (not restarted).
- 0 without ``burst``: something other than the pool stopped it (an operator's SIGTERM, an RQ
  shutdown command). The pool's job is to keep the configured number running, so it is restarted,
  with the crash backoff (repeated outside stops do not become a hot loop).
- 75 (EXIT_DEVICE_LOST): the GPU was lost and the worker's jobs were put back on the queue; a fresh
  process gets a fresh device, so the first time it is restarted at once. Lost again before it ran
  healthy: the crash backoff (a GPU that keeps failing must not be hammered).
- 2 (EXIT_CONFIGURATION): refused at start (bad model, adapter gone, canary mismatch). Restarting at
  once cannot help, but an adapter can come back (driver reset), so it is retried slowly
  (``configuration_retry_seconds``) and after ``max_configuration_errors`` in a row given up, loudly.
- anything else, or killed by a signal: a crash; restarted after ``backoff_initial_seconds``,
  doubling up to ``backoff_max_seconds``.

A worker that ran ``healthy_after_seconds`` before exiting starts with a clean history.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace
from enum import Enum

from ortq.errors import EXIT_CONFIGURATION, EXIT_DEVICE_LOST
from ortq.pool.config import RestartPolicy


class Action(Enum):
    RESTART = "restart"
    FINISHED = "finished"
    GIVE_UP = "give up"


@dataclass(frozen=True)
class ExitHistory:
    """What one worker slot's earlier exits were, since it last ran healthy."""

    #: Crashes (and repeated device losses) in a row: the exponent of the backoff.
    failures: int = 0
    #: Exits with status 2 in a row.
    configuration_errors: int = 0
    #: Device losses since the last healthy run.
    device_losses: int = 0


@dataclass(frozen=True)
class Decision:
    action: Action
    #: Seconds to wait before the restart (0: at once).
    delay: float
    #: Why, in words, for the pool's log.
    reason: str
    history: ExitHistory


def describe_exit(code: int) -> str:
    """An exit status in words: ``exit 75 (device lost)``, ``killed by SIGKILL``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    meaning = {0: "stopped cleanly", EXIT_CONFIGURATION: "configuration error", EXIT_DEVICE_LOST: "device lost"}
    return f"exit {code} ({meaning.get(code, 'crashed')})"


def crash_delay(policy: RestartPolicy, failures: int) -> float:
    """The backoff before the restart after ``failures`` (>= 1) crashes in a row."""
    return min(policy.backoff_max_seconds, policy.backoff_initial_seconds * 2.0 ** min(failures - 1, 64))


def decide(policy: RestartPolicy, history: ExitHistory, code: int, uptime: float, burst: bool) -> Decision:
    """What to do about a worker that exited with ``code`` after running ``uptime`` seconds."""
    if uptime >= policy.healthy_after_seconds:
        history = ExitHistory()
    if code == 0 and burst:
        return Decision(Action.FINISHED, 0.0, "its queue is empty (burst)", history)
    if code == EXIT_CONFIGURATION:
        errors = history.configuration_errors + 1
        history = replace(history, configuration_errors=errors)
        if errors >= policy.max_configuration_errors:
            return Decision(
                Action.GIVE_UP,
                0.0,
                f"it refused to start {errors} times in a row (exit 2): fix the configuration and restart the pool",
                history,
            )
        return Decision(
            Action.RESTART,
            policy.configuration_retry_seconds,
            f"refused to start (exit 2, {errors} of {policy.max_configuration_errors} before giving up); "
            "restarting at once would not help",
            history,
        )
    history = replace(history, configuration_errors=0)
    if code == EXIT_DEVICE_LOST and history.device_losses == 0:
        return Decision(
            Action.RESTART, 0.0, "device lost: a fresh process gets a fresh device", replace(history, device_losses=1)
        )
    if code == EXIT_DEVICE_LOST:
        history = replace(history, device_losses=history.device_losses + 1)
    history = replace(history, failures=history.failures + 1)
    if code == EXIT_DEVICE_LOST:
        why = f"device lost again ({history.device_losses} times) before running healthy"
    elif code == 0:
        why = "stopped without the pool asking"
    else:
        why = "crashed"
    return Decision(Action.RESTART, crash_delay(policy, history.failures), why, history)

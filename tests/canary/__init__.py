"""A module that must never be imported by a worker: importing it leaves a file behind.

Tests name ``tests.canary.tripwire`` in a forged job hash and then check that the file
named by ``ORTQ_CANARY_FILE`` does not exist.
"""

import os
from pathlib import Path

_target = os.environ.get("ORTQ_CANARY_FILE")
if _target:
    Path(_target).write_text("imported\n")


def tripwire(*args: object, **kwargs: object) -> None:
    if _target:
        Path(_target).write_text("called\n")

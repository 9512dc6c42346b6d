"""``python -m ortq`` is the ``ortq`` command."""

from ortq.cli import run

run()

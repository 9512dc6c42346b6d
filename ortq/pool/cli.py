"""The ``ortq pool`` command (placeholder until the pool lands)."""

from __future__ import annotations

import click


@click.command()
def pool() -> None:
    """Run worker processes per adapter from a config file (not implemented yet)."""
    raise click.UsageError("ortq pool is not implemented yet")

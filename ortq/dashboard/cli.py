"""The ``ortq dashboard`` command (placeholder until the dashboard lands)."""

from __future__ import annotations

import click


@click.command()
def dashboard() -> None:
    """Serve the web dashboard (not implemented yet)."""
    raise click.UsageError("ortq dashboard is not implemented yet")

"""Plain-text tables for the CLI (``ortq info``, ``ortq adapters``, ``ortq pool --check``)."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns two spaces apart; None prints as an empty cell."""
    cells = [[str(h) for h in header], *[["" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)

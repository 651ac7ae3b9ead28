"""Rows of dicts as a table: Markdown for files and pipes, aligned plain text for a terminal."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

__all__ = ["format_table", "wants_markdown"]


def wants_markdown(stream: TextIO | None = None) -> bool:
    """Markdown unless ``stream`` (default stdout) is a terminal."""
    stream = stream or sys.stdout
    return not (hasattr(stream, "isatty") and stream.isatty())


def _cell(value: Any, digits: int) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.0f}" if abs(value) >= 10**digits else f"{value:.{digits}g}"
    return str(value)


def format_table(
    rows: Sequence[Mapping[str, Any]], markdown: bool | None = None, digits: int = 4, title: str | None = None
) -> str:
    """``rows`` (dicts sharing their keys) as a table; numbers right-aligned, ``digits`` significant.

    ``markdown`` None picks Markdown when stdout is not a terminal (see :func:`wants_markdown`).
    """
    if markdown is None:
        markdown = wants_markdown()
    if not rows:
        return f"{title}\n(no rows)" if title else "(no rows)"
    columns = list(rows[0])
    cells = [[_cell(row.get(c), digits) for c in columns] for row in rows]
    numeric = [
        all(isinstance(row.get(c), (int, float)) and not isinstance(row.get(c), bool) for row in rows)
        for c in columns
    ]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]

    def line(values: Sequence[str], sep: str) -> str:
        parts = [
            v.rjust(w) if right else v.ljust(w) for v, w, right in zip(values, widths, numeric, strict=True)
        ]
        return f"| {' | '.join(parts)} |" if markdown else sep.join(parts).rstrip()

    if markdown:
        rule = (
            "|"
            + "|".join(
                ("-" * (w + 1) + ":") if right else ("-" * (w + 2))
                for w, right in zip(widths, numeric, strict=True)
            )
            + "|"
        )
    else:
        rule = "  ".join("-" * w for w in widths)
    lines = [line(columns, "  "), rule, *(line(r, "  ") for r in cells)]
    if title:
        lines.insert(0, f"**{title}**\n" if markdown else title)
    return "\n".join(lines)

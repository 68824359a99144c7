# SPDX-License-Identifier: Apache-2.0
"""What every section module of the report shares: table cells, goal rows, the section record.

A section module (``sections/<bench>.py``, named after the benchmark whose
``<bench>.json`` it renders) defines ``SECTION = Section(...)``: its heading, where its goals
come from, its place on the page, the function that renders its body and the function that
returns its goal rows. ``render.py`` finds the modules, so a new benchmark needs only its
module.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The images the renderer drew, by key (``"serve"``: the serve TTFT plot), as page-relative
#: paths, ``None`` where a plot was not drawn.
Images = dict[str, str | None]


# ---------------------------------------------------------------------- table cells
def fmt(v: Any, digits: int = 3) -> str:
    """A table cell: floats to ``digits`` significant digits, booleans as yes/no."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.{digits}g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def md_table(rows: Sequence[dict[str, Any]], columns: Sequence[str],
             headers: Sequence[str] | None = None) -> str:
    """A Markdown table of ``rows`` (missing cells shown as –)."""
    if not rows:
        return "_no rows_\n"
    head = list(headers or columns)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def verdict(met: bool | None) -> str:
    """Cell text of a goal check."""
    return {True: "**met**", False: "**not met**", None: "not measured"}[met]


def num(v: Any) -> float | None:
    """``v`` as a float when it is a number (not a bool), else None."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def min_of(values: Iterable[Any]) -> float | None:
    """The smallest of the numbers among ``values`` (None when there is none)."""
    vals = [x for x in (num(v) for v in values) if x is not None]
    return min(vals) if vals else None


def max_of(values: Iterable[Any]) -> float | None:
    """The largest of the numbers among ``values`` (None when there is none)."""
    vals = [x for x in (num(v) for v in values) if x is not None]
    return max(vals) if vals else None


# ---------------------------------------------------------------------- goals
@dataclass
class Goal:
    """One goal of the issues, checked against this run.

    ``rank`` orders the goal table across section modules (lower first; equal ranks keep
    the order of the modules, then of each module's list).
    """

    goal: str
    source: str
    measured: str
    met: bool | None
    rank: float = field(default=100.0, compare=False)


def check(value: float | None, *, at_least: float | None = None,
          at_most: float | None = None) -> bool | None:
    """Whether ``value`` meets a bound (None when not measured)."""
    if value is None:
        return None
    if at_least is not None:
        return value >= at_least
    assert at_most is not None
    return value <= at_most


# ---------------------------------------------------------------------- sections
def no_goals(res: dict[str, dict[str, Any]]) -> list[Goal]:
    """The goal rows of a section that has none."""
    del res
    return []


@dataclass(frozen=True)
class Section:
    """One benchmark's part of the page.

    Attributes:
        title: the ``##`` heading.
        source: the issue(s) it answers, printed in italics first; None prints nothing.
        order: its place on the page (lower first).
        render: the body, from the benchmark's JSON and the images the renderer drew.
        goals: its rows of the goal table, from every benchmark's JSON (a goal may read
            another benchmark's figures).
        plot: draws the section's own plot, ``(results, path) -> path or None``; the
            renderer hands it to ``render`` as ``images[<benchmark>]``. Without one, a
            module function ``plot_<benchmark>`` is used when there is one.
    """

    title: str
    source: str | None
    order: float
    render: Callable[[dict[str, Any], Images], str]
    goals: Callable[[dict[str, dict[str, Any]]], list[Goal]] = no_goals
    plot: Callable[[dict[str, dict[str, Any]], Path], Path | None] | None = None

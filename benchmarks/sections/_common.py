# SPDX-License-Identifier: Apache-2.0
"""What every section module of the report shares: table cells, goal rows, the section record.

A section module (``sections/<bench>.py``, named after the bench section whose ledger
entries it renders) defines ``SECTION = Section(...)``: its heading, where its goals come
from, its place on the page, the function that renders its body and its goal rows
(:class:`GoalSpec`, each reading its figures from the raw samples of a run). ``render.py``
finds the modules and applies the one rule to every row, so a new benchmark needs only its
module.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    """Cell text of a goal's verdict."""
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
#: The one rule of every goal row: rounds a run needs, and the interval's confidence.
MIN_ROUNDS = 9


@dataclass(frozen=True)
class Measured:
    """What a goal row reads from its run's raw samples.

    Attributes:
        value: the median figure (a ratio of medians, or a difference in ``unit``).
        low: low end of its 95% paired bootstrap interval over the rounds.
        high: high end of it.
        rounds: rounds both sides were measured in (the fewest over the row's points).
        met: whether the whole interval is on the goal's side.
        where: the point that decided the row (``16 blocks``), when it judges several.
        unit: printed after the figures (``" µs"``), empty for a ratio.
    """

    value: float | None
    low: float | None
    high: float | None
    rounds: int
    met: bool
    where: str = ""
    unit: str = ""


@dataclass(frozen=True)
class GoalSpec:
    """One goal row: what is judged, on which section's latest run, against whom.

    Attributes:
        goal: the goal as the table prints it.
        section: the bench section whose latest run the row reads.
        peer: what ours is compared with.
        measure: reads the row's figures from a ledger entry's raw samples; None where the
            section records no samples for it yet (the row then says so, not met).
        config: options the run must have been made with (``{"layers": 64}``), a value or a
            test of the option's value (``{"instances": lambda v: "256" in v.split(",")}``):
            the row reads the latest run of its section with these options, whatever its
            result.
        rank: place in the table (lower first).
        short: the goal in a few words, as the table on top of the page prints it (one
            line a row: the table fits a screen); ``goal`` is printed in full below it.
    """

    goal: str
    section: str
    peer: str
    measure: Callable[[Mapping[str, Any]], Measured | None] | None = None
    config: Mapping[str, Any] = field(default_factory=dict)  # value, or Callable[[Any], bool]
    rank: float = 100.0
    short: str = ""


def medians_by_round(s: Mapping[str, Any]) -> list[float]:
    """Each round's median of a series of raw samples (``ledger.series``)."""
    return [statistics.median(r) for r in s.get("rounds") or [] if r]


def rates_by_round(s: Mapping[str, Any]) -> list[float]:
    """Each round's bytes / median time of a timed series whose tags hold its ``bytes``."""
    nbytes = float((s.get("tags") or {}).get("bytes") or 0)
    return [nbytes / m for m in medians_by_round(s) if m > 0]


def median_cell(values: Sequence[float], scale: float = 1.0) -> str:
    """A figure over rounds (times ``scale``): one round, its value; several, the median
    over the rounds [95% bootstrap interval over the rounds]."""
    from vllm_ascend.distributed.kv_transfer.bench.stats import compare_difference

    vals = [v * scale for v in values]
    if len(vals) < 2:
        return fmt(vals[0]) if vals else "–"
    st = compare_difference(vals, [0.0] * len(vals))
    return f"{fmt(st.ratio)} [{fmt(st.low)}–{fmt(st.high)}]"


def ratio_cell(ours: Sequence[float], peer: Sequence[float]) -> str:
    """``median(ours) / median(peer)`` over paired rounds [95% paired bootstrap interval]."""
    from vllm_ascend.distributed.kv_transfer.bench.stats import compare

    st = compare(list(ours), list(peer))
    if st.ratio is None:
        return "–"
    return fmt(st.ratio) + (f" [{fmt(st.low)}–{fmt(st.high)}]" if st.rounds > 1 else "")


def judged_ratio(ours: Sequence[float], peer: Sequence[float], *,
                 at_least: float | None = None, at_most: float | None = None,
                 where: str = "") -> Measured:
    """``median(ours) / median(peer)`` over paired rounds, its bootstrap interval, and the
    verdict of the rule (whole interval on the right side)."""
    from vllm_ascend.distributed.kv_transfer.bench.stats import compare, verdict

    st = compare(list(ours), list(peer))
    met = verdict(st, at_least=at_least, at_most=at_most)
    return Measured(st.ratio, st.low, st.high, st.rounds, bool(met), where)


def judged_noninferior(ours: Sequence[float], peer: Sequence[float], *, ratio: float = 0.97,
                       low: float = 0.95, where: str = "") -> Measured:
    """Non-inferiority where ours and the peer do the same work through the same code:
    ``median(ours) / median(peer)`` (higher is better) at least ``ratio``, and its interval's
    low end at least ``low``."""
    from vllm_ascend.distributed.kv_transfer.bench.stats import compare

    st = compare(list(ours), list(peer))
    met = st.ratio is not None and st.low is not None and st.ratio >= ratio and st.low >= low
    return Measured(st.ratio, st.low, st.high, st.rounds, met, where)


def judged_difference(ours: Sequence[float], peer: Sequence[float], *, at_most: float,
                      scale: float = 1.0, unit: str = "", where: str = "") -> Measured:
    """``median(ours) - median(peer)`` (times ``scale``) over paired rounds, its bootstrap
    interval; met when the interval's high end is at most ``at_most``."""
    from vllm_ascend.distributed.kv_transfer.bench.stats import compare_difference

    st = compare_difference(list(ours), list(peer))
    k = scale
    value, low, high = (None if v is None else v * k for v in (st.ratio, st.low, st.high))
    met = high is not None and low is not None and high <= at_most
    return Measured(value, low, high, st.rounds, met, where, unit)


def worst(points: Iterable[Measured], *, at_least: bool) -> Measured | None:
    """The point that decides a row over several (sizes, kernels): a point not met first,
    then the one whose interval end lies nearest the bound's side (lowest low end for an
    at-least goal, highest high end for an at-most goal)."""
    pts = [p for p in points if p.value is not None]
    if not pts:
        return None

    def key(p: Measured) -> tuple[int, float]:
        end = (p.low if at_least else -(p.high or 0.0)) or 0.0
        return (int(p.met), end)

    out = min(pts, key=key)
    return Measured(out.value, out.low, out.high, min(p.rounds for p in pts), out.met,
                    out.where, out.unit)


# ---------------------------------------------------------------------- sections
@dataclass(frozen=True)
class Section:
    """One benchmark's part of the page.

    Attributes:
        title: the ``##`` heading.
        source: the issue(s) it answers, printed in italics first; None prints nothing.
        order: its place on the page (lower first).
        render: the body, from the result JSON of the section's run (a ledger entry's
            ``result``) and the images the renderer drew.
        goals: its rows of the goal table (judged on its runs' raw samples).
        plot: draws the section's own plot, ``(results, path) -> path or None``; the
            renderer hands it to ``render`` as ``images[<benchmark>]``. Without one, a
            module function ``plot_<benchmark>`` is used when there is one.
        samples: more of the body, from the whole ledger entry (its raw samples: medians
            over the rounds with their intervals), printed after ``render``'s part.
    """

    title: str
    source: str | None
    order: float
    render: Callable[[dict[str, Any], Images], str]
    goals: tuple[GoalSpec, ...] = ()
    plot: Callable[[dict[str, dict[str, Any]], Path], Path | None] | None = None
    samples: Callable[[Mapping[str, Any]], str] | None = None

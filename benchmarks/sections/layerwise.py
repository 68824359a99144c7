# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench layerwise``: layerwise push against pull, and against the raw engine.

The result's medians are shown as the bench printed them; the run's raw samples (one a round:
request ``i`` of both connectors, their order alternating, and each alternating round of
the push against the raw write of the same bytes) give the medians over the rounds with
their intervals, and the goal row.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ._common import (
    GoalSpec,
    Images,
    Measured,
    Section,
    fmt,
    judged_ratio,
    md_table,
    median_cell,
    medians_by_round,
    num,
    ratio_cell,
)

logger = logging.getLogger(__name__)

#: Connector throughput / the raw write's, same bytes, no compute.
GOAL_RATIO = 0.9


def section_layerwise(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    rows = d.get("rows", [])
    cols = list(dict.fromkeys(k for r in rows for k in r))
    out = (f"{d.get('what', '')}. Pull / layerwise: "
           f"**{fmt(num(d.get('pull_over_layerwise')))}x**; P's forward pass with pushes / "
           f"without: {fmt(num(d.get('layerwise_forward_slowdown')))}x.\n\n"
           + md_table(rows, cols))
    vs = d.get("vs_raw")
    if isinstance(vs, dict):
        out += (f"\n\nAgainst the raw engine: {vs.get('what', '')}. "
                f"{fmt(num(vs.get('bytes')))} bytes: raw {fmt(num(vs.get('raw_ms')))} ms "
                f"({fmt(num(vs.get('raw_GBps')))} GB/s), connector "
                f"{fmt(num(vs.get('connector_ms')))} ms ({fmt(num(vs.get('connector_GBps')))} "
                f"GB/s): connector / raw **{fmt(num(vs.get('ratio')))}**.")
    return out + "\n"


def _rounds(entry: Mapping[str, Any], **tags: Any) -> list[float]:
    """The per-round medians of the entry's one series with ``tags`` (none: empty)."""
    found = [s for s in entry.get("samples") or []
             if all((s.get("tags") or {}).get(k) == v for k, v in tags.items())]
    return medians_by_round(found[0]) if found else []


def samples_layerwise(entry: Mapping[str, Any]) -> str:
    """The raw samples over the rounds: each figure's median [95% bootstrap interval]."""
    lw_ready = _rounds(entry, what="kv_ready", connector="layerwise")
    pull_ready = _rounds(entry, what="kv_ready", connector="pull")
    if not lw_ready and not _rounds(entry, what="bulk", path="raw"):
        return "\nThis run recorded no raw samples (runs before they were kept).\n"
    lw_fwd = _rounds(entry, what="forward", connector="layerwise")
    pull_fwd = _rounds(entry, what="forward", connector="pull")
    raw, conn = _rounds(entry, what="bulk", path="raw"), _rounds(entry, what="bulk",
                                                                  path="connector")
    rows = [{"what": "KV ready after P's forward pass (ms)", "lw": median_cell(lw_ready, 1e3),
             "pull": median_cell(pull_ready, 1e3),
             "ratio": ratio_cell(pull_ready, lw_ready) + " (pull / layerwise)"},
            {"what": "P's forward pass (ms)", "lw": median_cell(lw_fwd, 1e3),
             "pull": median_cell(pull_fwd, 1e3),
             "ratio": ratio_cell(lw_fwd, pull_fwd) + " (with pushes / without)"},
            {"what": "every layer of a request, no compute (ms)", "lw": median_cell(conn, 1e3),
             "pull": "raw write: " + median_cell(raw, 1e3),
             "ratio": ratio_cell(raw, conn) + " (connector / raw throughput)"}]
    return ("\nFrom the raw samples, one a round (request i of both connectors, their order "
            f"alternating: {len(lw_ready)} rounds; push against the raw write: {len(raw)} "
            "rounds): median over the rounds [95% bootstrap interval].\n\n"
            + md_table(rows, ["what", "lw", "pull", "ratio"],
                       ["", "layerwise", "pull", "ratio [95%]"]))


def push_over_raw(entry: Mapping[str, Any]) -> Measured | None:
    """The push's throughput / the raw write's (raw time / connector time of the same bytes,
    paired by round)."""
    raw, conn = _rounds(entry, what="bulk", path="raw"), _rounds(entry, what="bulk",
                                                                  path="connector")
    if not raw or not conn:
        return None
    return judged_ratio(raw, conn, at_least=GOAL_RATIO, where="every layer of a request")


GOALS = (GoalSpec(f"layerwise push >= {GOAL_RATIO} of the raw Mooncake engine (same bytes, no "
                  "compute)", "layerwise", "raw Mooncake write, same bytes", push_over_raw,
                  rank=20, short=f"layerwise push >= {GOAL_RATIO} of raw write"),)


SECTION = Section("Layerwise push vs pull (`bench layerwise`)", "issue 5", 40, section_layerwise,
                  GOALS, samples=samples_layerwise)

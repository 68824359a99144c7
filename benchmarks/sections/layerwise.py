# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench layerwise``: layerwise push against pull, and against the raw engine."""

from __future__ import annotations

import logging
from typing import Any

from ._common import GoalSpec, Images, Section, fmt, md_table, num

logger = logging.getLogger(__name__)

#: The transfer engine's wait, measured (not this run's: its date is in it).
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
    return out


GOALS = (GoalSpec("layerwise push >= 0.9 of the raw Mooncake engine (same bytes, no compute)",
                  "layerwise", "raw Mooncake write, same bytes", rank=20),)


SECTION = Section("Layerwise push vs pull (`bench layerwise`)", "issue 5", 40, section_layerwise,
                  GOALS)

# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench layerwise``: layerwise push against pull, and against the raw engine."""

from __future__ import annotations

import logging
from typing import Any

from ._common import Goal, Images, Section, check, fmt, md_table, num

logger = logging.getLogger(__name__)

#: The transfer engine's wait, measured (not this run's: its date is in it).
WAIT = (
    "\n\n**The transfer engine's wait** (2026-12-05, 15:35 to 15:37 UTC, alone on the "
    "machine; see the p2p section): eight `bench layerwise` runs, the push's and the "
    "pull's wait alternating between Mooncake's spin (`VLLM_ASCEND_KV_TE_WAIT=spin`) and "
    "`yield`, the default over TCP since; the raw write stays Mooncake's synchronous call. "
    "KV ready after P's forward pass, median / p90 of 10 requests: layerwise 1.39–1.50 / "
    "1.52–1.80 ms with `yield` against 1.35–1.51 / 2.43–3.50 ms with `spin`; the pull "
    "20.8–22.1 / 25.5–27.7 ms against 25.0–27.9 / 28.9–35.3 ms. Connector / raw with no "
    "compute: 0.908, 0.938, 0.911 and 0.920 with `yield`, 0.781, 0.875, 0.898 and 0.860 "
    "with `spin`.")


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
    return out + WAIT


def goals(res: dict[str, dict[str, Any]]) -> list[Goal]:
    """Layerwise push >= 0.9 of the raw engine on the same bytes."""
    lw_raw = num((res.get("layerwise", {}).get("vs_raw") or {}).get("ratio"))
    return [Goal("layerwise push connector >= 0.9 of the raw Mooncake engine (same bytes, "
                 "no compute)", "issues 5, 8 (bench layerwise)", fmt(lw_raw),
                 check(lw_raw, at_least=0.9), rank=20)]


SECTION = Section("Layerwise push vs pull (`bench layerwise`)", "issue 5", 40, section_layerwise,
                  goals)

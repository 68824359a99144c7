# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench offload``: host save/load copies against memcpy, and the hit TTFT."""

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
    medians_by_round,
    num,
    rates_by_round,
    worst,
)

logger = logging.getLogger(__name__)


def section_offload(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    method = d.get("bandwidth_method")
    rows = [{**r, **{f"{k}_ratio": _with_spread(r, k) for k in ("save", "load")}}
            for r in d.get("bandwidth", [])]
    out = ["Save/load through the worker's copy path against memcpy of the same bytes"
           + (f" ({method}; each ratio cell: median [min–max])" if method else "") + ":\n\n",
           md_table(rows, ["block_kib", "blocks", "memcpy_gbps", "save_gbps",
                           "load_gbps", "save_ratio", "load_ratio"],
                    ["block KiB", "blocks", "memcpy GB/s", "save GB/s", "load GB/s",
                     "save / memcpy", "load / memcpy"])]
    t = d.get("ttft") or {}
    if "hit_over_recompute" in t:
        out.append(f"\nTTFT of a repeated {t.get('prompt_tokens')}-token prompt ({t.get('dtype')}"
                   f", median of {t.get('repeats')}): host hit "
                   f"{fmt(num(t.get('offload_hit_s')))} s, recompute "
                   f"{fmt(num(t.get('recompute_s')))} s, vLLM's device prefix hit "
                   f"{fmt(num(t.get('device_hit_s')))} s: hit / recompute "
                   f"**{fmt(num(t.get('hit_over_recompute')))}**; first tokens equal: "
                   f"{fmt(t.get('first_token_equal'))}.\n")
    elif t:
        out.append(f"\nTTFT part: {t.get('skipped') or t.get('error')}\n")
    return "".join(out)


def _with_spread(row: dict[str, Any], kind: str) -> str:
    """``median [min–max]`` of save or load over the rounds (the median alone without rounds)."""
    spread = row.get(f"{kind}_spread")
    value = fmt(num(row.get(f"{kind}_ratio")))
    if not isinstance(spread, list) or len(spread) != 2:
        return value
    return f"{value} [{fmt(num(spread[0]))}–{fmt(num(spread[1]))}]"


def copies_over_memcpy(entry: Mapping[str, Any]) -> Measured | None:
    """Save and load throughput / memcpy's at every block size from 64 KiB: each round's
    baseline is the faster of torch's ``copy_`` and libc's ``memmove`` (their rounds'
    medians), as the bench's own ratio; the point whose interval lies lowest decides."""
    by_size: dict[Any, dict[str, Mapping[str, Any]]] = {}
    for s in entry.get("samples") or []:
        tags = s.get("tags") or {}
        by_size.setdefault(tags.get("block_kib"), {})[str(tags.get("role"))] = s
    points = []
    for kib, roles in sorted(by_size.items(), key=lambda kv: num(kv[0]) or 0):
        if (num(kib) or 0) < FROM_KIB or not {"torch", "libc"} <= set(roles):
            continue
        nbytes = float((roles["torch"].get("tags") or {}).get("bytes") or 0)
        memcpy = [nbytes / min(t, c) for t, c in zip(
            medians_by_round(roles["torch"]), medians_by_round(roles["libc"]), strict=False)]
        for kind in ("save", "load"):
            if kind in roles:
                points.append(judged_ratio(rates_by_round(roles[kind]), memcpy,
                                           at_least=GOAL_RATIO, where=f"{kind}, {kib} KiB"))
    return worst(points, at_least=True)


GOAL_RATIO, FROM_KIB = 0.8, 64
GOALS = (GoalSpec(f"offload save/load >= {GOAL_RATIO} of memcpy from {FROM_KIB} KiB blocks",
                  "offload", "memcpy of the same bytes", copies_over_memcpy, rank=45,
                  short=f"offload save/load >= {GOAL_RATIO} of memcpy"),)


SECTION = Section("CPU offload copies (`bench offload`)", "issue 7", 70, section_offload, GOALS)

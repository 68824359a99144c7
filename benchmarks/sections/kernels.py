# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench kernels``: KV block gather/scatter against memcpy."""

from __future__ import annotations

import logging
from typing import Any

from ._common import Goal, Images, Section, check, fmt, md_table, min_of, num

logger = logging.getLogger(__name__)


KERNELS = ("gather", "scatter", "gather_layers", "scatter_layers")


def _with_spread(row: dict[str, Any], key: str) -> str:
    """``median [min–max]`` of a kernel's rounds (the median alone for results without rounds)."""
    spread = (row.get("spread") or {}).get(key)
    if not isinstance(spread, list) or len(spread) != 2:
        return fmt(num(row.get(key)))
    return f"{fmt(num(row.get(key)))} [{fmt(num(spread[0]))}–{fmt(num(spread[1]))}]"


def section_kernels(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    g = d.get("goal", {})
    cfg = d.get("config", {})
    rows = [{**r, **{k: _with_spread(r, k) for k in KERNELS if k in r}}
            for r in d.get("results", [])]
    rounds = "Each cell: median of the rounds [min–max]. " if cfg.get("rounds") else ""
    return (f"Baseline: {cfg.get('baseline', 'memcpy')}; ratio = "
            f"{cfg.get('ratio', 'kernel / baseline')}. {rounds}Goal: the median >= "
            f"{g.get('min_ratio')} at every block size from {g.get('from_block_kib')} KiB, "
            f"gather and scatter, one layer and all layers ({_worst_text(g)}).\n\n"
            + md_table(rows, ["block_kib", "blocks", "memcpy_gbps", *KERNELS],
                       ["block KiB", "blocks", "memcpy GB/s", "gather / memcpy",
                        "scatter / memcpy", "gather all layers", "scatter all layers"]))


def _worst_text(goal: dict[str, Any]) -> str:
    """``worst 0.91 [0.8–1.0] (scatter, 64 KiB)``, or just the worst median."""
    text = f"worst {fmt(num(goal.get('worst_ratio')))}"
    p = goal.get("worst_point")
    if isinstance(p, dict):
        text += (f" [{fmt(num(p.get('min')))}–{fmt(num(p.get('max')))}] ({p.get('kernel')}, "
                 f"{p.get('block_kib')} KiB)")
    return text


def goals(res: dict[str, dict[str, Any]]) -> list[Goal]:
    """Kernels >= 0.8 of memcpy from 64 KiB blocks, one layer and all layers (medians)."""
    d = res.get("kernels", {})
    kr = [r for r in d.get("results") or [] if (num(r.get("block_kib")) or 0) >= 64]
    kworst = min_of([r.get(k) for r in kr for k in KERNELS])
    measured = f"worst {fmt(kworst)}" if kr else "–"
    point = (d.get("goal") or {}).get("worst_point")
    if kr and isinstance(point, dict) and num(point.get("median")) == kworst:
        rounds = (d.get("config") or {}).get("rounds")
        measured = _worst_text({"worst_ratio": kworst, "worst_point": point})
        measured += f", median of {rounds} rounds" if rounds else ""
    return [Goal("kernels gather/scatter (one layer and all layers) >= 0.8 of memcpy "
                 "from 64 KiB blocks",
                 "issue 3 (bench kernels)", measured,
                 check(kworst, at_least=0.8), rank=40)]

SECTION = Section("KV block kernels (`bench kernels`)", "issue 3", 20, section_kernels, goals)

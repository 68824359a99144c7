# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench kernels``: KV block gather/scatter against memcpy."""

from __future__ import annotations

import logging
from typing import Any

from ._common import Goal, Images, Section, check, fmt, md_table, min_of, num

logger = logging.getLogger(__name__)


def section_kernels(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    g = d.get("goal", {})
    return (f"Baseline: {d.get('config', {}).get('baseline', 'memcpy')}; ratio = "
            f"{d.get('config', {}).get('ratio', 'kernel / baseline')}. Goal: >= "
            f"{g.get('min_ratio')} from {g.get('from_block_kib')} KiB (worst "
            f"{fmt(num(g.get('worst_ratio')))}).\n\n"
            + md_table(d.get("results", []), ["block_kib", "blocks", "memcpy_gbps", "gather",
                                               "scatter", "gather_layers", "scatter_layers"],
                       ["block KiB", "blocks", "memcpy GB/s", "gather / memcpy",
                        "scatter / memcpy", "gather all layers", "scatter all layers"]))


def goals(res: dict[str, dict[str, Any]]) -> list[Goal]:
    """Kernels >= 0.8 of memcpy from 64 KiB blocks, one layer and all layers."""
    kr = [r for r in res.get("kernels", {}).get("results") or []
          if (num(r.get("block_kib")) or 0) >= 64]
    kworst = min_of([r.get(k) for r in kr
                     for k in ("gather", "scatter", "gather_layers", "scatter_layers")])
    return [Goal("kernels gather/scatter (one layer and all layers) >= 0.8 of memcpy "
                 "from 64 KiB blocks",
                 "issue 3 (bench kernels)", f"worst {fmt(kworst)}" if kr else "–",
                 check(kworst, at_least=0.8), rank=40)]


SECTION = Section("KV block kernels (`bench kernels`)", "issue 3", 20, section_kernels, goals)

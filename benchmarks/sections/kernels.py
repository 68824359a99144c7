# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench kernels``: KV block gather/scatter against memcpy."""

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
    num,
    rates_by_round,
    worst,
)

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
    cfg = d.get("config", {})
    rows = [{**r, **{k: _with_spread(r, k) for k in KERNELS if k in r}}
            for r in d.get("results", [])]
    rounds = "Each cell: median of the rounds [min–max]. " if cfg.get("rounds") else ""
    return (f"Baseline: {cfg.get('baseline', 'memcpy')}; ratio = "
            f"{cfg.get('ratio', 'kernel / baseline')}. {rounds}\n\n"
            + md_table(rows, ["block_kib", "blocks", "memcpy_gbps", *KERNELS],
                       ["block KiB", "blocks", "memcpy GB/s", "gather / memcpy",
                        "scatter / memcpy", "gather all layers", "scatter all layers"]))


def kernels_over_memcpy(entry: Mapping[str, Any]) -> Measured | None:
    """Each kernel's throughput / memcpy's (the rounds' median call times, paired by round)
    at every block size from 64 KiB, one layer and all layers; the point whose interval
    lies lowest decides."""
    series = entry.get("samples") or []
    points = []
    for s in series:
        tags = s.get("tags") or {}
        if tags.get("role") != "kernel" or tags.get("kernel") not in KERNELS \
                or (num(tags.get("block_kib")) or 0) < FROM_KIB:
            continue
        base = [b for b in series if (b.get("tags") or {}) == {
            **tags, "role": "baseline", "bytes": (b.get("tags") or {}).get("bytes")}]
        if base:
            points.append(judged_ratio(rates_by_round(s), rates_by_round(base[0]),
                                       at_least=GOAL_RATIO,
                                       where=f"{tags['kernel']}, {tags['block_kib']} KiB"))
    return worst(points, at_least=True)


GOAL_RATIO, FROM_KIB = 0.8, 64
GOALS = (GoalSpec(f"KV block gather/scatter (one layer and all layers) >= {GOAL_RATIO} of "
                  f"memcpy from {FROM_KIB} KiB blocks", "kernels", "memcpy of the same bytes",
                  kernels_over_memcpy, rank=40,
                  short=f"gather/scatter >= {GOAL_RATIO} of memcpy"),)


SECTION = Section("KV block kernels (`bench kernels`)", "issue 3", 20, section_kernels, GOALS)

# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench trace``: the Mooncake trace replayed against pool capacity."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ._common import Images, Section, fmt, md_table, num

logger = logging.getLogger(__name__)


def section_trace(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    cfg = d.get("config", {})
    ub = d.get("unbounded", {})
    return (f"Replay of `{Path(str(cfg.get('trace', '?'))).name}`: {cfg.get('requests')} "
            f"requests, {cfg.get('unique_blocks')} distinct blocks of "
            f"{cfg.get('tokens_per_block')} tokens ({cfg.get('block_bytes')} bytes each here). "
            f"Best possible hit rate (unbounded pool): {fmt(num(ub.get('hit_rate')))}.\n\n"
            + md_table(d.get("rows", []), ["capacity_fraction", "capacity_blocks", "hit_rate",
                                            "best_hit_rate", "vs_best", "requests/s"],
                       ["capacity (fraction)", "capacity (blocks)", "hit rate",
                        "unbounded", "hit / best", "requests/s"]))


SECTION = Section("Trace replay (`bench trace`)", "issue 6", 60, section_trace)

# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench p2p``: the P/D pull connector against the raw transfer engine."""

from __future__ import annotations

import logging
from typing import Any

from ._common import Goal, Images, Section, check, fmt, md_table, min_of, num

logger = logging.getLogger(__name__)


def section_p2p(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    return (f"{d.get('description', '')}. Goal: {d.get('goal', '')}.\n\n"
            + md_table(d.get("results", []), ["blocks", "bytes", "raw_GBps", "connector_GBps",
                                               "ratio", "raw_ms", "connector_ms"],
                       ["blocks", "bytes", "raw GB/s", "connector GB/s",
                        "connector / raw", "raw ms", "connector ms"]))


def goals(res: dict[str, dict[str, Any]]) -> list[Goal]:
    """Pull connector >= 0.9 of the raw engine at every block count."""
    p2p = res.get("p2p", {}).get("results") or []
    worst = min_of(r.get("ratio") for r in p2p)
    return [Goal("P/D pull connector transfer >= 0.9 of the raw Mooncake engine",
                 "issue 4 (bench p2p)",
                 ", ".join(f"{r.get('blocks')} blocks: {fmt(num(r.get('ratio')))}"
                           for r in p2p) or "–",
                 check(worst, at_least=0.9), rank=10)]


SECTION = Section("P/D pull connector vs raw engine (`bench p2p`)", "issue 4", 30, section_p2p,
                  goals)

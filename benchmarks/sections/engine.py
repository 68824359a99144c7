# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench engine``: the raw transfer engine, the ceiling of the connectors."""

from __future__ import annotations

import logging
from typing import Any

from ._common import Images, Section, md_table

logger = logging.getLogger(__name__)


def section_engine(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    cfg = d.get("config", {})
    out = [f"{d.get('description', '')}. Protocol `{cfg.get('protocol')}` on "
           f"{cfg.get('host')}, {cfg.get('min_time_s')} s per point; data checked byte for "
           f"byte for block sizes {d.get('verified')} KiB.\n",
           "Ceiling per block size (the best point of the sweep):\n",
           md_table(d.get("best", []), ["op", "block_kib", "batch", "concurrency", "GBps",
                                         "p50_ms", "p99_ms"],
                    ["op", "block KiB", "batch", "threads", "GB/s", "p50 ms", "p99 ms"]),
           "\n<details><summary>The whole sweep</summary>\n\n",
           md_table(d.get("rows", []), ["op", "block_kib", "batch", "concurrency", "GBps",
                                         "p50_ms", "p99_ms"],
                    ["op", "block KiB", "batch", "threads", "GB/s", "p50 ms", "p99 ms"]),
           "\n</details>\n"]
    return "".join(out)


SECTION = Section("Transfer engine alone (`bench engine`)", "the ceiling", 10, section_engine)

# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench pool``: pool backends against raw calls, and the lookup rate."""

from __future__ import annotations

import logging
from typing import Any

from ._common import GoalSpec, Images, Section, md_table

logger = logging.getLogger(__name__)


def section_pool(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    rows = d.get("rows", [])
    tput = [r for r in rows if "ratio" in r]
    look = [r for r in rows if "keys/s" in r]
    out = ["Put/get through the backend against the raw calls on the same data (local: a "
           "numpy copy; mooncake: `MooncakeDistributedStore` batch calls), same run.\n\n",
           md_table(tput, ["path", "GiB/s", "raw GiB/s", "ratio", "ratio_min", "ratio_max"],
                    ["path", "GiB/s", "raw GiB/s", "backend / raw", "min", "max"]),
           (f"\nLocal rows: median of {d.get('config', {}).get('local_rounds')} alternating "
            "rounds (ours, then the copy), with the rounds' min and max. `put (empty pool)` "
            "is compared with a copy into freshly allocated memory, `put (full pool)` (every "
            "put evicts as much as it writes) and `get` with a copy into memory touched "
            "before. The copy is one `numpy.copyto` (one thread); the backend splits a call "
            f"over {d.get('config', {}).get('local_copy_threads', 1)} copy thread(s) "
            "(`local_copy_threads`).\n\n"
            + _copy_note(d) + "\n"
            if d.get("local_rounds") else ""),
           "\nLookup rate (goal >= 100k keys/s):\n\n",
           md_table(look, ["path", "keys/s"])]
    if isinstance(d.get("mooncake"), dict) and d["mooncake"].get("skipped"):
        out.append(f"\nMooncake part skipped: {d['mooncake']['skipped']}\n")
    return "".join(out)


def _copy_note(d: dict[str, Any]) -> str:
    """How this machine's glibc copies large ranges, which decides the copy's speed."""
    facts = (d.get("machine") or {}).get("memcpy") or {}
    cfg = d.get("config") or {}
    nt = facts.get("non_temporal_threshold")
    out = ("How the copies compare: glibc's `memcpy` writes a range longer than its "
           "non-temporal threshold with stores that bypass the cache, about twice as fast "
           "into memory that is not cached. The plain copy is one range of the whole batch; "
           "the backend lays a batch's slots out region by region, so a region's consecutive "
           "blocks are one range too (cut at a batch of the pool's puts and between its copy "
           "threads), not one per block "
           f"({_mib(cfg.get('range_bytes'))} here). ")
    if isinstance(nt, int):
        out += (f"On this machine (glibc {facts.get('glibc', '?')}) the threshold is "
                f"{_mib(nt)}, derived from the {_mib(facts.get('shared_cache_size'))} of "
                "shared cache the CPU reports, so virtual machines of one kind can differ. ")
    else:
        out += "This machine's threshold was not recorded. "
    low = d.get("local_low_nt") or {}
    if low.get("threshold"):
        out += (f"The rows `non-temporal from {low['threshold'] >> 20} MiB` are the same "
                "rounds in a child process with glibc's threshold set there "
                "(`GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold`), a common value on "
                "hosts. ")
    elif low.get("skipped"):
        out += f"The rounds with a lower threshold were not measured: {low['skipped']}. "
    return out


def _mib(n: Any) -> str:
    return f"{n / (1 << 20):.4g} MiB" if isinstance(n, int | float) else "?"


GOALS = (
    GoalSpec("pool put/get through the backend >= 0.9 of raw Store calls", "pool",
             "raw Mooncake Store put/get", rank=30),
    GoalSpec("embedded `local` backend put/get >= 0.9 of a plain copy", "pool",
             "a plain copy of the same bytes", rank=31),
    GoalSpec("pool lookups >= 100k keys/s batched", "pool", "(absolute)", rank=50),
)


SECTION = Section("KV pool backends (`bench pool`)", "issue 6", 50, section_pool, GOALS)

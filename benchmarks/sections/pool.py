# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench pool``: pool backends against raw calls, and the lookup rate."""

from __future__ import annotations

import logging
from typing import Any

from ._common import Goal, Images, Section, check, fmt, md_table, min_of, num

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
    out += ("Before the region-by-region layout the backend copied block by block: with the "
            "threshold at 4 MiB a put into a full pool was 0.64 of the copy and a get 0.92 "
            "(2026-12-03, same bench, 9 rounds).")
    return out


def _mib(n: Any) -> str:
    return f"{n / (1 << 20):.4g} MiB" if isinstance(n, int | float) else "?"


def goals(res: dict[str, dict[str, Any]]) -> list[Goal]:
    """Backend put/get >= 0.9 of raw Store calls; lookups >= 100k keys/s."""
    pool_rows = res.get("pool", {}).get("rows") or []
    mc = [r for r in pool_rows if str(r.get("path", "")).startswith("mooncake ")
          and "ratio" in r]
    lk = [r for r in pool_rows if "keys/s" in r]
    local = [r for r in pool_rows if str(r.get("path", "")).startswith("local ")
             and "ratio" in r]
    return [
        Goal("embedded `local` backend put and get >= 0.9 of a plain copy of the same bytes "
             "(median of alternating rounds)", "issue 17 (bench pool)",
             ", ".join(f"{r['path']}: {fmt(num(r.get('ratio')))}"
                       + (f" ({fmt(num(r.get('ratio_min')))}–{fmt(num(r.get('ratio_max')))})"
                          if "ratio_min" in r else "") for r in local) or "–",
             check(min_of(r.get("ratio") for r in local), at_least=0.9), rank=31),
        Goal("pool put/get through the backend >= 0.9 of raw Mooncake Store calls",
             "issue 6 (bench pool)",
             ", ".join(f"{r['path']}: {fmt(num(r.get('ratio')))}" for r in mc) or "–",
             check(min_of(r.get("ratio") for r in mc), at_least=0.9), rank=30),
        Goal("pool lookups >= 100k keys/s batched", "issue 6 (bench pool)",
             ", ".join(f"{r['path']}: {fmt(num(r['keys/s']))}" for r in lk) or "–",
             check(min_of(r.get("keys/s") for r in lk), at_least=100_000), rank=60),
    ]


SECTION = Section("KV pool backends (`bench pool`)", "issue 6", 50, section_pool, goals)

# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench pool``: pool backends against raw calls, and the lookup rate.

The result's rows are shown as the bench printed them; the run's raw samples (every call of
every alternating round: the backend beside the raw call or copy of the same bytes, and the
lookups) give the ratios over the rounds with their paired bootstrap intervals, and the
goal rows.
"""

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
    median_cell,
    medians_by_round,
    rates_by_round,
    ratio_cell,
    worst,
)

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


def _pairs(entry: Mapping[str, Any], prefix: str) -> list[tuple[str, Any, Any]]:
    """``(path, backend series, baseline series)`` of the paths starting with ``prefix``."""
    by = {(str((s.get("tags") or {}).get("path")), (s.get("tags") or {}).get("role")): s
          for s in entry.get("samples") or []}
    return [(path, by[path, "backend"], by[path, "baseline"]) for path, role in sorted(by)
            if role == "backend" and str(path).startswith(prefix) and (path, "baseline") in by]


def _over_baseline(entry: Mapping[str, Any], prefix: str) -> Measured | None:
    """Backend throughput / the baseline's (baseline time / backend time, paired by round)
    on every path of ``prefix``; the path whose interval lies lowest decides."""
    return worst([judged_ratio(medians_by_round(base), medians_by_round(ours),
                               at_least=GOAL_RATIO, where=path)
                  for path, ours, base in _pairs(entry, prefix)], at_least=True)


def store_over_raw(entry: Mapping[str, Any]) -> Measured | None:
    """Mooncake backend put/get against the raw Store batch calls."""
    return _over_baseline(entry, "mooncake ")


def local_over_copy(entry: Mapping[str, Any]) -> Measured | None:
    """The ``local`` backend's put (empty and full pool) and get against a plain copy, with
    this machine's glibc and with the lower non-temporal threshold."""
    return _over_baseline(entry, "local ")


def _lookups(entry: Mapping[str, Any]) -> list[tuple[str, list[float]]]:
    out = []
    for s in entry.get("samples") or []:
        tags = s.get("tags") or {}
        if tags.get("role") == "lookup" and tags.get("keys"):
            out.append((str(tags.get("path")),
                        rates_by_round({**s, "tags": {"bytes": tags["keys"]}})))
    return out


def lookup_rate(entry: Mapping[str, Any]) -> Measured | None:
    """keys/s of each batched lookup path, the median over the rounds with its bootstrap
    interval; met when the interval's low end is at least the goal on every path."""
    from vllm_ascend.distributed.kv_transfer.bench.stats import compare_difference

    points = []
    for path, rates in _lookups(entry):
        st = compare_difference(rates, [0.0] * len(rates))
        points.append(Measured(st.ratio, st.low, st.high, st.rounds,
                               st.low is not None and st.low >= LOOKUP_KEYS_S, path,
                               " keys/s"))
    return worst(points, at_least=True)


def samples_pool(entry: Mapping[str, Any]) -> str:
    """Ratios over the rounds from the raw samples, and the lookup rates."""
    pairs = _pairs(entry, "")
    if not pairs:
        return "\nThis run recorded no raw samples (runs before they were kept).\n"
    rows = [{"path": path, "rounds": len(ours.get("rounds") or []),
             "ratio": ratio_cell(medians_by_round(base), medians_by_round(ours))}
            for path, ours, base in pairs]
    look = [{"path": path, "rounds": len(rates), "rate": median_cell(rates)}
            for path, rates in _lookups(entry)]
    return ("\nFrom the raw samples: backend throughput / the raw call's or copy's of the "
            "same bytes, median over the alternating rounds [95% paired bootstrap "
            "interval]; lookups in keys/s, median [95% bootstrap interval] "
            f"(goal >= {fmt(LOOKUP_KEYS_S)}).\n\n"
            + md_table(rows, ["path", "rounds", "ratio"], ["path", "rounds", "backend / raw"])
            + ("\n" + md_table(look, ["path", "rounds", "rate"], ["path", "rounds", "keys/s"])
               if look else ""))


GOAL_RATIO, LOOKUP_KEYS_S = 0.9, 100_000.0
GOALS = (
    GoalSpec(f"pool put/get through the backend >= {GOAL_RATIO} of raw Store calls", "pool",
             "raw Mooncake Store put/get", store_over_raw, rank=30,
             short=f"pool backend >= {GOAL_RATIO} of raw Store calls"),
    GoalSpec(f"embedded `local` backend put/get >= {GOAL_RATIO} of a plain copy", "pool",
             "a plain copy of the same bytes", local_over_copy, rank=31,
             short=f"`local` put/get >= {GOAL_RATIO} of a copy"),
    GoalSpec("pool lookups >= 100k keys/s batched", "pool", "(absolute)", lookup_rate,
             rank=50, short="pool lookups >= 100k keys/s"),
)


SECTION = Section("KV pool backends (`bench pool`)", "issue 6", 50, section_pool, GOALS,
                  samples=samples_pool)

# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench p2p``: the P/D pull connector against the raw transfer engine."""

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
    judged_difference,
    judged_ratio,
    md_table,
    medians_by_round,
    num,
    worst,
)

logger = logging.getLogger(__name__)


def _with_spread(row: dict[str, Any], key: str = "ratio") -> str:
    """``median [min–max]`` of the rounds' ratios, then ``(95%: low–high)``, the bootstrap
    interval over the rounds (the ratio alone for results without rounds)."""
    lo, hi = num(row.get(f"{key}_min")), num(row.get(f"{key}_max"))
    if lo is None or hi is None:
        return fmt(num(row.get(key)))
    out = f"{fmt(num(row.get(key)))} [{fmt(lo)}–{fmt(hi)}]"
    blo, bhi = num(row.get(f"{key}_low")), num(row.get(f"{key}_high"))
    if blo is not None and bhi is not None:
        out += f" (95%: {fmt(blo)}–{fmt(bhi)})"
    return out


def _inline(row: dict[str, Any]) -> dict[str, str]:
    """``ratio_inline`` as ``median (95%: low–high)`` where the run has it."""
    if num(row.get("ratio_inline")) is None:
        return {}
    out = fmt(num(row.get("ratio_inline")))
    lo, hi = num(row.get("ratio_inline_low")), num(row.get("ratio_inline_high"))
    if lo is not None and hi is not None:
        out += f" (95%: {fmt(lo)}–{fmt(hi)})"
    return {"ratio_inline": out}


def section_p2p(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    rows = [{**r, "ratio": _with_spread(r), **_inline(r)} for r in d.get("results", [])]
    columns = ["blocks", "bytes", "raw_GBps", "connector_GBps", "ratio", "raw_ms",
               "connector_ms"]
    names = ["blocks", "bytes", "raw GB/s", "connector GB/s", "connector / raw", "raw ms",
             "connector ms"]
    modes = [k for k in ("ratio_ahead", "ratio_overlapped", "ratio_claims_first",
                         "ratio_inline")
             if any(k in r for r in rows) and d.get("claim_mode") != k[len("ratio_"):]]
    rounds = d.get("rounds")
    spread = (f"connector / raw: median of {rounds} rounds [min–max] (95%: the paired bootstrap "
              "interval over the rounds of the ratio of their median times, which decides the "
              "goal); the other ways of claiming, medians of the same rounds: ahead (D's "
              "scheduler claims when it first sees the request, P's params without a read "
              "window), and the worker's own claims (no claim sent ahead by D's scheduler), "
              "overlapped with the read or before it. " if rounds else "")
    if any("ratio_inline" in r for r in rows):
        spread += ("`inline`: window loads with `inline_reads` on (the read goes out from "
                   "`start_load_kv` and its end is polled, no pull thread), median of the "
                   "same rounds (95%: its bootstrap interval). ")
    unclaimed = ["window_reads"] if any("window_reads" in r for r in rows) else []
    if unclaimed:
        spread += ("`unclaimed`: the share of the window loads D trusted without a claim (the "
                   "others ended after P's read window and were claimed after the read). ")
    out = (f"{d.get('description', '')}. {spread}Goal: {d.get('goal', '')}.\n\n"
           + md_table(rows, columns + modes + unclaimed,
                      names + [m.replace("ratio_", "").replace("_", " ") for m in modes]
                      + ["unclaimed"] * len(unclaimed)))
    keyed = [{**r, "keyed_vs_plain": _with_spread(r, "keyed_vs_plain")}
             for r in d.get("results", []) if "keyed_ms" in r]
    if keyed:
        units = any("keyed_raw_ms" in r for r in keyed)
        out += ("\nWith a deployment key (every side-channel frame sealed and checked, the "
                "claim carrying the request's token, P's regions coming with the grant): a "
                "second P and D pair whose loads alternate with the plain pair's in the same "
                "rounds; `plain / keyed` is the plain connector's time over the keyed one's"
                + (", each in units of its own pair's raw read of the same ranges, timed in "
                   "the same rounds (two P processes read at different speeds: one pair's raw "
                   "read measured up to 15% slower than the other's, and its connector "
                   "followed it), " if units else ", ")
                + "median of the rounds [min–max] (95%: bootstrap interval) (1.0: the key "
                "costs nothing)" + ("; `in time`: the same without the units" if units else "")
                + ":\n\n"
                + md_table(keyed, ["blocks", "connector_ms", "keyed_ms"]
                           + (["keyed_raw_ms"] if units else []) + ["keyed_vs_plain"]
                           + (["keyed_vs_plain_time"] if units else []),
                           ["blocks", "plain ms", "keyed ms"]
                           + (["keyed pair's raw ms"] if units else []) + ["plain / keyed"]
                           + (["in time"] if units else [])))
    return out


def _series(entry: Mapping[str, Any], blocks: int, path: str) -> Mapping[str, Any] | None:
    found = [s for s in entry.get("samples") or []
             if (s.get("tags") or {}).get("blocks") == blocks
             and (s.get("tags") or {}).get("path") == path]
    return found[0] if found else None


def _sizes(entry: Mapping[str, Any]) -> list[int]:
    blocks = ((s.get("tags") or {}).get("blocks") for s in entry.get("samples") or [])
    return sorted({int(b) for b in blocks if b is not None})


def fixed_cost(entry: Mapping[str, Any]) -> Measured | None:
    """The connector's load minus the raw read of the same bytes at 1 block (µs), round by
    round (each round's median load against its median raw read)."""
    conn, raw = _series(entry, 1, DEFAULT_PATH), _series(entry, 1, "raw")
    if conn is None or raw is None:
        return None
    return judged_difference(medians_by_round(conn), medians_by_round(raw),
                             at_most=FIXED_COST_US, scale=1e6, unit=" µs", where="1 block")


def connector_over_raw(entry: Mapping[str, Any]) -> Measured | None:
    """Connector throughput / raw read throughput from 16 blocks (raw time / connector time
    of the rounds' medians), the size whose interval lies lowest deciding."""
    points = []
    for n in _sizes(entry):
        conn, raw = _series(entry, n, DEFAULT_PATH), _series(entry, n, "raw")
        if n >= FROM_BLOCKS and conn is not None and raw is not None:
            points.append(judged_ratio(medians_by_round(raw), medians_by_round(conn),
                                       at_least=0.9, where=f"{n} block{'s' if n != 1 else ''}"))
    return worst(points, at_least=True)


def keyed_speed(entry: Mapping[str, Any]) -> Measured | None:
    """Plain / keyed connector time, each in units of its own pair's raw read, at every
    size (a keyed run, ``--auth``)."""
    points = []
    for n in _sizes(entry):
        ser = [_series(entry, n, k) for k in (DEFAULT_PATH, "raw", "keyed", "raw_keyed")]
        if any(x is None for x in ser):
            continue
        conn, raw, keyed, raw_keyed = (medians_by_round(x) for x in ser if x is not None)
        points.append(judged_ratio([c / r for c, r in zip(conn, raw, strict=True)],
                                   [k / r for k, r in zip(keyed, raw_keyed, strict=True)],
                                   at_least=0.9, where=f"{n} block{'s' if n != 1 else ''}"))
    return worst(points, at_least=True)


#: The re-posed goals (issue 54): a fixed cost per load, and the ratio from 16 blocks.
FIXED_COST_US, FROM_BLOCKS, DEFAULT_PATH = 50.0, 16, "window"
RAW = "raw Mooncake read, same bytes"
GOALS = tuple(
    goal for layers, rank in ((8, 10), (64, 11)) for goal in (
        GoalSpec(f"pull fixed cost per load at 1 block, {layers} layers <= "
                 f"{FIXED_COST_US:g} µs", "p2p", RAW, fixed_cost, {"layers": layers}, rank,
                 f"pull fixed cost, {layers} layers <= {FIXED_COST_US:g} µs"),
        GoalSpec(f"pull connector / raw >= 0.9 from {FROM_BLOCKS} blocks, {layers} layers",
                 "p2p", RAW, connector_over_raw, {"layers": layers}, rank + 0.5,
                 f"pull / raw >= 0.9 from {FROM_BLOCKS} blocks, {layers} layers"))
) + (GoalSpec("a deployment key keeps the pull's speed: plain / keyed >= 0.9 at every size "
              "(8 layers, `--auth`)", "p2p", "the pull without a key", keyed_speed,
              {"layers": 8, "auth": True}, 12,
              "pull with a key >= 0.9 of without"),)


SECTION = Section("P/D pull connector vs raw engine (`bench p2p`)", "issues 4, 54", 30,
                  section_p2p, GOALS)

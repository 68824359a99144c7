# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench p2p``: the P/D pull connector against the raw transfer engine."""

from __future__ import annotations

import logging
from typing import Any

from ._common import Goal, Images, Section, check, fmt, md_table, min_of, num

logger = logging.getLogger(__name__)


def _with_spread(row: dict[str, Any]) -> str:
    """``median [min–max]`` of the rounds' ratios (the ratio alone for results without
    rounds)."""
    lo, hi = num(row.get("ratio_min")), num(row.get("ratio_max"))
    if lo is None or hi is None:
        return fmt(num(row.get("ratio")))
    return f"{fmt(num(row.get('ratio')))} [{fmt(lo)}–{fmt(hi)}]"


def section_p2p(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    rows = [{**r, "ratio": _with_spread(r)} for r in d.get("results", [])]
    columns = ["blocks", "bytes", "raw_GBps", "connector_GBps", "ratio", "raw_ms",
               "connector_ms"]
    names = ["blocks", "bytes", "raw GB/s", "connector GB/s", "connector / raw", "raw ms",
             "connector ms"]
    modes = [k for k in ("ratio_overlapped", "ratio_claims_first")
             if any(k in r for r in rows)]
    rounds = d.get("rounds")
    spread = (f"connector / raw: median of {rounds} rounds [min–max]; the worker's own claims "
              "(no claim sent ahead by D's scheduler), overlapped with the read or before it: "
              "medians of the same rounds. " if rounds else "")
    out = (f"{d.get('description', '')}. {spread}Goal: {d.get('goal', '')}.\n\n"
           + md_table(rows, columns + modes,
                      names + [m.replace("ratio_", "").replace("_", " ") for m in modes]))
    keyed = [{**r, "ratio": _with_spread(r)} for r in d.get("keyed_results", [])]
    if keyed:
        out += ("\nWith a deployment key (every side-channel frame sealed and checked, the "
                "claim carrying the request's token, P's regions coming with the grant), "
                "measured in the same run after the plain phase; `keyed / plain` divides the "
                "two phases' connector / raw medians:\n\n"
                + md_table(keyed, ["blocks", "ratio", "raw_ms", "connector_ms", "vs_unkeyed"],
                           ["blocks", "connector / raw, keyed", "raw ms", "connector ms",
                            "keyed / plain"]))
    return out


def goals(res: dict[str, dict[str, Any]]) -> list[Goal]:
    """Pull connector >= 0.9 of the raw engine at every block count: with rounds, met only
    when every block count's whole min–max is at or above it."""
    d = res.get("p2p", {})
    p2p = d.get("results") or []
    rounds = d.get("rounds")
    spread = bool(rounds) and all(num(r.get("ratio_min")) is not None for r in p2p)
    worst = min_of(r.get("ratio_min" if spread else "ratio") for r in p2p)
    measured = ", ".join(f"{r.get('blocks')} blocks: {_with_spread(r)}" for r in p2p) or "–"
    if p2p and spread:
        measured += f" (median [min–max] of {rounds} rounds)"
    out = [Goal("P/D pull connector transfer >= 0.9 of the raw Mooncake engine",
                "issue 4 (bench p2p)", measured, check(worst, at_least=0.9), rank=10)]
    keyed = d.get("keyed_results") or []
    if keyed:
        cost = min_of(r.get("vs_unkeyed") for r in keyed)
        out.append(Goal("a deployment key keeps the pull connector's ratio to the raw engine "
                        "(keyed / plain >= 0.9 at every block count)", "issue 19 (bench p2p)",
                        ", ".join(f"{r.get('blocks')} blocks: {fmt(num(r.get('vs_unkeyed')))}"
                                  for r in keyed), check(cost, at_least=0.9), rank=11))
    return out


SECTION = Section("P/D pull connector vs raw engine (`bench p2p`)", "issue 4", 30, section_p2p,
                  goals)

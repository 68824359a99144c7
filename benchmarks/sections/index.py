# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench index``: the proxy's prefix indexes against the blocks they track
(10^5 to 10^7): resident memory a block, ``BlockStored`` and ``BlockRemoved`` ingest through
the proxy's subscriber, the ``kv_aware`` routing lookup, and the shared pool index's bound
(``bench/index.py`` says what is driven and how).

Every figure is read from the run's raw samples: per size, each round's batch times (a rate
is the blocks of a batch over the round's median batch time) and lookup times; per pool
round, what the pool index held after twice its bound was stored. A figure over rounds is
the median of the rounds' figures with a 95% bootstrap interval over the rounds; a ratio of
two sizes pairs their rounds (the sizes are measured in turns).
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
    num,
    ratio_cell,
)

logger = logging.getLogger(__name__)

#: Issue 53's goal "index memory bounded and stated": a routing lookup with the most blocks
#: tracked (10^7) may cost at most LOOKUP_GROWTH_MAX times the one with the fewest (10^5).
LOOKUP_GROWTH_MAX = 2.0
FEWEST, MOST = 100_000, 10_000_000
Key = tuple[int, str]  # blocks tracked, metric


def instance_series(entry: Mapping[str, Any]) -> dict[Key, Mapping[str, Any]]:
    """Each (blocks tracked, metric)'s series of the per-instance index."""
    out: dict[Key, Mapping[str, Any]] = {}
    for s in entry.get("samples") or []:
        tags = s.get("tags") or {}
        if tags.get("index") == "instance":
            out[(int(tags.get("blocks_tracked") or 0), str(tags.get("metric")))] = s
    return out


def pool_series(entry: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The pool index's series by metric."""
    return {str((s.get("tags") or {}).get("metric")): s for s in entry.get("samples") or []
            if (s.get("tags") or {}).get("index") == "pool"}


def rates(s: Mapping[str, Any]) -> list[float]:
    """Each round's blocks a second: a batch's blocks over the round's median batch time."""
    blocks = float((s.get("tags") or {}).get("blocks") or 0)
    return [blocks / m for m in medians_by_round(s) if m > 0]


def section_index(d: dict[str, Any], images: Images) -> str:
    """Body of the section: what was driven, at which sizes, and the bound's facts."""
    del images
    pool = d.get("pool") or {}
    bound = num(d.get("instance_default_bound"))
    fills = [f for f in d.get("fills") or [] if num(f.get("rss_bytes_per_block"))]
    per_block = num(fills[-1].get("rss_bytes_per_block")) if fills else None
    if bound is None:
        bounded = ("has no bound of its own: it holds what its instance's events stored and "
                   "did not remove (as much as the instance's caches hold while its events "
                   "arrive)")
    else:
        bounded = (f"keeps at most {int(bound)} blocks (the proxy's `--kv-index-max-blocks`, "
                   f"the oldest stored forgotten first: a forgotten block only "
                   f"under-predicts), measured here without that bound to see the structure "
                   f"at every size; at the {fmt(per_block)} B a block of the most tracked, "
                   f"{fmt(per_block and bound * per_block / 2**20)} MiB an instance at most")
    return (f"Driven: {d.get('driven', '–')}; batches of {d.get('blocks_per_batch', '–')} "
            f"blocks ({d.get('blocks_per_event', '–')} a `BlockStored`, blocks of "
            f"{d.get('block_size', '–')} tokens), {d.get('batches_per_round', '–')} stored and "
            f"as many removed, {d.get('lookups_per_round', '–')} lookups of a "
            f"{d.get('prompt_blocks', '–')}-block prompt, {d.get('rounds', '–')} rounds, the "
            f"sizes in turns, at {', '.join(str(n) for n in d.get('sizes') or [])} blocks "
            f"tracked; memory: {d.get('memory', '–')}. The per-instance `PrefixIndex` "
            f"{bounded}. The shared pool's `PoolIndex`, bound "
            f"{pool.get('bound', '–')} blocks, {_pool_feed(pool)}.\n")


def _pool_feed(pool: Mapping[str, Any]) -> str:
    """What the pool index was stored: a fresh index twice its bound every round (runs
    before 2026-12-07), or one index, twice its bound and then more each round."""
    if "stored_more_per_round" in pool:
        return (f"was stored {pool.get('stored_first_round', '–')} blocks in the first round "
                f"and {pool.get('stored_more_per_round', '–')} more in each later round, "
                f"into the same index")
    return f"was stored {pool.get('stored_per_round', '–')} blocks a round, afresh"


def section_samples(entry: Mapping[str, Any]) -> str:
    """The tables, from the raw samples: per size, memory, ingest and lookup; the growth
    of a lookup from the fewest to the most tracked; the pool index at its bound."""
    inst = instance_series(entry)
    sizes = sorted({k[0] for k in inst})
    if not sizes:
        return "\nThis run recorded no raw samples.\n"
    rows = []
    for n in sizes:
        row: dict[str, Any] = {"n": n}
        mem = inst.get((n, "rss_per_block"))
        row["mem"] = fmt(medians_by_round(mem)[0]) if mem and medians_by_round(mem) else "–"
        for metric in ("store", "remove"):
            s = inst.get((n, metric))
            row[metric] = median_cell(rates(s), 1e-3) if s else "–"
        look = inst.get((n, "lookup"))
        row["lookup"] = median_cell(medians_by_round(look), 1e6) if look else "–"
        held = inst.get((n, "held"))
        want = num(((held or {}).get("tags") or {}).get("stored_minus_removed"))
        row["held"] = (fmt(all(v == want for v in medians_by_round(held)))
                       if held and want is not None else "–")
        rows.append(row)
    out = ["\nThe per-instance index (median of the rounds [95% interval]):\n\n",
           md_table(rows, ["n", "mem", "store", "remove", "lookup", "held"],
                    ["blocks tracked", "RSS B/block", "BlockStored k blocks/s",
                     "BlockRemoved k blocks/s", "lookup µs", "held = stored − removed"])]
    if len(sizes) >= 2:
        lo, hi = inst.get((sizes[0], "lookup")), inst.get((sizes[-1], "lookup"))
        if lo and hi:
            out.append(f"\nA lookup at {sizes[-1]} blocks tracked / at {sizes[0]} (rounds "
                       f"paired): {ratio_cell(medians_by_round(hi), medians_by_round(lo))}.\n")
    pool = pool_series(entry)
    if "held" in pool:
        tags = pool["held"].get("tags") or {}
        held_after = [v for r in pool["held"].get("rounds") or [] for v in r]
        newest = [v for r in (pool.get("newest_matched") or {}).get("rounds") or [] for v in r]
        rss = medians_by_round(pool["rss_added"]) if "rss_added" in pool else []
        past = pool.get("store_past_bound")
        more = num(tags.get("stored_more"))
        prow = {"bound": tags.get("bound"), "stored": tags.get("stored"),
                "held": int(max(held_after)) if held_after else None,
                "newest": int(min(newest)) if newest else None,
                "mem": max(rss) / 2**20 if rss else None,
                "rate": median_cell(rates(past), 1e-3) if past else "–"}
        how = ("twice its bound in the first round, then "
               f"{int(more)} blocks more a round into the same index" if more is not None
               else "twice its bound, each round afresh")
        out += [f"\nThe shared pool index stored {how} (the most it held after a round; the "
                "fewest blocks of the newest 64-block prompt it still matched; the most "
                "resident memory it had added):\n\n",
                md_table([prow], ["bound", "stored", "held", "newest", "mem", "rate"],
                         ["bound", "stored (first round)", "held after (most)",
                          "newest prompt matched", "RSS MiB", "stored past the bound "
                          "k blocks/s"])]
    return "".join(out)


def pool_bounded(entry: Mapping[str, Any]) -> Measured | None:
    """The most the pool index held after each round (the first stored twice its bound);
    met when every round held at most the bound, the bound was the proxy's
    (``POOL_MAX_BLOCKS`` as the run read it) and at least twice as many were stored (a
    count: its interval is itself)."""
    s = pool_series(entry).get("held")
    if s is None:
        return None
    tags = s.get("tags") or {}
    bound, stored = num(tags.get("bound")), num(tags.get("stored"))
    default = num((entry.get("result") or {}).get("pool_default_bound"))
    held = [v for r in s.get("rounds") or [] for v in r]
    if bound is None or stored is None or not held:
        return None
    most = max(held)
    met = most <= bound and stored >= 2 * bound and bound == default
    where = f"bound {int(bound)}, {int(stored)} stored" + (
        "" if bound == default else f", not the proxy's {fmt(default and int(default))}")
    return Measured(most, most, most, len(held), met, where, " blocks")


def lookup_growth(entry: Mapping[str, Any]) -> Measured | None:
    """A lookup's time at 10^7 blocks tracked / at 10^5, rounds paired by index; met when
    the interval's high end is at most :data:`LOOKUP_GROWTH_MAX`."""
    inst = instance_series(entry)
    lo, hi = inst.get((FEWEST, "lookup")), inst.get((MOST, "lookup"))
    if lo is None or hi is None:
        return None
    return judged_ratio(medians_by_round(hi), medians_by_round(lo),
                        at_most=LOOKUP_GROWTH_MAX, where=f"{MOST} / {FEWEST} blocks tracked")


GOALS = (
    GoalSpec("prefix index: the shared pool index holds at most its bound (the proxy's "
             "POOL_MAX_BLOCKS, 2^20 blocks) after twice as many were stored", "index",
             "(absolute)", pool_bounded, rank=75,
             short="pool index holds at most its bound"),
    GoalSpec(f"prefix index: a routing lookup (64-block prompt) at 10^7 blocks tracked costs "
             f"<= {fmt(LOOKUP_GROWTH_MAX)}x the one at 10^5", "index",
             "ours at 10^5 blocks tracked", lookup_growth, rank=76,
             short=f"index lookup at 10^7 <= {fmt(LOOKUP_GROWTH_MAX)}x at 10^5"),
)

SECTION = Section("The proxy's prefix indexes against the blocks tracked (`bench index`)",
                  "issue 53", 73, section_index, GOALS, samples=section_samples)

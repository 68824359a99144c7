# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench trace``: eviction policies of the local pool replayed on traces.

:func:`plot_trace` draws one panel per trace: each policy's hit rate against capacity,
the offline optimum's, and the unbounded pool's (render.py's plot signature); the
renderer hands it in as ``images["trace"]``.

A replay is deterministic (the same trace gives the same hits), so a run has no repeated
rounds: its ledger entry keeps the hit blocks of every policy, capacity and trace in
consecutive segments of the trace, and a figure's interval is the bootstrap over those
segments (resampled together for both sides of a ratio): how much the figure depends on the
part of the trace, not on the machine. The value is the exact ratio over the whole trace.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._common import GoalSpec, Images, Measured, Section, fmt, md_table, num, worst

logger = logging.getLogger(__name__)

#: Hit rate at half capacity, as a share of the unbounded pool's, that meets the goal.
GOAL_VS_UNBOUNDED = 0.98


def _traces(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    traces = d.get("traces")
    return traces if isinstance(traces, dict) else {}


def _policy_table(res: dict[str, Any]) -> str:
    policies = [*res.get("policies", []), "optimum"]
    rows = []
    for r in res.get("rows", []):
        row: dict[str, Any] = {"capacity": r.get("capacity_fraction"),
                               "blocks": r.get("capacity_blocks")}
        for p in policies:
            row[p] = (r.get(p) or {}).get("vs_unbounded")
        rows.append(row)
    default = res.get("default_policy")
    heads = ["capacity (fraction)", "capacity (blocks)",
             *(f"{p} (default)" if p == default else p for p in policies)]
    return md_table(rows, ["capacity", "blocks", *policies], heads)


def section_trace(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    cfg = d.get("config", {})
    traces = _traces(d)
    if not traces:  # a result of the LRU-only replay
        ub = d.get("unbounded", {})
        return (f"Replay of `{Path(str(cfg.get('trace', '?'))).name}`: {cfg.get('requests')} "
                f"requests, {cfg.get('unique_blocks')} distinct blocks of "
                f"{cfg.get('tokens_per_block')} tokens ({cfg.get('block_bytes')} bytes each "
                f"here). Best possible hit rate (unbounded pool): "
                f"{fmt(num(ub.get('hit_rate')))}.\n\n"
                + md_table(d.get("rows", []), ["capacity_fraction", "capacity_blocks",
                                                "hit_rate", "best_hit_rate", "vs_best",
                                                "requests/s"],
                           ["capacity (fraction)", "capacity (blocks)", "hit rate",
                            "unbounded", "hit / best", "requests/s"]))
    out = [f"Each trace is replayed against the `local` backend itself (lookup with `exists`, "
           f"load the leading hits, save the misses) with every eviction policy, and with the "
           f"offline optimum (Belady: evict the block whose next use is furthest away) in "
           f"the same backend. A request hits its longest stored leading run of blocks. "
           f"Capacity is a fraction of the trace's distinct blocks (what an unbounded pool "
           f"ends up holding); cells are hit rate / the unbounded pool's hit rate. Goal: "
           f"{cfg.get('goal', f'>= {GOAL_VS_UNBOUNDED} of unbounded at 0.5 capacity')}.\n\n"
           f"Traces: `conversation` is `{Path(str(cfg.get('trace', '?'))).name}` "
           f"(Mooncake); `deep-prefix-tree` (system prompts, contexts and growing "
           f"conversations several levels deep) and `zipf-scans` (Zipf-popular documents "
           f"with one-off long prompts mixed in) are generated, seeded.\n"]
    for name, res in traces.items():
        ub = (res.get("unbounded") or {}).get("hit_rate")
        out.append(f"\n**{name}**: {res.get('requests')} requests, {res.get('unique_blocks')} "
                   f"distinct blocks, unbounded hit rate {fmt(num(ub))}.\n\n")
        out.append(_policy_table(res))
    if images.get("trace"):
        out.append(f"\n![hit rate against capacity]({images['trace']})\n")
    return "".join(out)


#: The capacity of the goal (a fraction of the blocks an unbounded pool holds; the policy
#: judged is the run's default), and the traces the policies were tuned on (the goal also
#: asks for held-out ones).
GOAL_FRACTION = 0.5
TUNED_ON = ("conversation", "deep-prefix-tree", "zipf-scans")


def segment_ratio(ours: Sequence[float], peer: Sequence[float], *, resamples: int = 2000,
                  seed: int = 0) -> tuple[float | None, float | None, float | None]:
    """``sum(ours) / sum(peer)`` over segments, and its 95% bootstrap interval (segments
    resampled with replacement, both sides together)."""
    n = len(ours)
    if n == 0 or n != len(peer) or sum(peer) <= 0:
        return None, None, None
    rng = random.Random(seed)
    stats = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        den = sum(peer[i] for i in idx)
        stats.append(sum(ours[i] for i in idx) / den if den > 0 else math.inf)
    stats.sort()
    lo = stats[int(math.floor(0.025 * resamples))]
    hi = stats[min(resamples - 1, int(math.ceil(0.975 * resamples)) - 1)]
    return sum(ours) / sum(peer), lo, hi


def _hits(entry: Mapping[str, Any]) -> dict[tuple[Any, ...], list[float]]:
    """Hit blocks by segment, by (trace, policy, capacity fraction or None)."""
    out = {}
    for s in entry.get("samples") or []:
        t = s.get("tags") or {}
        if t.get("what") == "hit_blocks":
            out[(t.get("trace"), t.get("policy"), t.get("capacity_fraction"))] = [
                r[0] for r in s.get("rounds") or [] if r]
    return out


def default_vs_unbounded(entry: Mapping[str, Any]) -> Measured | None:
    """The default policy's hit blocks at half capacity / the unbounded pool's, every trace
    of the run, the trace whose interval lies lowest deciding; not met without a trace the
    policies were not tuned on."""
    hits = _hits(entry)
    traces = _traces(dict(entry.get("result") or {}))
    points = []
    for trace in sorted({k[0] for k in hits}):
        policy = (traces.get(str(trace)) or {}).get("default_policy")
        ours, peer = hits.get((trace, policy, GOAL_FRACTION)), hits.get(
            (trace, "unbounded", None))
        if ours and peer:
            v, lo, hi = segment_ratio(ours, peer)
            points.append(Measured(v, lo, hi, len(ours), lo is not None
                                   and lo >= GOAL_VS_UNBOUNDED, str(trace)))
    out = worst(points, at_least=True)
    held_out = {k[0] for k in hits} - set(TUNED_ON)
    if out is not None and not held_out:
        out = Measured(out.value, out.low, out.high, out.rounds, False,
                       f"{out.where}; no held-out trace in the run")
    return out


def samples_trace(entry: Mapping[str, Any]) -> str:
    """Each policy's hit rate / the unbounded pool's at each capacity, with the interval
    over the trace's segments."""
    hits = _hits(entry)
    if not hits:
        return "\nThis run recorded no raw samples (runs before they were kept).\n"
    policies = list(dict.fromkeys(k[1] for k in hits if k[2] is not None))
    rows = []
    for trace, frac in sorted({(k[0], k[2]) for k in hits if k[2] is not None}):
        peer = hits.get((trace, "unbounded", None)) or []
        row: dict[str, Any] = {"trace": trace, "capacity": frac}
        for p in policies:
            v, lo, hi = segment_ratio(hits.get((trace, p, frac)) or [], peer)
            row[p] = "–" if v is None else f"{fmt(v)} [{fmt(lo)}–{fmt(hi)}]"
        rows.append(row)
    n = max((len(v) for v in hits.values()), default=0)
    return (f"\nFrom the raw samples: hit blocks / the unbounded pool's over the whole trace "
            f"[95% bootstrap interval over its {n} consecutive segments].\n\n"
            + md_table(rows, ["trace", "capacity", *policies],
                       ["trace", "capacity (fraction)", *policies]))


GOALS = (GoalSpec(f"pool eviction at half capacity >= {GOAL_VS_UNBOUNDED} of an unbounded pool, "
                  "every trace, real held-out traces included (default policy)", "trace",
                  "an unbounded pool", default_vs_unbounded, {"quick": lambda q: not q},
                  rank=65,
                  short=f"eviction >= {GOAL_VS_UNBOUNDED} of unbounded, every trace"),)


def plot_trace(res: dict[str, dict[str, Any]], path: Path, draw: bool = True
               ) -> Path | None:
    """Hit rate against capacity per trace: each policy, the optimum, the unbounded pool."""
    traces = _traces(res.get("trace") or {})
    if not traces:
        return None
    if not draw:  # the page needs only to know whether there is a plot
        return path
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(4 * len(traces), 3.4), squeeze=False)
    for ax, (name, t) in zip(axes[0], traces.items(), strict=True):
        rows = t.get("rows", [])
        xs = [r["capacity_fraction"] for r in rows]
        for p in (*t.get("policies", []), "optimum"):
            ys = [(r.get(p) or {}).get("hit_rate") for r in rows]
            ax.plot(xs, ys, marker="o", linestyle="--" if p == "optimum" else "-", label=p)
        best = (t.get("unbounded") or {}).get("hit_rate")
        if best is not None:
            ax.axhline(best, color="grey", linestyle=":", label="unbounded")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("capacity (fraction of distinct blocks)", fontsize=8)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("block hit rate")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


SECTION = Section("Trace replay (`bench trace`)", "issues 6 and 17", 60, section_trace, GOALS,
                  samples=samples_trace)

# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench trace``: eviction policies of the local pool replayed on traces.

:func:`plot_trace` draws one panel per trace: each policy's hit rate against capacity,
the offline optimum's, and the unbounded pool's (render.py's plot signature); the
renderer hands it in as ``images["trace"]``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ._common import GoalSpec, Images, Section, fmt, md_table, num

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


GOALS = (GoalSpec(f"pool eviction at half capacity >= {GOAL_VS_UNBOUNDED} of an unbounded pool, "
                  "every trace, real held-out traces included (default policy)", "trace",
                  "an unbounded pool", rank=65),)


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


SECTION = Section("Trace replay (`bench trace`)", "issues 6 and 17", 60, section_trace, GOALS)

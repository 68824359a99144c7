# SPDX-License-Identifier: Apache-2.0
"""The numbers of ``bench serve``: per-scenario summaries, ours against each peer, the table.

Nothing here names a connector: the comparisons are the ones each scenario
declares (:attr:`~.spec.Scenario.comparisons`), each package's
scenarios declaring theirs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..benchutil import goal_check, median, ratio
from .compare import PD_REQUEST
from .spec import Goal, Scenario, ServeConfig

logger = logging.getLogger(__name__)

#: The summary key of a P/D scenario's D-side TTFT over the recompute.
PD_TTFT = "d_ttft_over_recompute"


def _reference_of(res: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Recompute / device-hit TTFT per prompt length and throughput of the engine without a
    connector: measured next to the scenario when it was, else the baseline's own run."""
    ref = res.get("reference")
    if isinstance(ref, dict):
        return {"recompute": {int(k): v for k, v in ref["recompute_s"].items()},
                "floor": {int(k): v for k, v in ref["device_hit_s"].items()},
                "thr": ref.get("output_tok_per_s")}
    rows = base.get("prompts", [])
    return {"recompute": {r["tokens"]: r["again_s"] for r in rows},
            "floor": {r["tokens"]: r["device_hit_s"] for r in rows},
            "thr": base.get("throughput", {}).get("output_tok_per_s")}


def summarize(results: dict[str, dict[str, Any]], cfg: ServeConfig) -> dict[str, Any]:
    """Per-scenario medians, and ratios against the engine without a connector measured
    next to each scenario."""
    base = results.get("baseline", {})
    base_tok = {r["tokens"]: r["cold_token"] for r in base.get("prompts", [])}
    summary: dict[str, dict[str, Any]] = {}
    for name, res in results.items():
        if res.get("status") != "ok":
            continue
        ref = _reference_of(res, base)
        recompute, floor = ref["recompute"], ref["floor"]
        rows = res.get("prompts", [])
        s: dict[str, Any] = {}
        if "d_ttft_s" in (rows[0] if rows else {}):
            s["d_ttft_s"] = median(r["d_ttft_s"] for r in rows)
            s["d_ttft_over_recompute"] = median(ratio(r["d_ttft_s"], recompute.get(r["tokens"]))
                                                for r in rows)
            # KV throughput as D sees it: the prompt's KV bytes over D's TTFT (which also
            # holds D's compute of the last token; always defined, unlike a subtraction)
            s["kv_GBps"] = median(r["tokens"] * cfg.kv_bytes_per_token / r["d_ttft_s"] / 1e9
                                  for r in rows if r["d_ttft_s"] > 0)
            s["d_ttft_over_device_hit"] = median(ratio(r["d_ttft_s"], floor.get(r["tokens"]))
                                                 for r in rows)
            s["tokens_equal"] = res["tokens_equal"] if "tokens_equal" in res else all(
                t == base_tok.get(r["tokens"])
                for r in rows for t in r.get("d_tokens_all", [r["d_token"]]))
            s["failed"] = [r["tokens"] for r in rows if r["finish"] not in ("length", "stop")]
        else:
            s["cold_s"] = median(r["cold_s"] for r in rows)
            s["hit_s"] = median(r["again_s"] for r in rows)
            s["cold_over_baseline"] = median(ratio(r["cold_s"], recompute.get(r["tokens"]))
                                             for r in rows)
            s["hit_over_recompute"] = median(ratio(r["again_s"], recompute.get(r["tokens"]))
                                             for r in rows)
            s["hit_over_device_hit"] = median(ratio(r["again_s"], floor.get(r["tokens"]))
                                              for r in rows)
            s["cached"] = {r["tokens"]: r["again_cached"] for r in rows}
            s["missed"] = [r["tokens"] for r in rows if not r["again_cached"]]
            s["tokens_equal"] = res["tokens_equal"] if "tokens_equal" in res else all(
                r["cold_token"] == base_tok.get(r["tokens"])
                and all(t == base_tok.get(r["tokens"])
                        for t in r.get("again_tokens_all", [r["again_token"]]))
                for r in rows)
            thr = res.get("throughput", {}).get("output_tok_per_s")
            s["output_tok_per_s"] = thr
            s["throughput_over_baseline"] = ratio(thr, ref["thr"])
        s["reference_recompute_s"] = median(recompute.values())
        summary[name] = s
    return summary


def comparisons(summary: dict[str, dict[str, Any]],
                scenarios: Sequence[Scenario] = ()) -> list[dict[str, Any]]:
    """Ours against each peer (and against recompute), with the goals the scenarios declare.

    Scenarios run one after the other on a shared machine, so ours / peer ratios
    divide the *normalized* figures: each scenario's TTFT over the recompute (or
    throughput over the throughput) of the engine without a connector measured
    next to it. Load that changed between the two scenarios cancels.
    """
    def get(name: str, key: str) -> float | None:
        v = summary.get(name, {}).get(key)
        return float(v) if isinstance(v, int | float) else None

    out: list[dict[str, Any]] = []

    def add(what: str, value: float | None, goal: Goal | None) -> None:
        # "peer": ours / one of vLLM's connectors; "recompute": against no connector
        kind = "recompute" if what.endswith("/ recompute") else "peer"
        bounded = goal is not None and (goal.at_least is not None or goal.at_most is not None)
        out.append({"what": what, "kind": kind, "ratio": value,
                    "goal": goal.text if goal else "",
                    "met": goal_check(value, at_least=goal.at_least, at_most=goal.at_most)
                    if goal is not None and bounded else None})

    by_name = {sc.name: sc for sc in scenarios}
    for sc in scenarios:
        for c in sc.comparisons:
            if c.metric == PD_REQUEST:  # per round only (compare)
                continue
            ours, peer = get(sc.name, c.metric), get(c.peer, c.metric)
            add(c.what, ratio(peer, ours) if c.inverse else ratio(ours, peer), c.goal)
    for name, s in summary.items():
        declared = by_name.get(name)
        if "hit_over_recompute" in s and name != "baseline":
            add(f"{name} hit TTFT / recompute", s["hit_over_recompute"],
                declared.hit_goal if declared else None)
        if PD_TTFT in s:
            add(f"{name} D TTFT / recompute", s[PD_TTFT], None)
    return out


def table_rows(results: dict[str, dict[str, Any]],
               summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One printable row per scenario."""
    rows = []
    for name, res in results.items():
        s = summary.get(name, {})
        row: dict[str, Any] = {"scenario": name, "connector": res.get("connector", "-"),
                               "status": res.get("status")}
        if res.get("status") != "ok":
            row["note"] = res.get("reason", "")[:70]
        elif "d_ttft_s" in s:
            row.update({"ttft_s": s["d_ttft_s"], "vs_recompute": s["d_ttft_over_recompute"],
                        "kv_GBps": s["kv_GBps"], "tokens_ok": s["tokens_equal"],
                        "note": f"failed: {s['failed']}" if s["failed"] else "D side"})
        else:
            row.update({"ttft_s": s["hit_s"], "vs_recompute": s["hit_over_recompute"],
                        "cold_vs_base": s["cold_over_baseline"],
                        "tput_vs_base": s["throughput_over_baseline"],
                        "tokens_ok": s["tokens_equal"],
                        "note": f"missed lengths {s['missed']}" if s["missed"] and
                        name != "baseline" else ""})
        rows.append(row)
    return rows

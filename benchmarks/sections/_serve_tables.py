# SPDX-License-Identifier: Apache-2.0
"""Tables of the serve section: comparisons with their intervals, the overhead over the floor,
the engines' first requests."""

from __future__ import annotations

import logging
from typing import Any

from ._common import fmt, md_table, num, verdict

#: How the text names a family of ``bench serve``.
_FAMILY_NAMES = {"pd": "P/D", "pool": "pool", "offload": "offload", "peer": "peers"}

logger = logging.getLogger(__name__)


def _iv(lo: Any, hi: Any) -> str:
    a, b = num(lo), num(hi)
    return f"{fmt(a)}–{fmt(b)}" if a is not None and b is not None else "–"


def rounds_note(d: dict[str, Any]) -> str:
    """How many rounds, what alternated, and how wide the spread was."""
    cfg = d.get("config", {})
    rounds = cfg.get("rounds")
    if not rounds:
        return ""
    comps = [c for c in d.get("comparisons", []) if num(c.get("min")) and num(c.get("max"))]
    widths = sorted(c["max"] / c["min"] for c in comps if c["min"] > 0 and c["max"] > 0)
    spread = ""
    if widths:
        spread = (f" Over the rounds, a ratio's largest / smallest round was "
                  f"{fmt(widths[len(widths) // 2])}x in the median comparison and "
                  f"{fmt(widths[-1])}x in the widest.")
    binds = cfg.get("pd_binding_env") or {}
    bind_text = ", ".join(f"`{b}` (P `VLLM_CPU_OMP_THREADS_BIND={e.get('prefill')}`, D "
                          f"`{e.get('decode')}`)" for b, e in binds.items())
    groups = cfg.get("round_groups")
    if groups:  # runs from 2026-12-07 on: P/D's rounds, then the other families' together
        names = "; ".join(" and ".join(_FAMILY_NAMES.get(f, f) for f in g) for g in groups)
        grouped = (f"the scenarios are measured in sets of rounds ({names}): the engines of a "
                   "set start once and stay up; each round measures the engine without a "
                   "connector (the recompute of that round) and then every scenario of the "
                   "set once")
    else:
        grouped = ("the engines of a family (P/D, pool, offload) start once and stay up; each "
                   "round measures the engine without a connector (the recompute of that "
                   "round) and then every scenario of the family once")
    return (f"**{rounds} rounds**, alternating: {grouped}, in turns, "
            "in reverse order every other round; pool and offload get fresh prompts every "
            f"round (a cold request must miss), {cfg.get('repeats')} sample(s) of each hit a "
            f"round. P/D prompts of {cfg.get('pd_lengths')} tokens under the bindings "
            f"{bind_text or '–'}; each P/D scenario is reported under each binding and ours is "
            "compared with the peer at its best binding. A ratio is median(ours) / "
            "median(peer) over the rounds; `min–max` is the spread of the per-round ratios "
            "and `interval` a 95% paired bootstrap over the rounds. **A goal counts as met "
            "only when the whole interval is on the right side.**" + spread
            + _steady_note(cfg))


def _steady_note(cfg: dict[str, Any]) -> str:
    """How the engines were brought to their steady state (as the run's options say)."""
    malloc = cfg.get("engine_malloc")
    if not isinstance(malloc, dict):
        return ""
    env = " ".join(f"`{k}={v}`" for k, v in malloc.items())
    return (" Every engine served a first request of the longest prompt and a throughput "
            "batch before its first round (the first requests table below), and ran with "
            f"glibc's malloc keeping the memory it frees ({env}).")


def comparison_table(comps: list[dict[str, Any]]) -> str:
    """Every comparison with its interval, spread, rounds and verdict."""
    rows = [{**c, "interval": _iv(c.get("low"), c.get("high")),
             "spread": _iv(c.get("min"), c.get("max")),
             "met": verdict(c.get("met")) if c.get("goal") else ""} for c in comps]
    return ("\nOurs against vLLM's connectors (`peer`: TTFT or throughput normalized by the "
            "same round's engine without a connector; `overhead`: what the connector controls, "
            "see below; `kv_wait`: D's wait for the KV in vLLM's scheduler, see below), and "
            "ours against recompute:\n\n"
            + md_table(rows, ["what", "kind", "ratio", "interval", "spread", "rounds", "goal",
                              "met", "note"],
                       ["what", "kind", "ratio", "interval", "min–max", "rounds", "goal",
                        "met", "note"]))


def _int(v: Any) -> int | None:
    x = num(v)
    return int(x) if x is not None else None


def _m(spread: dict[str, Any] | None) -> float | None:
    return num((spread or {}).get("median"))




def overhead_table(d: dict[str, Any]) -> str:
    """The overhead over the floor, and the save overhead, of every scenario measured in
    rounds: medians over the rounds (min–max of the overhead)."""
    pd_rows, cache_rows = [], []
    for name, r in (d.get("rounds") or {}).items():
        sc = d.get("scenarios", {}).get(name, {})
        if name == "baseline":  # its "hit" is a recompute: the reference, not a connector
            continue
        for tokens, s in sorted((r.get("by_tokens") or {}).items(), key=lambda kv: int(kv[0])):
            if "overhead" in s:
                pd_rows.append({
                    "scenario": name, "connector": sc.get("connector"), "tokens": tokens,
                    "ttft": _m(s.get("ttft")), "floor": _m(s.get("floor")),
                    "overhead": _m(s.get("overhead")),
                    "spread": _iv((s.get("overhead") or {}).get("min"),
                                  (s.get("overhead") or {}).get("max")),
                    "kv_wait": _m(s.get("kv_wait")),
                    "prefill": _m(s.get("prefill")), "total": _m(s.get("total")),
                    "recompute": _m(s.get("recompute")),
                    "external": _int((s.get("external") or {}).get("min")),
                    "loaded": r.get("loaded"), "check": r.get("load_check")})
            elif "hit_overhead" in s:
                cache_rows.append({
                    "scenario": name, "connector": sc.get("connector"), "tokens": tokens,
                    "hit": _m(s.get("hit")), "floor": _m(s.get("floor")),
                    "hit_overhead": _m(s.get("hit_overhead")),
                    "spread": _iv((s.get("hit_overhead") or {}).get("min"),
                                  (s.get("hit_overhead") or {}).get("max")),
                    "cold": _m(s.get("cold")), "recompute": _m(s.get("recompute")),
                    "save_overhead": _m(s.get("save_overhead"))})
    out = ["\n### Overhead over the floor\n\n"
           "What the connector controls, beside the raw TTFT. The **floor** is the same "
           "engine's TTFT on a device-cache hit of that prompt (vLLM computes only the last "
           "token; a prompt that fills whole blocks is measured with one more token, since "
           "vLLM's prefix cache hits whole blocks and at most all tokens but one: the prompt "
           "itself would recompute its whole last block, while D with the whole prompt loaded, "
           "or a pool hit of all tokens but the last, computes one); a hit's or D's "
           "**overhead** is its TTFT minus that floor. On the cold path "
           "the **save overhead** is the cold TTFT (miss and save) minus the recompute of the "
           "same prompt by the engine without a connector in the same round. Seconds, medians "
           "over the rounds.\n\n"]
    if pd_rows:
        out.append("P/D, D side (`external`: the fewest tokens vLLM counted as loaded by the "
                   "connector, `num_external_computed_tokens`, in any round; a D that loaded "
                   "none fell back to recompute and its ratios do not count):\n\n")
        wait = any(r["kv_wait"] is not None for r in pd_rows)
        if wait:
            out.append("`KV wait`: how long vLLM's scheduler held D's request before its first "
                       "forward pass (added to first scheduled: the connector's load and the "
                       "engine step that reports it), the same measure for every connector and "
                       "without the forward pass that the TTFT adds.\n\n")
        whole = any(r["total"] is not None for r in pd_rows)
        if whole:
            out.append("`P prefill`: P's answer to its request (with a layerwise push, the "
                       "pushes too); `whole request`: from the first request sent (to P for a "
                       "pull, to D for the layerwise push) to D's first token, what a client "
                       "behind the proxy waits less the proxy's hops.\n\n")
        extra = ["prefill", "total"] if whole else []
        out.append(md_table(pd_rows, ["scenario", "connector", "tokens", "ttft", "floor",
                                      "overhead", "spread", *(["kv_wait"] if wait else []),
                                      *extra, "recompute", "external", "loaded", "check"],
                            ["scenario", "connector", "tokens", "D TTFT", "floor", "overhead",
                             "overhead min–max", *(["KV wait"] if wait else []),
                             *(["P prefill", "whole request"] if whole else []), "recompute",
                             "external", "loaded", "checked by"]))
    if cache_rows:
        out.append("\nPool and offload (hit after `reset_prefix_cache()`):\n\n")
        out.append(md_table(cache_rows, ["scenario", "connector", "tokens", "hit", "floor",
                                         "hit_overhead", "spread", "cold", "recompute",
                                         "save_overhead"],
                            ["scenario", "connector", "tokens", "hit TTFT", "floor",
                             "hit overhead", "hit overhead min–max", "cold TTFT", "recompute",
                             "save overhead"]))
    if not pd_rows and not cache_rows:
        return ""
    return "".join(out)


def warm_up_table(d: dict[str, Any]) -> str:
    """Each engine's first requests after start-up, served before its first round
    (``warm_up`` of ``bench serve``'s scenarios), beside the medians of its rounds."""
    rows = []
    for name, sc in (d.get("scenarios") or {}).items():
        warm = sc.get("warm_up")
        if not isinstance(warm, dict):
            continue
        by_len = ((d.get("rounds") or {}).get(name, {}).get("by_tokens") or {}).get(
            str(warm.get("tokens"))) or {}
        cold = _m(by_len.get("cold")) if by_len else None
        if cold is None:  # the baseline: its cold in the rounds is the recompute
            cold = _m(by_len.get("recompute")) if by_len else None
        rows.append({"scenario": name, "connector": sc.get("connector"),
                     "tokens": warm.get("tokens"), "first": warm.get("first_request_s"),
                     "cold": cold, "batch": warm.get("first_batch_s")})
    if not rows:
        return ""
    return ("\n**First requests after start-up.** Every engine serves one new prompt of the "
            "longest length and one throughput batch of new prompts after it starts and "
            "before its first round (connectors save them); they are not in the rounds. "
            "`first request`: that prompt's TTFT; `cold, rounds`: the median cold TTFT of "
            "the same length over the rounds (the baseline: its recompute); `first batch`: "
            "that batch's time.\n\n"
            + md_table(rows, ["scenario", "connector", "tokens", "first", "cold", "batch"],
                       ["scenario", "connector", "tokens", "first request s",
                        "cold, rounds s", "first batch s"]))

# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench serve``: real vLLM CPU engines with each connector, ours beside vLLM's."""

from __future__ import annotations

import logging
from typing import Any

from ._common import Goal, Images, Section, check, fmt, md_table, num, verdict
from ._serve_tables import comparison_table, overhead_table, rounds_note, warm_up_table

logger = logging.getLogger(__name__)


def section_serve(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    img = images.get("serve")
    cfg = d.get("config", {})
    spec = cfg.get("model_spec", {})
    thr = cfg.get("throughput", {})
    rounds = cfg.get("rounds")
    out = [f"Random-weight Llama ({spec.get('num_hidden_layers')} layers, hidden "
           f"{spec.get('hidden_size')}, {spec.get('num_key_value_heads')} KV heads of "
           f"{spec.get('head_dim')}), **{cfg.get('dtype')}**, block size "
           f"{cfg.get('block_size')}, prompts of {cfg.get('lengths')} tokens "
           f"(k·block, k·block+1, k·block+block/2)"
           + (f", P/D prompts of {cfg.get('pd_lengths')} tokens" if cfg.get("pd_lengths")
              else "")
           + (f", {cfg.get('repeats')} sample(s) of each hit a round (median), "
              f"{rounds} rounds" if rounds else
              f", {cfg.get('repeats')} samples of each hit (median)")
           + ". TTFT = wall time of `generate(max_tokens=1)` inside the engine process. "
           "Every engine is a separate process with "
           + ("the P/D thread bindings below"
              if cfg.get("pd_bindings") and not cfg.get("pd_threads_bind")
              else f"`VLLM_CPU_OMP_THREADS_BIND={cfg['pd_threads_bind']}` for P/D"
              if cfg.get("pd_threads_bind") else "vLLM's default thread binding")
           + "; P prefills, then D is asked (sequential), so the D-side TTFT is the figure "
           f"to compare. Throughput: a batch of {thr.get('batch')} new prompts of "
           f"{thr.get('prompt_tokens')} tokens, {thr.get('max_tokens')} tokens generated each "
           "(output tokens/s), against the engine without a connector.\n\n"
           + ("The engine without a connector stays up for the whole run and is measured in "
              "every round next to the scenarios (recompute TTFT, device-cache hit, "
              "throughput): each normalized figure divides by the measurement of its own "
              "round, so a shared machine's drift cancels. "
              if rounds else
              "The engine without a connector stays up for the whole run and is measured again "
              "right after every scenario (recompute TTFT, device-cache hit, throughput): each "
              "ratio divides by the measurement next to it, so a shared machine's drift "
              "between scenarios cancels. ")
           + "`vs recompute`: the hit (pool, offload: after "
           "`reset_prefix_cache()`, which drops vLLM's own cache only) or D's TTFT, over the "
           "same prompt recomputed. `cold / no connector`: the connector engine's first sight "
           "of the prompt (prefill and save) over that recompute. `kv GB/s`: the prompt's KV "
           "bytes over D's TTFT (which includes D's compute of the last token). `tokens ok`: "
           "every first token equals the engine without a connector.\n\n"]
    rows = d.get("rows", [])
    out.append(md_table(rows, ["scenario", "connector", "status", "ttft_s", "vs_recompute",
                               "cold_vs_base", "tput_vs_base", "kv_GBps", "tokens_ok", "note"],
                        ["scenario", "connector", "status", "TTFT s", "vs recompute",
                         "cold / no connector", "throughput / no connector", "kv GB/s",
                         "tokens ok", "note"]))
    if img:
        out.append(f"\n![TTFT against recompute]({img})\n")
    comps = [c for c in d.get("comparisons", []) if c.get("ratio") is not None
             or c.get("peer_fell_back")]
    note = rounds_note(d)
    if note:
        out.append(f"\n{note}\n")
    if comps and any("low" in c for c in comps):
        out.append(comparison_table(comps))
    elif comps:
        out.append("\nOurs against vLLM's connectors, and against recompute (same run). An "
                   "ours / peer ratio divides the two scenarios' normalized figures (TTFT over "
                   "the recompute measured next to each, throughput over the throughput "
                   "measured next to each); the KV throughput ratio is therefore the inverse "
                   "of the decode TTFT ratio:\n\n")
        out.append(md_table([{**c, "met": verdict(c["met"]) if c.get("goal") else ""}
                             for c in comps], ["what", "ratio", "goal", "met"]))
    if d.get("rounds"):
        out.append(overhead_table(d))
    out.append(warm_up_table(d))
    notrun = [(n, s) for n, s in d.get("scenarios", {}).items() if s.get("status") != "ok"]
    if notrun:
        out.append("\nNot measured here, and why:\n\n")
        for n, s in notrun:
            out.append(f"- `{n}` ({s.get('connector')}): {s.get('status')}: "
                       f"{fmt(s.get('reason', ''))}\n")
    return "".join(out)


def _rows(comps: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    """The rows of one declared comparison: ``what`` itself, or per binding ``what (b)``."""
    return [c for c in comps if c.get("what") == what or str(c.get("what", "")).startswith(
        what + " (")]


def _bounds(c: dict[str, Any]) -> tuple[float | None, float | None]:
    lo, hi = num(c.get("low")), num(c.get("high"))
    r = num(c.get("ratio"))
    return (lo if lo is not None else r), (hi if hi is not None else r)


def interval_met(c: dict[str, Any], *, at_most: float | None = None,
                 at_least: float | None = None) -> bool | None:
    """Met only when the whole interval (or, without one, the ratio) is on the right side;
    a ratio that does not count (the peer fell back to recompute) is not measured."""
    lo, hi = _bounds(c)
    if lo is None or hi is None or num(c.get("ratio")) is None:
        return None
    if at_most is not None:
        return hi <= at_most
    return check(lo, at_least=at_least)


def fmt_interval(c: dict[str, Any]) -> str:
    """``ratio [low–high]`` (just the ratio without an interval; the note when none)."""
    r = num(c.get("ratio"))
    if r is None:
        return str(c.get("note") or "–")
    lo, hi = num(c.get("low")), num(c.get("high"))
    if lo is None or hi is None or "low" not in c:
        return fmt(r)
    return f"{fmt(r)} [{fmt(lo)}–{fmt(hi)}]"


def _all(rows: list[dict[str, Any]], **bound: float) -> bool | None:
    """All rows met; not measured when none is, or when some are and none failed."""
    mets = [interval_met(c, **bound) for c in rows]
    if any(m is False for m in mets):
        return False
    if not mets or any(m is None for m in mets):
        return None
    return True


def _goal_rows(comps: list[dict[str, Any]], prefix: str, goal: str, source: str,
               **bound: float) -> Goal:
    rows = [c for c in comps if str(c.get("what", "")).startswith(prefix)]
    measured = "; ".join(f"{c['what'][len(prefix):].strip(' :') or c['what']}: "
                         f"{fmt_interval(c)}" for c in rows) or "–"
    return Goal(goal, source, measured, _all(rows, **bound), rank=70)


def _better(c: dict[str, Any]) -> bool | None:
    """Ours ahead (whole interval on the right side), behind (whole interval on the wrong
    side) or level (None)."""
    lo, hi = _bounds(c)
    if lo is None or hi is None:
        return None
    if "throughput" in str(c.get("what")):
        return True if lo > 1.0 else (False if hi < 1.0 else None)
    return True if hi < 1.0 else (False if lo > 1.0 else None)


def goals(res: dict[str, dict[str, Any]]) -> list[Goal]:
    """The serve-level goals, each checked on the interval of the repeated rounds."""
    goals: list[Goal] = []
    summary = res.get("serve", {}).get("summary") or {}
    comps = res.get("serve", {}).get("comparisons") or []
    src6, src17 = "issues 6, 8 (bench serve)", "issue 17 (bench serve)"

    for name in ("pool/ours-mooncake", "pool/ours-local"):
        rows = _rows(comps, f"{name} hit TTFT / recompute")
        if rows:
            goals.append(Goal(f"pool hit on a long prefix well below recompute TTFT ({name}; "
                              "read as <= 0.5x)", src6, fmt_interval(rows[0]),
                              interval_met(rows[0], at_most=0.5)))
            continue
        v = num(summary.get(name, {}).get("hit_over_recompute"))
        goals.append(Goal(f"pool hit on a long prefix well below recompute TTFT ({name}; "
                          "read as <= 0.5x)", src6, fmt(v), check(v, at_most=0.5)))
    v = num(summary.get("offload/ours", {}).get("hit_over_recompute"))
    off_ttft = res.get("offload", {}).get("ttft") or {}
    v2 = num(off_ttft.get("hit_over_recompute"))
    measured = [f"bench serve: {fmt(v)}"]
    if v2 is not None:
        measured.append(f"bench offload ({off_ttft.get('prompt_tokens')} tokens): {fmt(v2)}")
    goals.append(Goal("offload hit TTFT <= 0.1x recompute (2000 tokens)",
                      "issue 7 (bench serve, bench offload)", "; ".join(measured),
                      check(v2 if v2 is not None else v, at_most=0.1)))
    for label in ("NixlConnector", "vLLM MooncakeConnector"):
        rows = _rows(comps, f"P/D KV throughput: ours / {label}")
        goals.append(Goal(f"P/D KV throughput >= 1.2x {label}", "issue 4 (bench serve)",
                          "; ".join(fmt_interval(c) for c in rows) or fmt(None),
                          _all(rows, at_least=1.2)))
    rows = _rows(comps, "P/D decode TTFT: ours / NixlConnector")
    goals.append(Goal("P/D decode-side TTFT <= 0.8x NixlConnector's", "issue 4 (bench serve)",
                      "; ".join(fmt_interval(c) for c in rows) or fmt(None),
                      _all(rows, at_most=0.8)))
    rows = _rows(comps, "pool hit TTFT: ours-mooncake / MooncakeStoreConnector")
    goals.append(Goal("pool hit TTFT <= 0.8x vLLM MooncakeStoreConnector's (same Store)",
                      "issue 6 (bench serve)",
                      "; ".join(fmt_interval(c) for c in rows) or fmt(None),
                      _all(rows, at_most=0.8)))
    # issue 17: what the connector controls, interval on the right side
    if any("low" in c for c in comps):
        for label in ("vLLM MooncakeConnector", "NixlConnector"):
            goals.append(_goal_rows(
                [c for c in comps if str(c.get("what", "")).endswith(f"ours / {label}")],
                "D-side overhead over the floor",
                f"P/D D-side overhead over the floor <= 0.8x {label}'s (2,048 and 8,192 "
                "tokens, pinned and nobind, against its best binding)", src17, at_most=0.8))
        for label in ("vLLM MooncakeConnector", "NixlConnector"):
            lw = [c for c in comps
                  if str(c.get("what", "")).endswith(f"ours-layerwise / {label}")]
            if lw:  # D's time after P's prefill; P pays the push (rows `P's prefill`)
                goals.append(_goal_rows(
                    lw, "D-side overhead over the floor",
                    f"P/D layerwise: D-side overhead over the floor <= 0.8x {label}'s (D's "
                    "time after P's prefill, which pays the pushes: see the rows `P's "
                    "prefill` and `whole P/D request`)", src17, at_most=0.8))
        goals.append(_goal_rows(
            comps, "hit overhead over the floor: ours-mooncake / MooncakeStoreConnector",
            "pool (Mooncake backend) hit overhead over the floor <= 0.8x "
            "MooncakeStoreConnector's", src17, at_most=0.8))
        goals.append(_goal_rows(
            comps, "save overhead (cold - recompute): ours-mooncake / MooncakeStoreConnector",
            "pool (Mooncake backend) save overhead <= 0.8x MooncakeStoreConnector's", src17,
            at_most=0.8))
        goals.append(_goal_rows(comps, "pool/ours-mooncake save overhead / recompute",
                                "pool (Mooncake backend) save overhead <= 5% of recompute",
                                src17, at_most=0.05))
        goals.append(_goal_rows(comps, "pool/ours-mooncake serving throughput / no connector",
                                "pool (Mooncake backend) serving throughput with saves >= 1.0x "
                                "no connector", src17, at_least=1.0))
        goals.append(_goal_rows(
            comps, "pool serving throughput (new prompts, saved): ours-mooncake / "
            "MooncakeStoreConnector", "pool (Mooncake backend) serving throughput >= "
            "MooncakeStoreConnector's", src17, at_least=1.0))
    # against vLLM's connectors only (not ours against ours: the push against the pull),
    # and our connectors as deployed (not the pull with same-host reads off)
    ahead = [c for c in comps if c.get("kind") in ("peer", "overhead")
             and num(c.get("ratio")) is not None
             and not str(c.get("what", "")).split(" / ")[-1].startswith("ours")
             and "ours over TCP /" not in str(c.get("what", ""))]
    verdicts = [(c, _better(c)) for c in ahead]
    behind = [c for c, b in verdicts if b is False]
    level = [c for c, b in verdicts if b is None]
    n_ahead = sum(1 for _c, b in verdicts if b)
    text = "–"
    if ahead:
        text = f"{n_ahead} of {len(ahead)} comparisons ahead"
        if level:
            text += f"; level (interval across 1): {', '.join(c['what'] for c in level)}"
        if behind:
            text += f"; behind: {', '.join(c['what'] for c in behind)}"
    goals.append(Goal("ahead of vLLM's own connectors on the same engine wherever both run",
                      "issues 8, 17 (bench serve)", text,
                      (not behind and not level) if ahead else None))
    for g in goals:
        g.rank = 70
    return goals


SECTION = Section("Serving on real vLLM CPU engines (`bench serve`)", None, 0, section_serve,
                  goals)

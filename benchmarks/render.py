# SPDX-License-Identifier: Apache-2.0
"""Render ``docs/benchmarks.md`` and its plots from the JSON of ``vllm-ascend-kv bench``.

    python benchmarks/render.py [--results bench-results] [--docs docs]

Reads ``<results>/<name>.json`` (engine, kernels, p2p, layerwise, pool, trace,
offload, serve; any may be missing), writes ``<docs>/benchmarks.md`` and small
PNG plots in ``<docs>/img/`` (matplotlib, Agg backend). The page leads with the
goals of the issues and whether this run met each; then one section per
benchmark with the ratios measured in the run (the figures to quote) and the
absolute numbers with the machine they came from.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BENCHMARKS = ("engine", "kernels", "p2p", "layerwise", "pool", "trace", "offload", "serve",
              "auth")
SHARED_VM_NOTE = ("a shared 2-core VM (other work ran beside the benchmarks): absolute times "
                  "vary by tens of percent between runs; ratios measured in one run are the "
                  "figures to quote")


# ---------------------------------------------------------------------- loading
def load_results(results_dir: Path) -> dict[str, dict[str, Any]]:
    """Every ``<name>.json`` of the known benchmarks found in ``results_dir``.

    A file that is not valid JSON is reported and left out (the page says so).
    """
    out: dict[str, dict[str, Any]] = {}
    for name in BENCHMARKS:
        path = results_dir / f"{name}.json"
        if not path.exists():
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            logger.warning("%s is not valid JSON (%s): left out", path, exc)
            out[name] = {"_error": f"{path.name} is not valid JSON: {exc}"}
            continue
        if not isinstance(data, dict):
            out[name] = {"_error": f"{path.name} does not hold a JSON object"}
            continue
        out[name] = data
    return out


# ---------------------------------------------------------------------- formatting
def fmt(v: Any, digits: int = 3) -> str:
    """A table cell: floats to ``digits`` significant digits, booleans as yes/no."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.{digits}g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def md_table(rows: Sequence[dict[str, Any]], columns: Sequence[str],
             headers: Sequence[str] | None = None) -> str:
    """A Markdown table of ``rows`` (missing cells shown as –)."""
    if not rows:
        return "_no rows_\n"
    head = list(headers or columns)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def verdict(met: bool | None) -> str:
    """Cell text of a goal check."""
    return {True: "**met**", False: "**not met**", None: "not measured"}[met]


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _min(values: Iterable[Any]) -> float | None:
    vals = [x for x in (_num(v) for v in values) if x is not None]
    return min(vals) if vals else None


def _max(values: Iterable[Any]) -> float | None:
    vals = [x for x in (_num(v) for v in values) if x is not None]
    return max(vals) if vals else None


# ---------------------------------------------------------------------- goals
@dataclass
class Goal:
    """One goal of the issues, checked against this run."""

    goal: str
    source: str
    measured: str
    met: bool | None


def _check(value: float | None, *, at_least: float | None = None,
           at_most: float | None = None) -> bool | None:
    if value is None:
        return None
    if at_least is not None:
        return value >= at_least
    assert at_most is not None
    return value <= at_most


def evaluate_goals(res: dict[str, dict[str, Any]]) -> list[Goal]:
    """The goals of issues 3-8, each with what this run measured and whether it was met."""
    goals: list[Goal] = []

    # connector paths >= 0.9 of their raw engine
    p2p = res.get("p2p", {}).get("results") or []
    worst = _min(r.get("ratio") for r in p2p)
    goals.append(Goal("P/D pull connector transfer >= 0.9 of the raw Mooncake engine",
                      "issue 4 (bench p2p)",
                      ", ".join(f"{r.get('blocks')} blocks: {fmt(_num(r.get('ratio')))}"
                                for r in p2p) or "–",
                      _check(worst, at_least=0.9)))
    lw_raw = _num((res.get("layerwise", {}).get("vs_raw") or {}).get("ratio"))
    goals.append(Goal("layerwise push connector >= 0.9 of the raw Mooncake engine (same bytes, "
                      "no compute)", "issues 5, 8 (bench layerwise)", fmt(lw_raw),
                      _check(lw_raw, at_least=0.9)))
    pool_rows = res.get("pool", {}).get("rows") or []
    mc = [r for r in pool_rows if str(r.get("path", "")).startswith("mooncake ")
          and "ratio" in r]
    goals.append(Goal("pool put/get through the backend >= 0.9 of raw Mooncake Store calls",
                      "issue 6 (bench pool)",
                      ", ".join(f"{r['path']}: {fmt(_num(r.get('ratio')))}" for r in mc) or "–",
                      _check(_min(r.get("ratio") for r in mc), at_least=0.9)))
    # kernels and offload >= 0.8 of memcpy from 64 KiB
    kr = [r for r in res.get("kernels", {}).get("results") or []
          if (_num(r.get("block_kib")) or 0) >= 64]
    kworst = _min([r.get(k) for r in kr
                   for k in ("gather", "scatter", "gather_layers", "scatter_layers")])
    goals.append(Goal("kernels gather/scatter (one layer and all layers) >= 0.8 of memcpy "
                      "from 64 KiB blocks",
                      "issue 3 (bench kernels)", f"worst {fmt(kworst)}" if kr else "–",
                      _check(kworst, at_least=0.8)))
    ob = [r for r in (res.get("offload", {}).get("bandwidth") or [])
          if (_num(r.get("block_kib")) or 0) >= 64]
    oworst = _min([r.get("save_ratio") for r in ob] + [r.get("load_ratio") for r in ob])
    goals.append(Goal("offload save/load >= 0.8 of memcpy from 64 KiB blocks",
                      "issue 7 (bench offload)", f"worst {fmt(oworst)}" if ob else "–",
                      _check(oworst, at_least=0.8)))
    # lookups
    lk = [r for r in pool_rows if "keys/s" in r]
    lworst = _min(r.get("keys/s") for r in lk)
    goals.append(Goal("pool lookups >= 100k keys/s batched", "issue 6 (bench pool)",
                      ", ".join(f"{r['path']}: {fmt(_num(r['keys/s']))}" for r in lk) or "–",
                      _check(lworst, at_least=100_000)))
    # serve-level goals
    summary = res.get("serve", {}).get("summary") or {}
    comps = res.get("serve", {}).get("comparisons") or []

    def comp(what: str) -> float | None:
        return next((_num(c.get("ratio")) for c in comps if c.get("what") == what), None)

    for name in ("pool/ours-mooncake", "pool/ours-local"):
        v = _num(summary.get(name, {}).get("hit_over_recompute"))
        goals.append(Goal(f"pool hit on a long prefix well below recompute TTFT ({name}; "
                          "read as <= 0.5x)", "issues 6, 8 (bench serve)", fmt(v),
                          _check(v, at_most=0.5)))
    v = _num(summary.get("offload/ours", {}).get("hit_over_recompute"))
    off_ttft = res.get("offload", {}).get("ttft") or {}
    v2 = _num(off_ttft.get("hit_over_recompute"))
    measured = [f"bench serve: {fmt(v)}"]
    if v2 is not None:
        measured.append(f"bench offload ({off_ttft.get('prompt_tokens')} tokens): {fmt(v2)}")
    goals.append(Goal("offload hit TTFT <= 0.1x recompute (2000 tokens)",
                      "issue 7 (bench serve, bench offload)", "; ".join(measured),
                      _check(v2 if v2 is not None else v, at_most=0.1)))
    for label, peer in (("NixlConnector", "NixlConnector"),
                        ("vLLM MooncakeConnector", "vLLM MooncakeConnector")):
        v = comp(f"P/D KV throughput: ours / {peer}")
        goals.append(Goal(f"P/D KV throughput >= 1.2x {label}", "issue 4 (bench serve)",
                          fmt(v), _check(v, at_least=1.2)))
    v = comp("P/D decode TTFT: ours / NixlConnector")
    goals.append(Goal("P/D decode-side TTFT <= 0.8x NixlConnector's", "issue 4 (bench serve)",
                      fmt(v), _check(v, at_most=0.8)))
    v = comp("pool hit TTFT: ours-mooncake / MooncakeStoreConnector")
    goals.append(Goal("pool hit TTFT <= 0.8x vLLM MooncakeStoreConnector's (same Store)",
                      "issue 6 (bench serve)", fmt(v), _check(v, at_most=0.8)))
    ahead = [c for c in comps if c.get("kind") == "peer" and _num(c.get("ratio")) is not None]
    behind = [c for c in ahead if ("throughput" in c["what"] and c["ratio"] < 1.0)
              or ("TTFT" in c["what"] and c["ratio"] > 1.0)]
    goals.append(Goal("ahead of vLLM's own connectors on the same engine wherever both run",
                      "issue 8 (bench serve)",
                      (f"{len(ahead) - len(behind)} of {len(ahead)} comparisons ahead"
                       + (f"; behind: {', '.join(c['what'] for c in behind)}" if behind else ""))
                      if ahead else "–",
                      (not behind) if ahead else None))
    return goals


# ---------------------------------------------------------------------- plots
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    _plt().close(fig)
    return path


def plot_throughput(res: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """GB/s against block size: raw transfer engine (read/write ceiling), memcpy, offload."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in res.get("engine", {}).get("best") or []:
        series.setdefault(f"Mooncake TE {r['op']} (best point)", []).append(
            (r["block_kib"], r["GBps"]))
    for r in res.get("engine", {}).get("rows") or []:
        if r.get("batch") == 1 and r.get("concurrency") == 1:
            series.setdefault(f"Mooncake TE {r['op']}, 1 block/call", []).append(
                (r["block_kib"], r["GBps"]))
    for r in res.get("offload", {}).get("bandwidth") or []:
        series.setdefault("offload save", []).append((r["block_kib"], r["save_gbps"]))
        series.setdefault("offload load", []).append((r["block_kib"], r["load_gbps"]))
        series.setdefault("memcpy (offload run)", []).append((r["block_kib"], r["memcpy_gbps"]))
    for r in res.get("kernels", {}).get("results") or []:
        if _num(r.get("memcpy_gbps")) is not None and _num(r.get("gather")) is not None:
            series.setdefault("kernels gather", []).append(
                (r["block_kib"], r["memcpy_gbps"] * r["gather"]))
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 4))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    _block_axis(ax, series)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s")
    ax.set_title("Throughput against block size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


def _block_axis(ax: Any, series: dict[str, list[tuple[float, float]]]) -> None:
    ticks = sorted({p[0] for pts in series.values() for p in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in ticks], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("block size (KiB)")


def plot_ratios(res: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """Ratio to memcpy against block size (kernels, offload), with the 0.8 goal line."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in res.get("kernels", {}).get("results") or []:
        for k in ("gather", "scatter"):
            if _num(r.get(k)) is not None:
                series.setdefault(f"kernels {k}", []).append((r["block_kib"], r[k]))
    for r in res.get("offload", {}).get("bandwidth") or []:
        series.setdefault("offload save", []).append((r["block_kib"], r["save_ratio"]))
        series.setdefault("offload load", []).append((r["block_kib"], r["load_ratio"]))
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 3.5))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.axhline(0.8, color="grey", linestyle="--", label="goal 0.8")
    _block_axis(ax, series)
    ax.set_ylabel("throughput / memcpy")
    ax.set_title("Copy paths as a ratio of memcpy (same run)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


def plot_hit_rate(res: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """Trace replay: hit rate against pool capacity, with the unbounded pool's."""
    rows = res.get("trace", {}).get("rows") or []
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = [r["capacity_fraction"] for r in rows]
    ax.plot(xs, [r["hit_rate"] for r in rows], marker="o", label="local pool (LRU)")
    best = res["trace"].get("unbounded", {}).get("hit_rate")
    if best is not None:
        ax.axhline(best, color="grey", linestyle="--", label="unbounded pool (best possible)")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (fraction of the trace's distinct blocks)")
    ax.set_ylabel("block hit rate")
    ax.set_ylim(0, max(0.05, (best or 0) * 1.15, *(r["hit_rate"] for r in rows)))
    ax.set_title("Mooncake conversation trace: hit rate against capacity")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_serve(res: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """Serve: TTFT of each scenario (hit / D side) against recompute."""
    summary = res.get("serve", {}).get("summary") or {}
    items = []
    for name, s in summary.items():
        if name == "baseline":
            continue
        v = _num(s.get("hit_over_recompute", s.get("d_ttft_over_recompute")))
        if v is not None:
            items.append((name, v))
    if not items:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(items)))
    names = [i[0] for i in items]
    colors = ["tab:blue" if "ours" in n else "tab:orange" for n in names]
    ax.barh(names, [i[1] for i in items], color=colors)
    ax.axvline(1.0, color="grey", linestyle="--")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT / recompute TTFT (blue: ours, orange: vLLM's)")
    ax.set_title("Time to first token of a hit (P/D: on D) against recompute")
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


# ---------------------------------------------------------------------- sections
def _machine(res: dict[str, dict[str, Any]]) -> str:
    machines: dict[tuple[Any, Any, Any], list[tuple[str, Any]]] = {}
    for name, data in res.items():
        m = data.get("machine") or {}
        key = (m.get("platform"), m.get("cpus"), m.get("torch"))
        machines.setdefault(key, []).append((name, m.get("time", "?")))
    lines = []
    for (plat, cpus, torch), runs in machines.items():
        when = sorted(t for _n, t in runs)
        lines.append(f"- {plat}, {cpus} CPUs, torch {torch}; runs {when[0]} to {when[-1]} "
                     f"({', '.join(n for n, _t in runs)})")
    return "\n".join(lines)


def section_engine(d: dict[str, Any]) -> str:
    cfg = d.get("config", {})
    out = [f"{d.get('description', '')}. Protocol `{cfg.get('protocol')}` on "
           f"{cfg.get('host')}, {cfg.get('min_time_s')} s per point; data checked byte for "
           f"byte for block sizes {d.get('verified')} KiB.\n",
           "Ceiling per block size (the best point of the sweep):\n",
           md_table(d.get("best", []), ["op", "block_kib", "batch", "concurrency", "GBps",
                                         "p50_ms", "p99_ms"],
                    ["op", "block KiB", "batch", "threads", "GB/s", "p50 ms", "p99 ms"]),
           "\n<details><summary>The whole sweep</summary>\n\n",
           md_table(d.get("rows", []), ["op", "block_kib", "batch", "concurrency", "GBps",
                                         "p50_ms", "p99_ms"],
                    ["op", "block KiB", "batch", "threads", "GB/s", "p50 ms", "p99 ms"]),
           "\n</details>\n"]
    return "".join(out)


def section_kernels(d: dict[str, Any]) -> str:
    g = d.get("goal", {})
    return (f"Baseline: {d.get('config', {}).get('baseline', 'memcpy')}; ratio = "
            f"{d.get('config', {}).get('ratio', 'kernel / baseline')}. Goal: >= "
            f"{g.get('min_ratio')} from {g.get('from_block_kib')} KiB (worst "
            f"{fmt(_num(g.get('worst_ratio')))}).\n\n"
            + md_table(d.get("results", []), ["block_kib", "blocks", "memcpy_gbps", "gather",
                                               "scatter", "gather_layers", "scatter_layers"],
                       ["block KiB", "blocks", "memcpy GB/s", "gather / memcpy",
                        "scatter / memcpy", "gather all layers", "scatter all layers"]))


def section_p2p(d: dict[str, Any]) -> str:
    return (f"{d.get('description', '')}. Goal: {d.get('goal', '')}.\n\n"
            + md_table(d.get("results", []), ["blocks", "bytes", "raw_GBps", "connector_GBps",
                                               "ratio", "raw_ms", "connector_ms"],
                       ["blocks", "bytes", "raw GB/s", "connector GB/s",
                        "connector / raw", "raw ms", "connector ms"]))


def section_layerwise(d: dict[str, Any]) -> str:
    rows = d.get("rows", [])
    cols = list(dict.fromkeys(k for r in rows for k in r))
    out = (f"{d.get('what', '')}. Pull / layerwise: "
           f"**{fmt(_num(d.get('pull_over_layerwise')))}x**; P's forward pass with pushes / "
           f"without: {fmt(_num(d.get('layerwise_forward_slowdown')))}x.\n\n"
           + md_table(rows, cols))
    vs = d.get("vs_raw")
    if isinstance(vs, dict):
        out += (f"\n\nAgainst the raw engine: {vs.get('what', '')}. "
                f"{fmt(_num(vs.get('bytes')))} bytes: raw {fmt(_num(vs.get('raw_ms')))} ms "
                f"({fmt(_num(vs.get('raw_GBps')))} GB/s), connector "
                f"{fmt(_num(vs.get('connector_ms')))} ms ({fmt(_num(vs.get('connector_GBps')))} "
                f"GB/s): connector / raw **{fmt(_num(vs.get('ratio')))}**.")
    return out


def section_pool(d: dict[str, Any]) -> str:
    rows = d.get("rows", [])
    tput = [r for r in rows if "ratio" in r]
    look = [r for r in rows if "keys/s" in r]
    out = ["Put/get through the backend against the raw calls on the same data (local: a "
           "numpy copy; mooncake: `MooncakeDistributedStore` batch calls), same run.\n\n",
           md_table(tput, ["path", "GiB/s", "raw GiB/s", "ratio"],
                    ["path", "GiB/s", "raw GiB/s", "backend / raw"]),
           "\nLookup rate (goal >= 100k keys/s):\n\n",
           md_table(look, ["path", "keys/s"])]
    if isinstance(d.get("mooncake"), dict) and d["mooncake"].get("skipped"):
        out.append(f"\nMooncake part skipped: {d['mooncake']['skipped']}\n")
    return "".join(out)


def section_trace(d: dict[str, Any]) -> str:
    cfg = d.get("config", {})
    ub = d.get("unbounded", {})
    return (f"Replay of `{Path(str(cfg.get('trace', '?'))).name}`: {cfg.get('requests')} "
            f"requests, {cfg.get('unique_blocks')} distinct blocks of "
            f"{cfg.get('tokens_per_block')} tokens ({cfg.get('block_bytes')} bytes each here). "
            f"Best possible hit rate (unbounded pool): {fmt(_num(ub.get('hit_rate')))}.\n\n"
            + md_table(d.get("rows", []), ["capacity_fraction", "capacity_blocks", "hit_rate",
                                            "best_hit_rate", "vs_best", "requests/s"],
                       ["capacity (fraction)", "capacity (blocks)", "hit rate",
                        "unbounded", "hit / best", "requests/s"]))


def section_offload(d: dict[str, Any]) -> str:
    out = ["Save/load through the worker's copy path against memcpy of the same bytes:\n\n",
           md_table(d.get("bandwidth", []), ["block_kib", "blocks", "memcpy_gbps", "save_gbps",
                                              "load_gbps", "save_ratio", "load_ratio"],
                    ["block KiB", "blocks", "memcpy GB/s", "save GB/s", "load GB/s",
                     "save / memcpy", "load / memcpy"])]
    t = d.get("ttft") or {}
    if "hit_over_recompute" in t:
        out.append(f"\nTTFT of a repeated {t.get('prompt_tokens')}-token prompt ({t.get('dtype')}"
                   f", median of {t.get('repeats')}): host hit "
                   f"{fmt(_num(t.get('offload_hit_s')))} s, recompute "
                   f"{fmt(_num(t.get('recompute_s')))} s, vLLM's device prefix hit "
                   f"{fmt(_num(t.get('device_hit_s')))} s: hit / recompute "
                   f"**{fmt(_num(t.get('hit_over_recompute')))}**; first tokens equal: "
                   f"{fmt(t.get('first_token_equal'))}.\n")
    elif t:
        out.append(f"\nTTFT part: {t.get('skipped') or t.get('error')}\n")
    return "".join(out)


def section_serve(d: dict[str, Any], img: str | None) -> str:
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


def section_auth(d: dict[str, Any]) -> str:
    return (f"{d.get('description', '')}. Keyed / unkeyed messages per second: "
            f"{fmt(_num(d.get('ratio')))}; the key adds {fmt(_num(d.get('added_p50_us')))} us "
            f"to the median round trip; sealing and opening one frame takes "
            f"{fmt(_num(d.get('envelope_us')))} us.\n\n"
            + md_table(d.get("results", []), ["mode", "msgs_per_s", "p50_us", "p99_us"],
                       ["deployment key", "messages/s", "p50 us", "p99 us"]))


SECTIONS: list[tuple[str, str, str, Callable[[dict[str, Any]], str]]] = [
    ("engine", "Transfer engine alone (`bench engine`)", "the ceiling", section_engine),
    ("kernels", "KV block kernels (`bench kernels`)", "issue 3", section_kernels),
    ("p2p", "P/D pull connector vs raw engine (`bench p2p`)", "issue 4", section_p2p),
    ("layerwise", "Layerwise push vs pull (`bench layerwise`)", "issue 5", section_layerwise),
    ("pool", "KV pool backends (`bench pool`)", "issue 6", section_pool),
    ("trace", "Trace replay (`bench trace`)", "issue 6", section_trace),
    ("offload", "CPU offload copies (`bench offload`)", "issue 7", section_offload),
    ("auth", "Control plane with and without the deployment key (`bench auth`)", "issue 19",
     section_auth),
]


def render(res: dict[str, dict[str, Any]], docs: Path) -> str:
    """The Markdown page (plots written to ``docs/img``)."""
    img_dir = docs / "img"

    def plot(fn: Callable[[dict[str, dict[str, Any]], Path], Path | None],
             name: str) -> Path | None:
        try:
            return fn(res, img_dir / name)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # changed format
            logger.warning("plot %s skipped: %s: %s", name, type(exc).__name__, exc)
            return None

    plots = {
        "throughput": plot(plot_throughput, "bench-throughput-vs-block.png"),
        "ratios": plot(plot_ratios, "bench-ratio-vs-memcpy.png"),
        "hit_rate": plot(plot_hit_rate, "bench-hit-rate-vs-capacity.png"),
        "serve": plot(plot_serve, "bench-serve-ttft.png"),
    }

    def rel(p: Path | None) -> str | None:
        return f"img/{p.name}" if p else None

    parts = ["<!-- Generated by benchmarks/render.py from bench-results/*.json: do not edit. "
             "Regenerate with `nox -s bench`. -->\n",
             "# Benchmarks\n\n",
             "Every benchmark measures a path and its baseline in the same run and reports the "
             "ratio; the absolute numbers are those of the machine below, "
             f"{SHARED_VM_NOTE}. Run them yourself with `vllm-ascend-kv bench <name>` "
             "(`--quick` for a smoke run) or all of them with `nox -s bench`.\n\n",
             "Machine of this run:\n\n", _machine(res) or "- (no results)", "\n\n",
             "## Goals\n\n"]
    try:
        parts.append(md_table([{"goal": g.goal, "source": g.source, "measured": g.measured,
                                "met": verdict(g.met)} for g in evaluate_goals(res)],
                              ["goal", "source", "measured", "met"]))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # changed format
        parts.append(f"(could not check the goals: {type(exc).__name__}: {exc})\n")
    parts.append("\n")
    missing = [n for n in BENCHMARKS if n not in res]
    broken = [n for n in BENCHMARKS if "_error" in res.get(n, {})]
    if missing:
        parts.append(f"Not in this run: {', '.join(missing)}.\n\n")
    for n in broken:
        parts.append(f"Unreadable: {res[n]['_error']}.\n\n")
    if any(rel(p) for k, p in plots.items() if k != "serve"):
        parts.append("## Plots\n\n")
        for key, title in (("throughput", "Throughput against block size"),
                           ("ratios", "Ratio to memcpy against block size"),
                           ("hit_rate", "Hit rate against capacity")):
            if plots[key]:
                parts.append(f"![{title}]({rel(plots[key])})\n\n")
    if "serve" in res and "_error" not in res["serve"]:
        parts.append("## Serving on real vLLM CPU engines (`bench serve`)\n\n")
        parts.append(section_serve(res["serve"], rel(plots["serve"])))
        parts.append("\n")
    for name, title, source, fn in SECTIONS:
        if name in res and "_error" not in res[name]:
            parts.append(f"## {title}\n\n_{source}_. ")
            try:
                parts.append(fn(res[name]))
            except (AttributeError, KeyError, TypeError, ValueError) as exc:  # changed format
                parts.append(f"\n(could not render {name}.json: {type(exc).__name__}: {exc})\n")
            parts.append("\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Command line of the renderer."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="bench-results", help="directory of the JSON results")
    ap.add_argument("--docs", default="docs", help="docs directory (page and img/)")
    args = ap.parse_args(argv)
    res = load_results(Path(args.results))
    if not res:
        print(f"no benchmark results in {args.results}", file=sys.stderr)
        return 1
    docs = Path(args.docs)
    page = render(res, docs)
    (docs / "benchmarks.md").write_text(page)
    print(f"wrote {docs / 'benchmarks.md'} from {', '.join(sorted(res))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

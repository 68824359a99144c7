# SPDX-License-Identifier: Apache-2.0
"""Repeated alternating rounds of ``bench serve``.

The P/D scenarios are measured together, and so are the others (``pool``,
``offload``, ...: :func:`families`): their engines start once and stay up, and each
round measures the engine without a connector (the recompute and floor of that round's
prompts) and then every scenario of the group once, in turns (reversed every other round,
so neither side always goes first). While one P/D pair (or the engine without a connector)
is measured, the other kept P/D engines are paused (SIGSTOP). P/D families run once per
thread binding (:data:`~.spec.PD_BINDINGS`); each scenario is then reported once per
binding, as ``<name>[<binding>]``. The rounds of a scenario are kept beside
their aggregate (median per prompt over the rounds), so the report can put an
interval on every ratio (:mod:`..stats`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from ..benchutil import median
from .child import short_error
from .needs import skip_reason
from .scenarios import Run, reference
from .spec import FAMILY_ORDER, Scenario

logger = logging.getLogger(__name__)


def variant_name(name: str, binding: str | None) -> str:
    """The report's name of ``name`` run under ``binding``."""
    return f"{name}[{binding}]" if binding else name


def base_name(variant: str) -> str:
    """The scenario name of a report name (``pd/ours[pinned]`` -> ``pd/ours``)."""
    return variant.split("[", 1)[0]


def _entry(sc: Scenario, **extra: Any) -> dict[str, Any]:
    return {"family": sc.family, "who": sc.who, "connector": sc.connector,
            "describe": sc.describe, **extra}


def _call(sc: Scenario, run: Run) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """One measurement of ``sc``: ``(data, None)`` or ``(None, status entry)``."""
    try:
        assert sc.run is not None
        data = sc.run(run)
    except Exception as exc:  # one scenario's failure is reported, not fatal
        logger.warning("%s failed: %s", sc.name, exc)
        return None, {"status": "failed", "reason": short_error(str(exc)) or repr(exc),
                      "error": str(exc)[-4000:]}
    if "unsupported" in data:
        return None, {"status": "unsupported", "reason": data["unsupported"]}
    return data, {}


def families(chosen: Sequence[Scenario]) -> list[tuple[str, list[Scenario]]]:
    """The chosen scenarios but the baseline, by the rounds that measure them, in run
    order: the P/D family alone (its reference is the P/D prompts' on the engine without a
    connector, once per binding), then every other family together (``pool + offload``):
    each of those is measured against the same measurement of the engine without a
    connector (its :func:`cache_flow` of the round's prompts), so one a round serves them
    all, alternating with all their scenarios."""
    order = list(FAMILY_ORDER) + sorted({sc.family for sc in chosen} - set(FAMILY_ORDER))
    pd: list[Scenario] = []
    cache: list[Scenario] = []
    names: list[str] = []
    for fam in order:
        members = [sc for sc in chosen if sc.family == fam and sc.name != "baseline"]
        if members and fam == "pd":
            pd = members
        elif members:
            cache += members
            names.append(fam)
    return ([("pd", pd)] if pd else []) + ([(" + ".join(names), cache)] if cache else [])


def _cache_reference(base: dict[str, Any]) -> dict[str, Any]:
    """A round's reference from the baseline's :func:`cache_flow` of the same prompts."""
    rows = base.get("prompts", [])
    return {"recompute_s": {r["tokens"]: r["again_s"] for r in rows},
            "device_hit_s": {r["tokens"]: r["device_hit_s"] for r in rows},
            "tokens": {r["tokens"]: r["cold_token"] for r in rows},
            "output_tok_per_s": base.get("throughput", {}).get("output_tok_per_s")}


def run_rounds(run: Run, chosen: Sequence[Scenario]) -> dict[str, dict[str, Any]]:
    """Every chosen scenario over ``cfg.rounds`` alternating rounds; the entries of
    ``serve.json``'s ``scenarios``, by report name (the baseline first)."""
    cfg, steps = run.cfg, run.steps
    results: dict[str, dict[str, Any]] = {}
    baseline = next(sc for sc in chosen if sc.name == "baseline")
    runnable = []
    for sc in chosen:
        reason = skip_reason(sc, cfg)
        if reason:
            steps.note(f"{sc.name}: skipped: {reason}")
            results[sc.name] = _entry(sc, status="skipped", reason=reason)
        else:
            runnable.append(sc)
    if baseline not in runnable:
        return results
    start = time.monotonic()
    run.start_round(0)
    base, status = _call(baseline, run)
    results["baseline"] = _entry(baseline, status="ok", **base) if base else \
        _entry(baseline, **status)
    results["baseline"]["wall_s"] = time.monotonic() - start
    if base is None:
        return results
    results["baseline"]["rounds"] = [base]
    for fam, members in families(runnable):
        bindings: Sequence[str | None] = cfg.pd_bindings if fam == "pd" else (None,)
        for binding in bindings:
            run.binding = binding
            rounds: dict[str, list[dict[str, Any]]] = {}
            failed: dict[str, dict[str, Any]] = {}
            walls: dict[str, float] = {}
            for r in range(cfg.rounds):
                run.start_round(r, pd=fam == "pd")
                steps.note(f"{fam}{f' ({binding})' if binding else ''}: round {r + 1} of "
                           f"{cfg.rounds}: the engine without a connector")
                if fam == "pd":
                    run.pause_live()  # the kept pairs take no CPU time from the reference
                    ref = reference(run, run.pd_prompts, throughput=False)
                else:
                    data, _status = _call(baseline, run)
                    ref = _cache_reference(data) if data else None
                    if data:
                        results["baseline"]["rounds"].append(data)
                order = members if r % 2 == 0 else list(reversed(members))
                for sc in order:
                    name = variant_name(sc.name, binding)
                    if name in failed:
                        continue
                    steps.note(f"{name}: round {r + 1} of {cfg.rounds}")
                    t0 = time.monotonic()
                    data, status = _call(sc, run)
                    walls[name] = walls.get(name, 0.0) + time.monotonic() - t0
                    if data is None:
                        failed[name] = _entry(sc, **status)
                        continue
                    rounds.setdefault(name, []).append({**data, "reference": ref,
                                                        "round": r})
            run.close_live()
            for sc in members:
                name = variant_name(sc.name, binding)
                if name in rounds:
                    results[name] = _entry(sc, status="ok", binding=binding,
                                           **aggregate(rounds[name]))
                    if name in failed:
                        results[name]["partial"] = failed[name].get("reason")
                else:
                    results[name] = failed.get(name) or _entry(sc, status="failed",
                                                                reason="no round")
                    results[name]["binding"] = binding
                results[name]["wall_s"] = walls.get(name, 0.0)
    run.binding = None
    return results


def _med(values: Sequence[Any]) -> float | None:
    return median(v for v in values if isinstance(v, int | float))


def aggregate(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A scenario's rounds as one entry: per prompt length, the median over the rounds of
    each time (the samples concatenated); the rounds themselves under ``rounds``."""
    by_len: dict[int, list[dict[str, Any]]] = {}
    for rd in rounds:
        for row in rd.get("prompts", []):
            by_len.setdefault(row["tokens"], []).append(row)
    rows = []
    for rs in by_len.values():
        row = dict(rs[-1])
        for key, value in rs[-1].items():
            if key == "tokens":
                continue
            if isinstance(value, float):
                row[key] = _med([x.get(key) for x in rs])
            elif isinstance(value, list):
                row[key] = [v for x in rs for v in x.get(key) or []]
        if "again_cached" in row:  # a miss in any round shows
            row["again_cached"] = min(x.get("again_cached") or 0 for x in rs)
        if "d_external" in row:
            known = [x["d_external"] for x in rs if isinstance(x.get("d_external"), int)]
            row["d_external"] = min(known) if known else None
        bad = [x["finish"] for x in rs if x.get("finish") not in ("length", "stop")]
        row["finish"] = bad[0] if bad else rs[-1].get("finish")
        rows.append(row)
    checked = [_tokens_equal(rd) for rd in rounds]
    thr = [rd.get("throughput", {}).get("output_tok_per_s") for rd in rounds]
    refs = [rd["reference"] for rd in rounds if isinstance(rd.get("reference"), dict)]
    out: dict[str, Any] = {"prompts": rows, "rounds": rounds}
    warm = [rd["warm_up"] for rd in rounds if rd.get("warm_up")]
    if warm:  # the engine's first requests, before its first round (scenarios.warm_up)
        out["warm_up"] = warm[0]
    if any(c is not None for c in checked):
        out["tokens_equal"] = all(c is not False for c in checked)
    if any(isinstance(t, int | float) for t in thr):
        out["throughput"] = {"output_tok_per_s": _med(thr)}
    if refs:
        ref: dict[str, Any] = {}
        for key in ("recompute_s", "device_hit_s"):
            lens = {k for x in refs for k in x.get(key, {})}
            ref[key] = {k: _med([x[key].get(k) for x in refs]) for k in lens}
        if any("output_tok_per_s" in x for x in refs):
            ref["output_tok_per_s"] = _med([x.get("output_tok_per_s") for x in refs])
        out["reference"] = ref
    return out


def _tokens_equal(rd: dict[str, Any]) -> bool | None:
    """Whether every first token of a round equals the engine without a connector's on the
    same prompt (``None`` without that engine's tokens)."""
    ref = (rd.get("reference") or {}).get("tokens")
    if not isinstance(ref, dict):
        return None
    ref = {int(k): v for k, v in ref.items()}
    for row in rd.get("prompts", []):
        want = ref.get(row["tokens"])
        got = row.get("d_tokens_all") or [row.get("d_token")] if "d_ttft_s" in row else \
            [row.get("cold_token"), *(row.get("again_tokens_all") or [row.get("again_token")])]
        if want is None or any(t != want for t in got):
            return False
    return True

# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench fleet``: our proxy and ``vllm-router`` side by side in front of a
simulated fleet (16 to 256 instances, ``docs/fleet-simulation.md``).

Every figure comes from the per-request samples a run keeps (``result.runs[].samples``: each
request's status, router-added seconds, cached and prompt tokens, modelled TTFT) and the
run's own counters (its wall time, the router process's CPU seconds a request, the offline
best hit rate of its requests, the churn events). A run of ``--rounds`` repeats every router
at every point; a figure over rounds is the median of the rounds' figures with a 95%
bootstrap interval over the rounds, and a figure of one round has no interval.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
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

#: The goals of issue 53: routing quality at least vllm-router's best policy on every
#: trace; router p99 added latency at most 2 ms at 1,000 requests/s with 256 instances; no
#: request lost under churn.
P99_MS, P99_RATE, P99_INSTANCES = 2.0, 1000.0, 256
ALL_TRACES = ("conversation", "deep-prefix-tree", "zipf-scans")
OURS, PEER = "ours", "vllm-router"
Key = tuple[int, str, str, str, float, bool]


# ---------------------------------------------------------------------- figures of a run
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile, linear between closest ranks (as the bench computes it)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def figures(run: Mapping[str, Any]) -> dict[str, float | None]:
    """One run's figures from its per-request samples: completed a second, failures,
    router-added p50/p99 (ms), modelled TTFT p99 (ms), hit rate and hit rate / the offline
    best, router CPU ms a completed request."""
    samples = [s for s in run.get("samples") or [] if isinstance(s, Mapping)]
    ok = [s for s in samples if s.get("status") == 200]
    router = [float(s["router_s"]) * 1e3 for s in ok if num(s.get("router_s")) is not None]
    ttft = [float(s["ttft_model_s"]) * 1e3 for s in ok
            if num(s.get("ttft_model_s")) is not None]
    prompt = sum(int(s.get("prompt_tokens") or 0) for s in ok)
    hit = sum(int(s.get("cached_tokens") or 0) for s in ok) / prompt if prompt else None
    best, wall = num(run.get("best_hit_rate")), num(run.get("wall_s"))
    return {"requests": float(len(samples)), "failed": float(len(samples) - len(ok)),
            "done_per_s": len(ok) / wall if wall else None,
            "router_p50_ms": percentile(router, 50), "router_p99_ms": percentile(router, 99),
            "ttft_p99_ms": percentile(ttft, 99), "hit_rate": hit,
            "hit_vs_best": hit / best if hit is not None and best else None,
            "cpu_ms": num(run.get("router_cpu_ms_per_request"))}


def key_of(run: Mapping[str, Any]) -> Key:
    """What a run measured: fleet size, trace, router, policy, rate, churn (not the round)."""
    return (int(run.get("instances") or 0), str(run.get("trace")), str(run.get("router")),
            str(run.get("policy")), float(run.get("rate") or 0.0), bool(run.get("churn")))


def by_point(result: Mapping[str, Any]) -> dict[Key, list[Mapping[str, Any]]]:
    """The runs that started (``status`` ok) grouped by what they measured, round by round
    (a run without ``round`` is round 0)."""
    out: dict[Key, list[Mapping[str, Any]]] = {}
    for run in result.get("runs") or []:
        if isinstance(run, Mapping) and run.get("status") == "ok":
            out.setdefault(key_of(run), []).append(run)
    return {k: sorted(v, key=lambda r: int(r.get("round") or 0)) for k, v in out.items()}


def per_round(runs: Iterable[Mapping[str, Any]], name: str) -> list[float]:
    """Figure ``name`` of each round (rounds without it left out)."""
    return [v for v in (figures(r)[name] for r in runs) if v is not None]


# ---------------------------------------------------------------------- the body
def section_fleet(d: dict[str, Any], images: Images) -> str:
    """Body of the section: the cost model the instances slept by, a table of the runs without
    churn, each router at its best policy beside the other's, and a table of the churn runs."""
    del images
    cfg = d.get("config") or {}
    cost = cfg.get("cost_model") or {}
    points = by_point(d)
    rounds = max((len(v) for v in points.values()), default=0)
    out = [f"Fleet sizes {', '.join(map(str, cfg.get('instances') or []))} (half P, half D), "
           f"traces {', '.join(cfg.get('traces') or [])}, {cfg.get('duration_s')} s of Poisson "
           f"arrivals a point, {cfg.get('output_len')} output tokens, "
           f"{cfg.get('capacity_blocks')} cached blocks an instance, the cost model's times "
           f"times {cost.get('scale')}; {rounds} round(s) a point. `router-added`: client "
           "latency minus P's and D's time inside the instances (the row `none` is the "
           "client routing alone); `hit / best`: P's cached tokens over prompt tokens, over "
           "the offline best of the same requests; `CPU`: the router process's CPU "
           "milliseconds a completed request. "
           + ("Cells: median over the rounds [95% bootstrap interval]. " if rounds > 1
              else "One round a point: no interval. ")
           + "Every figure from the run's per-request samples.\n\n"]
    if cost:
        out.append(_cost_line(cost))
    rows = []
    for k, runs in sorted(points.items()):
        if k[5]:
            continue
        rows.append({"n": k[0], "trace": k[1], "router": f"{k[2]}:{k[3]}", "rate": k[4],
                     "rounds": len(runs),
                     **{f: median_cell(per_round(runs, f)) for f in (
                         "done_per_s", "failed", "router_p50_ms", "router_p99_ms", "cpu_ms",
                         "hit_vs_best", "ttft_p99_ms")}})
    if rows:
        out.append(md_table(rows, ["n", "trace", "router", "rate", "rounds", "done_per_s",
                                   "failed", "router_p50_ms", "router_p99_ms", "cpu_ms",
                                   "hit_vs_best", "ttft_p99_ms"],
                            ["N", "trace", "router:policy", "rate/s", "rounds", "done/s",
                             "failed", "router-added p50 ms", "p99 ms", "CPU ms/request",
                             "hit / best", "modelled TTFT p99 ms"]))
    best = _best_rows(points)
    if best:
        out.append("\nEach router at its best policy (the policy of the highest median "
                   "`hit / best` at the point) where both ran; `quality`: ours' `hit / best` "
                   "over vllm-router's, the figure the routing-quality goal judges:\n\n")
        out.append(md_table(best, ["n", "trace", "rate", "o_pol", "o_hit", "o_done", "o_p99",
                                   "o_cpu", "v_pol", "v_hit", "v_done", "v_p99", "v_cpu",
                                   "quality"],
                            ["N", "trace", "rate/s", "ours: policy", "hit / best", "done/s",
                             "p99 ms", "CPU ms/request", "vllm-router: policy", "hit / best",
                             "done/s", "p99 ms", "CPU ms/request", "quality"]))
    out.append(_sweep_part(points))
    failed = [r for r in d.get("runs") or [] if isinstance(r, Mapping)
              and r.get("status") != "ok"]
    if failed:
        out.append("\nRouters that did not start: " + "; ".join(
            f"N={r.get('instances')} {r.get('router')}:{r.get('policy')} "
            f"({fmt(str(r.get('reason', ''))[-120:])})" for r in failed) + ".\n")
    churn = _churn_rows(points)
    if churn:
        out.append("\nUnder churn (10% of P added, drained and killed mid-run, at the highest "
                   "rate on the first trace): failed requests, seconds from the router's add "
                   "to a new P's first request (– where the router refused the add), "
                   "from a P's death to the last request routed to it, and the requests "
                   "routed to each killed P after its death (health probes not counted):"
                   "\n\n")
        out.append(md_table(churn, ["n", "router", "rate", "requests", "failed", "p99",
                                    "take_in", "stop", "attempts", "add"],
                            ["N", "router:policy", "rate/s", "requests", "failed",
                             "router-added p99 ms", "take-in s", "stop-routing s",
                             "requests to a dead P", "the router's answer to add"]))
    return "".join(out)


def _churn_rows(points: Mapping[Key, list[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for k, runs in sorted(points.items()):
        if not k[5]:
            continue
        for r in runs:
            cf = r.get("churn_figures") or {}
            adds = [e for e in cf.get("events") or [] if e.get("what") == "add"]
            kills = [e for e in cf.get("events") or [] if e.get("what") == "kill"]
            f = figures(r)
            rows.append({
                "n": k[0], "router": f"{k[2]}:{k[3]}", "rate": k[4], "requests": f["requests"],
                "failed": f["failed"], "p99": f["router_p99_ms"],
                "attempts": ", ".join(fmt(e.get("attempts_after_death")) for e in kills),
                "take_in": ", ".join(fmt(num(x)) for x in cf.get("take_in_s") or []),
                "stop": ", ".join(fmt(num(x)) for x in cf.get("stop_routing_s") or []),
                "add": "ok" if adds and all(e.get("router_ok") for e in adds)
                else str((adds[0] if adds else {}).get("router_answer", "–"))[:80]})
    return rows


def _cost_line(cost: Mapping[str, Any]) -> str:
    """The cost model the run's instances slept by: the committed fit's coefficients (as the
    run recorded them) and the scale."""
    a, b, c = (num(cost.get(f)) for f in ("prefill_base_s", "prefill_s_per_token",
                                          "prefill_s_per_token2"))
    dec = num(cost.get("decode_s_per_token"))
    return (f"Cost model (fit of `{Path(str(cost.get('fit') or 'costmodel.json')).name}`): "
            f"prefill seconds {fmt(a)} + {fmt(b)} n + {fmt(c)} n² for n tokens computed, "
            f"decode {fmt(dec * 1e3 if dec is not None else None)} ms a token; the instances "
            f"sleep these times {fmt(num(cost.get('scale')))}.\n\n")


def _best_rows(points: Mapping[Key, list[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """A row per point (fleet size, trace, rate) both routers ran without churn: each at its
    best policy, and the ratio of their hit rates over the offline best."""
    rows = []
    for where in sorted({(k[0], k[1], k[4]) for k in points if not k[5]}):
        ours, peer = _best(points, where, OURS), _best(points, where, PEER)
        if ours is None or peer is None:
            continue
        row: dict[str, Any] = {"n": where[0], "trace": where[1], "rate": where[2]}
        for side, (policy, runs) in (("o", ours), ("v", peer)):
            row[f"{side}_pol"] = policy
            for name, f in (("hit", "hit_vs_best"), ("done", "done_per_s"),
                            ("p99", "router_p99_ms"), ("cpu", "cpu_ms")):
                row[f"{side}_{name}"] = median_cell(per_round(runs, f))
        row["quality"] = ratio_cell(per_round(ours[1], "hit_vs_best"),
                                    per_round(peer[1], "hit_vs_best"))
        rows.append(row)
    return rows


# ---------------------------------------------------------------------- rate sweep
#: The growth of the router-added p99 over that at the lowest rate that counts as "doubled".
#: (Open loop: a router that does not keep up queues, and its p99 grows with the queue.)
DOUBLED = 2.0


def _by_round(runs: Iterable[Mapping[str, Any]], name: str) -> dict[int, float]:
    """Figure ``name`` of each round, by round number (rounds without it left out)."""
    out = {}
    for r in runs:
        v = figures(r)[name]
        if v is not None:
            out[int(r.get("round") or 0)] = v
    return out


def sweeps(points: Mapping[Key, list[Mapping[str, Any]]]
           ) -> dict[tuple[int, str, str, str], list[dict[str, Any]]]:
    """Every router and policy run at three or more rates (fleet size and trace the same,
    no churn): per rate, its runs, the router-added p99 over the lowest rate's (rounds
    paired) with its interval, and whether that interval lies wholly below
    :data:`DOUBLED`."""
    from vllm_ascend.distributed.kv_transfer.bench.stats import compare

    groups: dict[tuple[int, str, str, str], dict[float, list[Mapping[str, Any]]]] = {}
    for k, runs in points.items():
        if not k[5]:
            groups.setdefault((k[0], k[1], k[2], k[3]), {})[k[4]] = runs
    out = {}
    for g, by_rate in sorted(groups.items()):
        if len(by_rate) < 3:
            continue
        rates = sorted(by_rate)
        base = _by_round(by_rate[rates[0]], "router_p99_ms")
        rows = []
        for rate in rates:
            p99 = _by_round(by_rate[rate], "router_p99_ms")
            both = sorted(set(p99) & set(base))
            st = compare([p99[r] for r in both], [base[r] for r in both])
            rows.append({"rate": rate, "runs": by_rate[rate], "p99_growth": st,
                         "below": st.high is not None and st.high < DOUBLED})
        out[g] = rows
    return out


def sustained(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The highest rate up to which every rate run kept the p99's growth wholly below
    :data:`DOUBLED` (None: not even the lowest)."""
    best = None
    for row in rows:
        if not row["below"]:
            break
        best = row["rate"]
    return best


def _sweep_part(points: Mapping[Key, list[Mapping[str, Any]]]) -> str:
    found = sweeps(points)
    if not found:
        return ""
    rows = []
    for (n, trace, router, policy), rs in found.items():
        for r in rs:
            st = r["p99_growth"]
            rows.append({"n": n, "trace": trace, "router": f"{router}:{policy}",
                         "rate": r["rate"], "rounds": st.rounds,
                         "done": median_cell(per_round(r["runs"], "done_per_s")),
                         "p99": median_cell(per_round(r["runs"], "router_p99_ms")),
                         "growth": (f"{fmt(st.ratio)} [{fmt(st.low)}–{fmt(st.high)}]"
                                    if st.ratio is not None else "–"),
                         "ok": "yes" if r["below"] else "no"})
    lines = "".join(
        f"- `{router}:{policy}` (N={n}, {trace}): "
        + (f"up to {fmt(rate)}/s of the rates run" if (rate := sustained(rs)) is not None
           else "not at the lowest rate run")
        + "\n" for (n, trace, router, policy), rs in found.items())
    return ("\nThe rate one router process sustains: each router and policy run at rising "
            "rates, its router-added p99 over the one at the lowest rate (rounds paired, "
            f"median [95% bootstrap interval]); a rate counts as sustained while that growth "
            f"lies wholly below {DOUBLED:g}x, at it and every lower rate (open loop: a router "
            "that does not keep up queues, and its p99 grows with the queue; `done/s` "
            "below the rate says so too, though a short run's Poisson arrivals and its last "
            "answers' latency keep it a little below the rate for any router). `ours*N`: N "
            "replicas of our proxy, the requests spread over them in turn, sharing nothing "
            "but the instances' KV events; the row `none` is what the client and the fleet "
            "sustain alone.\n\n"
            + md_table(rows, ["n", "trace", "router", "rate", "rounds", "done", "p99",
                              "growth", "ok"],
                       ["N", "trace", "router:policy", "rate/s", "rounds", "done/s",
                        "router-added p99 ms", "p99 / p99 at the lowest rate",
                        "sustained"])
            + "\nSustained, each:\n\n" + lines)


# ---------------------------------------------------------------------- goals
def _best(points: Mapping[Key, list[Mapping[str, Any]]], where: tuple[int, str, float],
          router: str) -> tuple[str, list[Mapping[str, Any]]] | None:
    """``router``'s best policy at one point and its runs: the policy of the highest median
    hit / best over the rounds (each router at its own best)."""
    cands = [(k[3], runs) for k, runs in points.items()
             if (k[0], k[1], k[4]) == where and k[2] == router and not k[5]
             and per_round(runs, "hit_vs_best")]
    return max(cands, key=lambda c: statistics.median(per_round(c[1], "hit_vs_best")),
               default=None)


def _best_policy(points: Mapping[Key, list[Mapping[str, Any]]], where: tuple[int, str, float],
                 router: str) -> list[float] | None:
    """The per-round hit / best of ``router``'s best policy at one point."""
    best = _best(points, where, router)
    return per_round(best[1], "hit_vs_best") if best else None


def quality_vs_vllm_router(entry: Mapping[str, Any]) -> Measured | None:
    """Our proxy's best policy's hit rate / the offline best over vllm-router's best
    policy's, round by round, at every fleet size, trace and rate both ran; the point whose
    interval lies lowest decides."""
    points = by_point(entry.get("result") or {})
    found = []
    for where in sorted({(k[0], k[1], k[4]) for k in points if not k[5]}):
        ours, peer = _best_policy(points, where, OURS), _best_policy(points, where, PEER)
        if ours and peer:
            found.append(judged_ratio(ours, peer, at_least=1.0,
                                      where=f"{where[1]}, N={where[0]}, {where[2]:g}/s"))
    return worst(found, at_least=True)


def _at_most(values: Sequence[float], bound: float, unit: str, where: str) -> Measured:
    """The median of per-round figures with its bootstrap interval, met when the interval's
    high end is at most ``bound``."""
    from vllm_ascend.distributed.kv_transfer.bench.stats import compare_difference

    st = compare_difference(list(values), [0.0] * len(values))
    met = st.high is not None and st.high <= bound
    return Measured(st.ratio, st.low, st.high, st.rounds, met, where, unit)


def router_p99(entry: Mapping[str, Any]) -> Measured | None:
    """Router-added p99 (ms) of each of our proxy's policies at 256 instances and 1,000
    requests a second, per round; every policy run must meet it, the highest decides."""
    points = by_point(entry.get("result") or {})
    found = [_at_most(per_round(runs, "router_p99_ms"), P99_MS, " ms", f"{k[3]}, {k[1]}")
             for k, runs in sorted(points.items())
             if k[0] == P99_INSTANCES and k[4] == P99_RATE and k[2] == OURS and not k[5]]
    return worst([m for m in found if m.rounds], at_least=False)


def no_request_lost(entry: Mapping[str, Any]) -> Measured | None:
    """Failed requests of each of our proxy's churn runs, summed over the rounds: one lost
    request in any round fails the row (a count, not an estimate: its interval is itself)."""
    points = by_point(entry.get("result") or {})
    found = []
    for k, runs in sorted(points.items()):
        failed = per_round(runs, "failed")
        if k[2] == OURS and k[5] and failed:
            total = sum(failed)
            found.append(Measured(total, total, total, len(failed), total == 0,
                                  f"{k[3]}, N={k[0]}", " failed"))
    return worst(found, at_least=False)


def sustains_vllm_routers_rate(entry: Mapping[str, Any]) -> Measured | None:
    """The rate one process of our proxy sustains (:func:`sustained`, its best policy of
    those run) over vllm-router's (its best), at each fleet size and trace both were swept;
    the lowest decides. A count of the rates run, not an estimate: its interval is itself."""
    found = sweeps(by_point(entry.get("result") or {}))
    out = []
    for n, trace in sorted({(g[0], g[1]) for g in found}):
        best: dict[str, float] = {}
        rounds = 0
        for (gn, gt, router, _policy), rs in found.items():
            if (gn, gt) == (n, trace) and router in (OURS, PEER):
                rate = sustained(rs) or 0.0
                best[router] = max(best.get(router, 0.0), rate)
                rounds = max(rounds, min(r["p99_growth"].rounds for r in rs))
        if len(best) == 2 and best[PEER] > 0:
            v = best[OURS] / best[PEER]
            out.append(Measured(v, v, v, rounds, v >= 1.0,
                                f"{fmt(best[OURS])}/s against {fmt(best[PEER])}/s, N={n}, "
                                f"{trace}"))
    return worst(out, at_least=True)


def _listed(want: Callable[[list[str]], bool]) -> Callable[[Any], bool]:
    """A test of a comma-separated option of the run's command line (never of its result)."""
    return lambda have: isinstance(have, str) and want(have.split(","))


GOALS = (
    GoalSpec("fleet routing quality: our proxy's prefix hit rate / offline best >= "
             "vllm-router's, each at its best policy, every trace", "fleet",
             "vllm-router (its best policy)", quality_vs_vllm_router,
             {"traces": _listed(lambda xs: set(ALL_TRACES) <= set(xs)),
              "routers": _listed(lambda xs: any(x.startswith(OURS + ":") for x in xs)
                                and any(x.startswith(PEER + ":") for x in xs)),
              "churn": lambda c: c != "only"}, rank=70,
             short="fleet routing quality >= vllm-router's"),
    GoalSpec(f"fleet: our proxy's router-added p99 <= {P99_MS:g} ms at {P99_RATE:,.0f} "
             f"requests/s with {P99_INSTANCES} instances", "fleet", "(absolute)", router_p99,
             {"instances": _listed(lambda xs: str(P99_INSTANCES) in xs),
              "rates": _listed(lambda xs: any(float(x) == P99_RATE for x in xs)), "churn": lambda c: c != "only"}, rank=71,
             short=f"fleet router p99 <= {P99_MS:g} ms ({P99_INSTANCES}, {P99_RATE:,.0f}/s)"),
    GoalSpec("fleet under churn (10% of P added, drained, killed mid-run): no request lost "
             "through our proxy", "fleet", "(absolute)", no_request_lost,
             {"churn": lambda c: c in ("also", "only")}, rank=72,
             short="fleet churn: no request lost"),
    GoalSpec("fleet: one process of our proxy sustains at least vllm-router's request rate "
             "before its router-added p99 doubles", "fleet",
             "vllm-router (its best policy)", sustains_vllm_routers_rate,
             {"rates": _listed(lambda xs: len(xs) >= 3),
              "routers": _listed(lambda xs: any(x.startswith(OURS + ":") for x in xs)
                                and any(x.startswith(PEER + ":") for x in xs)),
              "churn": lambda c: c != "only"}, rank=73,
             short="fleet: sustains vllm-router's rate"),
)


SECTION = Section("Routers in front of a simulated fleet (`bench fleet`)", "issue 53", 70,
                  section_fleet, GOALS)

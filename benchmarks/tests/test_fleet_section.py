# SPDX-License-Identifier: Apache-2.0
"""The ``bench fleet`` section: figures from the per-request samples, its goal rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

render = sys.modules["bench_render"]  # loaded by conftest.py

ledger = render.ledger
fleet = importlib.import_module("bench_sections.fleet")
HEAD = {"ascend-kv-core": "tree-c", "ascend-kv-p2p": "tree-p"}
QUALITY = ("fleet routing quality: our proxy's prefix hit rate / offline best >= "
           "vllm-router's, each at its best policy, every trace")
P99 = "fleet: our proxy's router-added p99 <= 2 ms at 1,000 requests/s with 256 instances"
CHURN = ("fleet under churn (10% of P added, drained, killed mid-run): no request lost "
         "through our proxy")


def _run(router: str, policy: str, trace: str, *, hit: float, router_ms: float = 1.0,
         n: int = 256, rate: float = 1000.0, rnd: int = 0, failed: int = 0,
         churn: bool = False) -> dict[str, Any]:
    """A run of 100 requests of 100 prompt tokens, ``hit`` of them cached (offline best 0.5),
    the router adding ``router_ms`` to 98 of them and ten times as much to the two slowest."""
    samples = [{"status": 200, "prompt_tokens": 100, "cached_tokens": int(hit * 100),
                "router_s": router_ms * (10 if i >= 98 - failed else 1) / 1e3,
                "ttft_model_s": 0.01} for i in range(100 - failed)]
    samples += [{"status": 500, "prompt_tokens": 100, "router_s": None}] * failed
    return {"instances": n, "trace": trace, "router": router, "policy": policy, "rate": rate,
            "churn": churn, "round": rnd, "status": "ok", "wall_s": 2.0,
            "best_hit_rate": 0.5, "router_cpu_ms_per_request": 0.5, "samples": samples}


def _entry(runs: list[dict[str, Any]], config: dict[str, Any],
           ended: str = "2026-12-06T10:00:00Z") -> dict[str, Any]:
    return {"format": 1, "section": "fleet", "started": ended, "ended": ended,
            "source": {"commit": "a" * 40, "dirty": False, "packages": dict(HEAD)},
            "versions": {}, "machine": {}, "config": config,
            "result": {"config": {"instances": [256], "traces": list(fleet.ALL_TRACES)},
                       "runs": runs}, "samples": []}


def _rows(entries: list[dict[str, Any]], tmp_path: Path) -> dict[str, Any]:
    for e in entries:
        ledger.append(tmp_path / "ledger", e)
    stored = ledger.read_entries(tmp_path / "ledger")
    return {r.spec.goal: r for r in render.evaluate_goals(stored, HEAD)}


FULL = {"instances": "64,256", "rates": "100,1000", "traces": ",".join(fleet.ALL_TRACES),
        "routers": "ours:kv_aware,vllm-router:cache_aware", "churn": "no"}


def test_a_runs_figures_come_from_its_requests() -> None:
    f = fleet.figures(_run("ours", "kv_aware", "conversation", hit=0.45, failed=4))
    assert f["requests"] == 100 and f["failed"] == 4 and f["done_per_s"] == 48.0
    assert f["hit_rate"] == 0.45 and abs(f["hit_vs_best"] - 0.9) < 1e-12
    assert f["router_p50_ms"] == 1.0 and f["router_p99_ms"] == 10.0
    assert f["cpu_ms"] == 0.5


def test_quality_against_vllm_routers_best_policy_on_every_trace(tmp_path: Path) -> None:
    runs = []
    for rnd in range(9):
        for trace in fleet.ALL_TRACES:
            # ours at its best policy (kv_aware) against the peer's best (cache_aware); a
            # worse policy of either side does not count
            runs += [_run("ours", "kv_aware", trace, hit=0.49, rnd=rnd),
                     _run("ours", "round_robin", trace, hit=0.2, rnd=rnd),
                     _run("vllm-router", "cache_aware", trace,
                          hit=0.45 if trace != "zipf-scans" else 0.5, rnd=rnd),
                     _run("vllm-router", "round_robin", trace, hit=0.2, rnd=rnd)]
    row = _rows([_entry(runs, FULL)], tmp_path)[QUALITY]
    assert row.measured.rounds == 9 and row.met is False  # zipf-scans: 0.49 / 0.5
    assert row.measured.where.startswith("zipf-scans") and abs(row.measured.value - 0.98) < 1e-9
    p99 = _rows([], tmp_path)[P99]  # same ledger: 9 rounds of 256 instances at 1,000/s
    assert p99.measured.rounds == 9 and p99.met is False  # the slowest request: 10 ms
    assert p99.measured.value > 2.0 and p99.measured.unit == " ms"


def test_a_single_round_has_no_interval_and_is_not_met(tmp_path: Path) -> None:
    runs = [_run(r, p, t, hit=0.5, router_ms=0.1) for t in fleet.ALL_TRACES
            for r, p in (("ours", "kv_aware"), ("vllm-router", "cache_aware"))]
    rows = _rows([_entry(runs, FULL)], tmp_path)
    assert rows[QUALITY].why == "1 round, fewer than 9" and rows[QUALITY].met is False
    assert "(1 round: no interval)" in render.value_cell(rows[QUALITY].measured)
    assert rows[CHURN].entry is None and rows[CHURN].why == "no run recorded"


def test_rows_read_only_runs_of_their_options(tmp_path: Path) -> None:
    runs = [_run("ours", "kv_aware", "conversation", hit=0.5, n=64, rate=100.0, rnd=r)
            for r in range(9)]
    small = {**FULL, "instances": "64", "rates": "100", "traces": "conversation"}
    rows = _rows([_entry(runs, small)], tmp_path)
    assert rows[P99].entry is None and rows[QUALITY].entry is None
    churn = [_run("ours", "kv_aware", "conversation", hit=0.5, n=64, rate=40.0, rnd=r,
                  churn=True, failed=1 if r == 3 else 0) for r in range(9)]
    rows = _rows([_entry(churn, {**small, "churn": "only"}, "2026-12-06T11:00:00Z")],
                 tmp_path / "b")
    assert rows[CHURN].measured.rounds == 9 and rows[CHURN].met is False  # one lost
    assert rows[CHURN].measured.value == 1.0


def test_the_section_renders_rounds_with_intervals_and_churn() -> None:
    runs = [_run("ours", "kv_aware", "conversation", hit=0.4 + 0.01 * r, rnd=r)
            for r in range(3)]
    runs.append({**_run("ours", "kv_aware", "conversation", hit=0.5, churn=True, rate=40.0),
                 "churn_figures": {"take_in_s": [0.5], "stop_routing_s": [0.3],
                                   "events": [{"what": "add", "router_ok": True},
                                              {"what": "kill", "attempts_after_death": 2}]}})
    runs.append({"instances": 256, "trace": "conversation", "router": "vllm-router",
                 "policy": "kv_aware", "rate": 1000.0, "status": "failed",
                 "reason": "no binary"})
    body = fleet.section_fleet(_entry(runs, FULL)["result"], {})
    assert "| 256 | conversation | ours:kv_aware | 1e+03 | 3 |" in body
    assert "0.82 [0.8–0.84]" in body  # hit / best: median of the rounds [bootstrap]
    # churn: failed, router-added p99 (the two slowest at 10 ms), take-in, stop-routing, the
    # requests routed to the killed P after its death, the add's answer
    assert "| 256 | ours:kv_aware | 40 | 100 | 0 | 10 | 0.5 | 0.3 | 2 | ok |" in body
    assert "did not start: N=256 vllm-router:kv_aware (no binary)" in body


def test_the_section_shows_the_cost_model_and_each_router_at_its_best_policy() -> None:
    runs = [_run("ours", "kv_aware", "zipf-scans", hit=0.45, rnd=r) for r in range(3)]
    runs += [_run("ours", "round_robin", "zipf-scans", hit=0.2, rnd=r) for r in range(3)]
    runs += [_run("vllm-router", "cache_aware", "zipf-scans", hit=0.5, router_ms=0.5, rnd=r)
             for r in range(3)]
    runs += [_run("vllm-router", "kv_aware", "zipf-scans", hit=0.3, rnd=r) for r in range(3)]
    runs.append(_run("ours", "kv_aware", "conversation", hit=0.5))  # no peer: no best row
    result = {"config": {"instances": [256], "traces": ["zipf-scans", "conversation"],
                         "cost_model": {"prefill_base_s": 0.02, "prefill_s_per_token": 5e-4,
                                        "prefill_s_per_token2": 4e-7,
                                        "decode_s_per_token": 0.014, "scale": 0.02,
                                        "fit": "/x/fleet/costmodel.json"}},
              "runs": runs}
    body = fleet.section_fleet(result, {})
    assert ("prefill seconds 0.02 + 0.0005 n + 4e-07 n² for n tokens computed, decode 14 ms "
            "a token; the instances sleep these times 0.02") in body
    best = [line for line in body.splitlines()
            if line.startswith("| 256 | zipf-scans | 1e+03 |") and "kv_aware | 0.9" in line]
    # ours at kv_aware (0.45 / 0.5 of the best), the peer at cache_aware (1.0): quality 0.9;
    # 100 answers in 2 s; each side's p99 is its two slowest requests' (10 times its usual)
    assert best == ["| 256 | zipf-scans | 1e+03 | kv_aware | 0.9 [0.9–0.9] | 50 [50–50] "
                    "| 10 [10–10] | 0.5 [0.5–0.5] | cache_aware | 1 [1–1] | 50 [50–50] "
                    "| 5 [5–5] | 0.5 [0.5–0.5] | 0.9 [0.9–0.9] |"]
    assert "| 256 | conversation | 1e+03 | kv_aware" not in body


SUSTAINS = ("fleet: one process of our proxy sustains at least vllm-router's request rate "
            "before its router-added p99 doubles")


def _sweep(growth: dict[str, list[float]], rates: list[float], *, rounds: int = 9
           ) -> list[dict[str, Any]]:
    """Runs of each router at each rate, 9 rounds: its router-added times ``growth[router]``
    at each rate (a little noise a round)."""
    runs = []
    for rnd in range(rounds):
        for router, gs in growth.items():
            kind, policy = router.split(":")
            for rate, g in zip(rates, gs, strict=True):
                run = _run(kind, policy, "conversation", hit=0.4, router_ms=g * (1 + 0.01 * (rnd % 3)),
                           n=64, rate=rate, rnd=rnd)
                run["wall_s"] = 100 / rate
                runs.append(run)
    return runs


def test_the_rate_one_process_sustains_before_its_p99_doubles(tmp_path: Path) -> None:
    rates = [50.0, 100.0, 200.0, 400.0]
    runs = _sweep({"ours:kv_aware": [1.0, 1.2, 1.5, 5.0],
                   "ours*2:kv_aware": [1.0, 1.0, 1.1, 1.2],
                   "vllm-router:cache_aware": [1.0, 1.0, 1.1, 1.2]}, rates)
    found = fleet.sweeps(fleet.by_point({"runs": runs}))
    by = {g[2]: rs for g, rs in found.items()}
    assert fleet.sustained(by["ours"]) == 200.0  # p99 at 5x at 400/s
    assert fleet.sustained(by["vllm-router"]) == 400.0
    assert fleet.sustained(by["ours*2"]) == 400.0
    assert abs(by["ours"][3]["p99_growth"].ratio - 5.0) < 1e-9
    cfg = {"instances": "64", "rates": "50,100,200,400", "traces": "conversation",
           "routers": "ours:kv_aware,ours*2:kv_aware,vllm-router:cache_aware", "churn": "no"}
    row = _rows([_entry(runs, cfg)], tmp_path / "a")[SUSTAINS]
    # one process of ours: 200/s against vllm-router's 400/s (replicas do not count)
    assert row.met is False and row.measured.value == 0.5 and row.measured.rounds == 9
    assert row.measured.where == "200/s against 400/s, N=64, conversation"
    # a p99 that doubled at a rate ends what a router sustains, whatever comes after
    later = _sweep({"ours:kv_aware": [1.0, 1.0, 1.1, 1.2],
                    "vllm-router:cache_aware": [1.0, 2.5, 1.1, 1.2]}, rates)
    by = {g[2]: rs for g, rs in fleet.sweeps(fleet.by_point({"runs": later})).items()}
    assert fleet.sustained(by["vllm-router"]) == 50.0
    row = _rows([_entry(later, {**cfg, "routers": "ours:kv_aware,vllm-router:cache_aware"})],
                tmp_path / "b")[SUSTAINS]
    assert row.met is True and row.measured.value == 8.0
    # a run of two rates is no sweep: the row reads no such run
    two = _rows([_entry(runs, {**cfg, "rates": "50,100"})], tmp_path / "c")[SUSTAINS]
    assert two.entry is None and two.met is False
    body = fleet.section_fleet({"config": {}, "runs": runs}, {})
    assert "The rate one router process sustains" in body
    assert "- `ours:kv_aware` (N=64, conversation): up to 200/s of the rates run" in body
    assert "| 64 | conversation | ours*2:kv_aware | 400 | 9 |" in body

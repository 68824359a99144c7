# SPDX-License-Identifier: Apache-2.0
"""``bench serve`` rounds: aggregation, round series, overheads over the floor, comparisons
against the peer's best binding, and peers that fell back to recompute."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.bench.serve.compare import (
    PD_REQUEST,
    computed_by_p,
    interval_comparisons,
    ledger_series,
    load_check,
    round_series,
)
from vllm_ascend.distributed.kv_transfer.bench.serve.rounds import (
    aggregate,
    base_name,
    families,
    variant_name,
)
from vllm_ascend.distributed.kv_transfer.bench.serve.scenarios import binding_env
from vllm_ascend.distributed.kv_transfer.bench.serve.spec import Comparison, Goal, Scenario

TTFT = "d_ttft_over_recompute"


def _pd_round(r: int, ttft: float, floor: float, external: int | None,
              recompute: float = 1.0, token: int = 7) -> dict[str, Any]:
    return {"round": r, "prompts": [
        {"tokens": n, "prefill_s": 1.0, "d_ttft_s": ttft * k, "d_samples": [ttft * k],
         "d_floor_s": floor * k, "d_floor_samples": [floor * k], "d_external": external,
         "d_cached": 0, "d_token": token, "d_tokens_all": [token], "finish": "length"}
        for n, k in ((2048, 1.0), (8192, 4.0))],
        "reference": {"recompute_s": {2048: recompute, 8192: 4 * recompute},
                      "device_hit_s": {2048: 0.05, 8192: 0.2},
                      "tokens": {2048: 7, 8192: 7}}}


def _cache_round(r: int, hit: float, floor: float, cold: float, thr: float) -> dict[str, Any]:
    return {"round": r, "prompts": [
        {"tokens": 64, "cold_s": cold, "device_hit_s": floor, "again_s": hit,
         "again_samples": [hit], "again_cached": 63, "again_external": 63, "cold_token": 5,
         "again_token": 5, "again_tokens_all": [5], "finish": "length"}],
        "throughput": {"output_tok_per_s": thr},
        "reference": {"recompute_s": {64: 1.0}, "device_hit_s": {64: 0.05},
                      "tokens": {64: 5}, "output_tok_per_s": 100.0}}


def _ok(rounds: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"status": "ok", **extra, **aggregate(rounds)}


def test_names_of_variants() -> None:
    assert variant_name("pd/ours", "pinned") == "pd/ours[pinned]"
    assert variant_name("pool/ours-local", None) == "pool/ours-local"
    assert base_name("pd/ours[nobind]") == "pd/ours"


def test_bindings_pin_each_engine_to_its_own_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert binding_env("pinned") == ({"VLLM_CPU_OMP_THREADS_BIND": "0"},
                                     {"VLLM_CPU_OMP_THREADS_BIND": "1"})
    assert binding_env("nobind")[1] == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert binding_env("bind=1") == ({"VLLM_CPU_OMP_THREADS_BIND": "1"},) * 2
    assert binding_env(None) == ({}, {})
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert binding_env("pinned")[1] == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    with pytest.raises(ValueError, match="unknown P/D binding"):
        binding_env("tight")


def test_families_keep_run_order_and_leave_the_baseline_out() -> None:
    sc = [Scenario("baseline", "baseline", "-", "-", ""),
          Scenario("offload/d", "offload", "ours", "D", ""),
          Scenario("pool/a", "pool", "ours", "A", ""), Scenario("pd/b", "pd", "ours", "B", ""),
          Scenario("x/c", "x", "ours", "C", "")]
    # P/D alone; every family measured against the same baseline flow in one set of rounds
    assert [(f, [s.name for s in m]) for f, m in families(sc)] == [
        ("pd", ["pd/b"]), ("pool + offload + x", ["pool/a", "offload/d", "x/c"])]
    assert [f for f, _ in families(sc[:2])] == ["offload"]
    assert [f for f, _ in families(sc[3:4])] == ["pd"]


def test_aggregate_takes_medians_over_rounds_and_checks_tokens_per_round() -> None:
    agg = aggregate([_pd_round(0, 0.1, 0.05, 2048), _pd_round(1, 0.3, 0.05, 2048),
                     _pd_round(2, 0.2, 0.05, 0)])
    rows = {r["tokens"]: r for r in agg["prompts"]}
    assert rows[2048]["d_ttft_s"] == pytest.approx(0.2)
    assert rows[2048]["d_samples"] == pytest.approx([0.1, 0.3, 0.2])
    assert rows[2048]["d_external"] == 0  # the fewest of any round
    assert agg["tokens_equal"] is True and len(agg["rounds"]) == 3
    assert agg["reference"]["recompute_s"][8192] == pytest.approx(4.0)
    wrong = aggregate([_pd_round(0, 0.1, 0.05, 2048), _pd_round(1, 0.1, 0.05, 2048, token=9)])
    assert wrong["tokens_equal"] is False
    cache = aggregate([_cache_round(0, 0.1, 0.05, 1.2, 90.0),
                       _cache_round(1, 0.3, 0.05, 1.4, 110.0)])
    assert cache["prompts"][0]["again_s"] == pytest.approx(0.2)
    assert cache["throughput"]["output_tok_per_s"] == pytest.approx(100.0)


def test_round_series_hold_the_overheads_over_the_floor() -> None:
    r = round_series(_ok([_pd_round(0, 0.10, 0.06, 2048), _pd_round(1, 0.12, 0.06, 2048)]))
    assert r is not None and r["rounds"] == 2
    s = r["by_tokens"][2048]
    assert s["overhead"]["values"] == pytest.approx([0.04, 0.06])
    assert r["by_tokens"][8192]["overhead"]["values"] == pytest.approx([0.16, 0.24])
    assert r["loaded"] is True and r["load_check"] == "num_external_computed_tokens"
    c = round_series(_ok([_cache_round(0, 0.1, 0.05, 1.2, 90.0)]))
    assert c is not None
    s = c["by_tokens"][64]
    assert s["hit_overhead"]["values"] == pytest.approx([0.05])
    assert s["save_overhead"]["values"] == pytest.approx([0.2])  # cold 1.2 - recompute 1.0
    assert c["series"]["thr_norm"] == pytest.approx([0.9])
    assert round_series({"status": "skipped"}) is None


def test_load_check_falls_back_to_ttft_against_recompute() -> None:
    assert load_check({1: {"external": [0.0, 10.0]}})["loaded"] is False
    slow = load_check({1: {"external": [None], "norm": [0.95, 0.9]}})
    assert slow["loaded"] is False and "recompute" in slow["load_check"]
    assert load_check({1: {"norm": [0.2]}})["loaded"] is True
    assert load_check({})["loaded"] is None


DECLARED = [Scenario("pd/ours", "pd", "ours", "P", "", comparisons=(
    Comparison("P/D decode TTFT: ours / NixlConnector", TTFT, "pd/vllm-nixl",
               Goal("<= 0.8", at_most=0.8)),
    Comparison("P/D KV throughput: ours / NixlConnector", TTFT, "pd/vllm-nixl",
               Goal(">= 1.2", at_least=1.2), inverse=True),
    Comparison("P/D decode TTFT: ours / vLLM MooncakeConnector", TTFT, "pd/vllm-mooncake",
               Goal("")))),
    Scenario("pool/ours", "pool", "ours", "S", "", hit_goal=Goal("<= 0.5", at_most=0.5),
             comparisons=(Comparison("pool hit TTFT: ours / Store", "hit_over_recompute",
                                     "pool/store", Goal("<= 0.8", at_most=0.8)),
                          Comparison("pool cold TTFT (miss + save): ours / Store",
                                     "cold_over_baseline", "pool/store"))),
]


def _pd_results() -> dict[str, dict[str, Any]]:
    fast = [_pd_round(r, 0.10 + 0.001 * r, 0.06, 2048) for r in range(5)]
    slow = [_pd_round(r, 0.16 + 0.001 * r, 0.06, 2048) for r in range(5)]
    nixl_best = [_pd_round(r, 0.13 + 0.001 * r, 0.06, 2048) for r in range(5)]
    fell_back = [_pd_round(r, 0.95, 0.06, 0) for r in range(5)]
    return {"pd/ours[pinned]": _ok(fast, binding="pinned"),
            "pd/ours[nobind]": _ok(slow, binding="nobind"),
            "pd/vllm-nixl[pinned]": _ok(nixl_best, binding="pinned"),
            "pd/vllm-nixl[nobind]": _ok(slow, binding="nobind"),
            "pd/vllm-mooncake[pinned]": _ok(fell_back, binding="pinned"),
            "pd/vllm-mooncake[nobind]": _ok(fell_back, binding="nobind")}


def _comps(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rounds = {n: r for n, e in results.items() if (r := round_series(e)) is not None}
    return {c["what"]: c for c in interval_comparisons(results, rounds, DECLARED)}


def test_ours_under_each_binding_against_the_peers_best() -> None:
    comps = _comps(_pd_results())
    # ours pinned: overhead 0.04 against nixl's best (pinned) 0.07: well inside <= 0.8
    c = comps["D-side overhead over the floor at 2048 tokens (pinned): ours / NixlConnector"]
    assert c["peer"] == "pd/vllm-nixl[pinned]" and c["rounds"] == 5
    assert c["ratio"] == pytest.approx(0.042 / 0.072, rel=1e-6)
    assert c["high"] < 0.8 and c["met"] is True and c["kind"] == "overhead"
    assert "peer at its best: pd/vllm-nixl[pinned]" in c["note"]
    # ours unbound (0.1 over the floor) is behind the peer's best: not met
    c = comps["D-side overhead over the floor at 8192 tokens (nobind): ours / NixlConnector"]
    assert c["low"] > 1.0 and c["met"] is False
    # the declared TTFT ratio, over the rounds, with its interval and the inverse throughput
    c = comps["P/D decode TTFT: ours / NixlConnector (pinned)"]
    assert c["min"] <= c["ratio"] <= c["max"] and c["low"] <= c["ratio"] <= c["high"]
    t = comps["P/D KV throughput: ours / NixlConnector (pinned)"]
    assert t["ratio"] == pytest.approx(1 / c["ratio"])


def test_a_peer_that_fell_back_to_recompute_gives_no_ratio() -> None:
    comps = _comps(_pd_results())
    c = comps["P/D decode TTFT: ours / vLLM MooncakeConnector (pinned)"]
    assert c["ratio"] is None and c["met"] is None and c["peer_fell_back"] is True
    assert "fell back to recompute" in c["note"]
    c = comps["D-side overhead over the floor at 2048 tokens (pinned): ours / vLLM "
              "MooncakeConnector"]
    assert c["ratio"] is None and c["met"] is None


def test_pool_rows_overheads_and_goals_against_recompute() -> None:
    results = {
        "pool/ours": _ok([_cache_round(r, 0.10, 0.06, 1.02, 101.0) for r in range(5)]),
        "pool/store": _ok([_cache_round(r, 0.20, 0.06, 1.30, 80.0) for r in range(5)]),
    }
    comps = _comps(results)
    c = comps["hit overhead over the floor: ours / Store"]
    assert c["ratio"] == pytest.approx(0.04 / 0.14) and c["met"] is True
    assert comps["save overhead (cold - recompute): ours / Store"]["ratio"] == pytest.approx(
        0.02 / 0.30)
    assert comps["pool/ours hit TTFT / recompute"]["met"] is True
    assert comps["pool/ours save overhead / recompute"]["ratio"] == pytest.approx(0.02)
    assert comps["pool/ours save overhead / recompute"]["met"] is True
    assert comps["pool/ours serving throughput / no connector"]["met"] is True


def _with_wait(entry: dict[str, Any], wait: float) -> dict[str, Any]:
    for rd in entry["rounds"]:
        for row in rd["prompts"]:
            row["d_kv_wait_s"] = wait * (1 + row["tokens"] // 4096)
    return entry


def test_d_side_kv_wait_is_compared_beside_the_overhead_without_a_goal() -> None:
    results = _pd_results()
    comps = _comps(results)
    assert not any(c["kind"] == "kv_wait" for c in comps.values())  # not measured: no row
    _with_wait(results["pd/ours[pinned]"], 0.01)
    _with_wait(results["pd/ours[nobind]"], 0.03)
    _with_wait(results["pd/vllm-nixl[pinned]"], 0.04)
    _with_wait(results["pd/vllm-nixl[nobind]"], 0.05)
    comps = _comps(results)
    c = comps["D-side wait for the KV at 8192 tokens (pinned): ours / NixlConnector"]
    assert c["kind"] == "kv_wait" and c["peer"] == "pd/vllm-nixl[pinned]"
    assert c["ratio"] == pytest.approx(0.25) and c["rounds"] == 5
    assert c["goal"] == "" and c["met"] is None
    r = round_series(results["pd/ours[pinned]"])
    assert r is not None and r["by_tokens"][2048]["kv_wait"]["median"] == pytest.approx(0.01)


def test_d_floor_computes_only_the_last_token_at_every_prompt_length() -> None:
    """vLLM's prefix cache hits whole blocks and at most all tokens but one: a device hit of
    a prompt filling whole blocks would recompute its last block, so D's floor is measured
    with one more token there (its blocks hit, one token computed)."""
    from vllm_ascend.distributed.kv_transfer.bench.serve.scenarios import (
        FLOOR_SAMPLES,
        last_token_floor,
    )

    class Engine:
        def __init__(self) -> None:
            self.prompts: list[list[int]] = []

        def generate(self, prompts: list[list[int]]) -> dict[str, Any]:
            self.prompts.extend(prompts)
            return {"seconds": 0.01 * len(prompts[0])}

    eng = Engine()
    aligned = list(range(256))
    assert last_token_floor(eng, aligned, 128) == pytest.approx(2.57)  # type: ignore[arg-type]
    assert len(eng.prompts) == FLOOR_SAMPLES
    assert all(p[:256] == aligned and len(p) == 257 for p in eng.prompts)
    eng.prompts.clear()
    odd = list(range(200))
    last_token_floor(eng, odd, 128)  # type: ignore[arg-type]
    assert eng.prompts == [odd] * FLOOR_SAMPLES


def _with_request(entry: dict[str, Any], prefill: float, total: float) -> dict[str, Any]:
    for rd in entry["rounds"]:
        for row in rd["prompts"]:
            k = row["tokens"] // 2048
            row["prefill_samples"] = [prefill * k, prefill * k * 3]  # the median: 2x
            row["pd_total_s"] = total * k
    return entry


def test_p_prefill_and_whole_request_compared_per_length_under_the_same_binding() -> None:
    """A connector that moves work into P's prefill (the layerwise push) is compared on P's
    prefill and the whole request too, against the peer under the same binding (not its
    best: a pinned P computes on one core), per prompt length and without a goal."""
    declared = [Scenario("pd/lw", "pd", "ours", "L", "", comparisons=(
        Comparison("P/D request: lw / ours (pull)", PD_REQUEST, "pd/ours"),))]
    # (scenario, binding): D's TTFT, P's prefill, the whole request
    made = {("pd/lw", "pinned"): (0.05, 0.5, 1.1), ("pd/lw", "nobind"): (0.05, 0.3, 0.7),
            ("pd/ours", "pinned"): (0.10, 0.4, 1.0), ("pd/ours", "nobind"): (0.10, 0.2, 0.5)}
    results = {
        f"{name}[{binding}]": _with_request(
            _ok([_pd_round(r, ttft, 0.05, 2048) for r in range(5)], binding=binding),
            prefill, total)
        for (name, binding), (ttft, prefill, total) in made.items()}
    rounds = {n: r for n, e in results.items() if (r := round_series(e)) is not None}
    comps = {c["what"]: c for c in interval_comparisons(results, rounds, declared)}
    c = comps["P's prefill at 8192 tokens (pinned): lw / ours (pull)"]
    assert c["kind"] == "prefill" and c["peer"] == "pd/ours[pinned]"
    assert c["ratio"] == pytest.approx(0.5 / 0.4) and c["goal"] == "" and c["met"] is None
    assert rounds["pd/lw[pinned]"]["by_tokens"][8192]["prefill"]["median"] == pytest.approx(
        8 * 0.5)
    # unbound against the pull unbound, although the pull's best whole request is unbound
    c = comps["whole P/D request at 2048 tokens (nobind): lw / ours (pull)"]
    assert c["kind"] == "request" and c["peer"] == "pd/ours[nobind]"
    assert c["ratio"] == pytest.approx(0.7 / 0.5) and c["rounds"] == 5
    c = comps["whole P/D request at 2048 tokens (pinned): lw / ours (pull)"]
    assert c["peer"] == "pd/ours[pinned]" and c["ratio"] == pytest.approx(1.1)
    # 2 bindings x 2 lengths x (prefill, request), beside each variant's D TTFT / recompute
    assert sorted(c["kind"] for c in comps.values()) == [
        *["prefill"] * 4, *["recompute"] * 2, *["request"] * 4]


def test_a_p_request_that_hit_ps_own_cache_is_no_prefill_to_compare() -> None:
    """A repeat whose P request hit P's prefix cache costs P nothing: only the samples where
    P computed the prompt give its prefill and the whole request."""
    row = {"prefill_s": 1.0, "prefill_samples": [1.0, 0.05, 1.2],
           "pd_total_s": 0.5, "pd_total_samples": [1.1, 0.1, 1.3],
           "p_cached_samples": [0, 2048, 0]}
    assert computed_by_p(row) == (pytest.approx(1.1), pytest.approx(1.2))
    row["p_cached_samples"] = [2048, 2048, 2048]
    assert computed_by_p(row) == (None, None)
    # rows of runs before the count: every sample counts
    assert computed_by_p({"prefill_s": 0.7, "pd_total_s": 0.9}) == (0.7, 0.9)


def test_every_rounds_times_go_to_the_ledger_paired_by_round() -> None:
    results = {
        "baseline": {"status": "ok", "rounds": [{"prompts": []}]},
        "pd/ours[pinned]": {**_ok([_pd_round(r, 0.1 + r / 100, 0.06, 2048) for r in range(3)]),
                            "binding": "pinned"},
        # failed after two rounds: its rounds are the first two
        "pool/ours": _ok([_cache_round(r, 0.1, 0.05, 1.2, 90.0 + r) for r in range(2)]),
        "pd/vllm-nixl[pinned]": {"status": "failed", "reason": "no nixl"},
    }
    series = {(s["tags"]["scenario"], s["tags"]["tokens"], s["tags"]["what"]): s
              for s in ledger_series(results)}
    assert {k[0] for k in series} == {"pd/ours[pinned]", "pool/ours"}
    d = series["pd/ours[pinned]", 2048, "d_ttft_s"]
    assert d["tags"]["binding"] == "pinned"
    assert d["rounds"] == [[pytest.approx(0.1 + r / 100)] for r in range(3)]
    assert series["pd/ours[pinned]", 8192, "recompute_s"]["rounds"] == [[4.0]] * 3
    assert series["pd/ours[pinned]", 2048, "d_external"]["rounds"] == [[2048.0]] * 3
    assert series["pool/ours", 64, "again_s"]["rounds"] == [[0.1], [0.1]]
    assert series["pool/ours", None, "output_tok_per_s"]["rounds"] == [[90.0], [91.0]]
    assert series["pool/ours", None, "reference_output_tok_per_s"]["rounds"] == [[100.0]] * 2
    # a time only some rounds have: the others are empty rounds, the pairing stays
    results["pool/ours"]["rounds"][0]["prompts"][0].pop("device_hit_s")
    again = {(s["tags"]["scenario"], s["tags"]["what"]): s for s in ledger_series(results)}
    assert again["pool/ours", "device_hit_s"]["rounds"] == [[], [0.05]]

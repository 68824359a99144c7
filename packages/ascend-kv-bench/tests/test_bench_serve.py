# SPDX-License-Identifier: Apache-2.0
"""``bench serve``: prompts, scenario selection and skips, summaries (its engine processes:
``test_bench_serve_engines.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.bench.client.deploy import PEER_PROXY
from vllm_ascend.distributed.kv_transfer.bench.serve import builtin
from vllm_ascend.distributed.kv_transfer.bench.serve import child as serve_child
from vllm_ascend.distributed.kv_transfer.bench.serve import command as bs
from vllm_ascend.distributed.kv_transfer.bench.serve import needs as serve_needs
from vllm_ascend.distributed.kv_transfer.bench.serve import scenarios as serve_scenarios
from vllm_ascend.distributed.kv_transfer.bench.serve.report import comparisons
from vllm_ascend.distributed.kv_transfer.bench.serve.spec import (
    BENCH_MODEL,
    QUICK_MODEL,
    Comparison,
    Goal,
    Scenario,
    ServeConfig,
)
from vllm_ascend.distributed.kv_transfer.core.tooling.cli import main


# ---------------------------------------------------------------------- prompts
@given(block=st.sampled_from([32, 64, 128, 256]), target=st.integers(1, 8192))
def test_prompt_lengths_cover_the_block_boundaries(block: int, target: int) -> None:
    if target < block:
        with pytest.raises(ValueError, match="at least one block"):
            serve_scenarios.prompt_lengths(target, block)
        return
    full, plus_one, half = serve_scenarios.prompt_lengths(target, block)
    assert full % block == 0 and full >= block
    assert plus_one == full + 1 and plus_one % block == 1  # the length ExampleConnector misses
    assert half % block == block // 2
    assert abs(full - target) <= block / 2


def test_prompts_are_reproducible_and_in_range() -> None:
    a = serve_scenarios.make_prompts([5, 40], seed=3, vocab=100)
    assert a == serve_scenarios.make_prompts([5, 40], seed=3, vocab=100)
    assert [len(p) for p in a] == [5, 40]
    assert all(3 <= t < 100 for p in a for t in p)
    assert a != serve_scenarios.make_prompts([5, 40], seed=4, vocab=100)


def test_kv_bytes_per_token() -> None:
    cfg = ServeConfig(model="m", model_spec=dict(BENCH_MODEL), dtype="float32",
                         block_size=128, lengths=[128], throughput_batch=1, throughput_prompt=8,
                         throughput_tokens=1, max_model_len=512, out=Path("."))
    assert cfg.kv_bytes_per_token == 2 * 8 * 4 * 64 * 4
    cfg.dtype = "bfloat16"
    assert cfg.kv_bytes_per_token == 2 * 8 * 4 * 64 * 2


# ---------------------------------------------------------------------- selection and skips
def _args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"only": "", "quick": False, **kw})


def test_selection_always_starts_with_the_baseline() -> None:
    names = [s.name for s in bs.select(_args(only="pool/vllm-example"))]
    assert names == ["baseline", "pool/vllm-example"]
    assert [s.name for s in bs.select(_args(quick=True))] == list(bs.quick_scenarios())
    assert bs.quick_scenarios()[0] == "baseline"
    assert len(bs.select(_args())) == len(bs.scenarios())
    with pytest.raises(SystemExit, match="unknown scenario"):
        bs.select(_args(only="pd/nosuch"))


def _cfg(tmp_path: Path, **kw: Any) -> ServeConfig:
    return ServeConfig(model="m", model_spec=dict(QUICK_MODEL), dtype="float32",
                          block_size=32, lengths=[64, 65, 80], throughput_batch=1,
                          throughput_prompt=32, throughput_tokens=2, max_model_len=512,
                          out=tmp_path, **kw)


def test_skip_reasons_name_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    by_name = {s.name: s for s in bs.scenarios()}
    probe = Scenario("pool/probe", "pool", "ours", "ProbeConnector", "", ["dist:no-such-dist"])
    assert serve_needs.skip_reason(probe, _cfg(tmp_path)) == "no-such-dist is not installed"
    assert serve_needs.skip_reason(by_name["pool/vllm-example"], _cfg(tmp_path)) is None
    reason = serve_needs.skip_reason(by_name["pd/vllm-mooncake"], _cfg(tmp_path, peers_path=None))
    if reason is not None and "mooncake-transfer-engine" not in reason:
        assert str(serve_needs.PEERS_DIR) in reason and serve_needs.PEERS_ENV in reason
    # an interpreter without nixl: NixlConnector is skipped, naming that interpreter
    monkeypatch.setattr(serve_needs, "python_has", lambda python, module: False)
    reason = serve_needs.skip_reason(by_name["pd/vllm-nixl"], _cfg(tmp_path, nixl_python="/x/python"))
    assert reason is not None and "nixl" in reason and "/x/python" in reason


def test_peers_path_needs_the_patch_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    monkeypatch.delenv(serve_needs.PEERS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    # by default the harness modules shipped with the package, wherever it runs from
    shipped = serve_needs.PEERS_DIR
    assert serve_needs.peers_path(None) == str(shipped.resolve())
    for module in (serve_needs.PATCH_MODULE, builtin.NIXL_AFFINITY_MODULE,
                   Path(PEER_PROXY).stem):
        assert (shipped / f"{module}.py").is_file(), module
    # a directory named explicitly must hold the patch
    assert serve_needs.peers_path(str(tmp_path)) is None
    (tmp_path / f"{serve_needs.PATCH_MODULE}.py").write_text("")
    assert serve_needs.peers_path(str(tmp_path)) == str(tmp_path.resolve())
    monkeypatch.setenv(serve_needs.PEERS_ENV, str(tmp_path))
    assert serve_needs.peers_path(None) == str(tmp_path.resolve())
    assert serve_needs.peers_path(str(shipped)) == str(shipped.resolve())  # the option wins


def test_python_has() -> None:
    assert serve_needs.python_has(sys.executable, "json")
    assert not serve_needs.python_has(sys.executable, "no_such_module_here")
    assert not serve_needs.python_has("/no/such/python", "json")


def test_short_error_picks_the_error_line() -> None:
    text = "Traceback (most recent call last):\n  File x\nRuntimeError: boom\n"
    assert serve_child.short_error(text) == "RuntimeError: boom"
    assert serve_child.short_error("just words\n\n") == "just words"
    assert serve_child.short_error("") == ""


def test_bad_block_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="multiple of 32"):
        main(["bench", "serve", "--block-size", "48", "--out", str(tmp_path)])


# ---------------------------------------------------------------------- summaries
#: Scenarios as connector packages declare them (their own tests check their declarations).
_TTFT = "d_ttft_over_recompute"
DECLARED = [
    Scenario("pd/ours", "pd", "ours", "P", "", comparisons=(
        Comparison("P/D decode TTFT: ours / NixlConnector", _TTFT, "pd/vllm-nixl",
                   Goal("<= 0.8", at_most=0.8)),
        Comparison("P/D KV throughput: ours / NixlConnector", _TTFT, "pd/vllm-nixl",
                   Goal(">= 1.2", at_least=1.2), inverse=True),
        Comparison("P/D decode TTFT: ours / vLLM MooncakeConnector", _TTFT, "pd/vllm-mooncake",
                   Goal("")))),
    Scenario("pool/ours-mooncake", "pool", "ours", "S", "", hit_goal=Goal("well below 1", 0.5),
             comparisons=(
        Comparison("pool hit TTFT: ours-mooncake / MooncakeStoreConnector",
                   "hit_over_recompute", "pool/vllm-mooncake-store", Goal("<= 0.8", at_most=0.8)),
        Comparison("pool cold TTFT (miss + save): ours-mooncake / MooncakeStoreConnector",
                   "cold_over_baseline", "pool/vllm-mooncake-store"))),
    Scenario("pool/ours-local", "pool", "ours", "S", "", comparisons=(
        Comparison("pool serving throughput (new prompts, saved): ours-local / ExampleConnector",
                   "throughput_over_baseline", "pool/vllm-example"),)),
]


def _cache(tokens: list[int], cold: float, again: float, cached: list[int],
           tok: list[int | None], device: float = 0.01) -> dict[str, Any]:
    return {"status": "ok", "prompts": [
        {"tokens": n, "cold_s": cold, "device_hit_s": device, "again_s": again,
         "again_cached": c, "cold_token": t, "again_token": t, "again_tokens_all": [t, t],
         "finish": "length"} for n, c, t in zip(tokens, cached, tok, strict=True)],
        "throughput": {"output_tok_per_s": 100.0}}


def _pd(tokens: list[int], ttft: float, tok: list[int | None]) -> dict[str, Any]:
    return {"status": "ok", "prompts": [
        {"tokens": n, "prefill_s": 1.0, "d_ttft_s": ttft, "d_cached": 0, "d_token": t,
         "finish": "length" if t is not None else "error"}
        for n, t in zip(tokens, tok, strict=True)]}


def test_summary_and_comparisons(tmp_path: Path) -> None:
    lengths = [64, 65, 80]
    base_tok = [7, 8, 9]
    results = {
        "baseline": _cache(lengths, 1.0, 1.0, [0, 0, 0], base_tok),
        "pool/ours-mooncake": _cache(lengths, 1.1, 0.05, [63, 64, 64], base_tok),
        "pool/vllm-mooncake-store": _cache(lengths, 1.2, 0.1, [32, 64, 64], base_tok),
        # ExampleConnector misses k*block+1, and a wrong token shows
        "pool/vllm-example": _cache(lengths, 1.0, 0.2, [63, 0, 64], [7, 8, 99]),
        "pd/ours": _pd(lengths, 0.06, base_tok),
        "pd/vllm-nixl": _pd(lengths, 0.11, base_tok),
        "pd/vllm-mooncake": {"status": "skipped", "reason": "no patch"},
    }
    cfg = _cfg(tmp_path)
    summary = bs.summarize(results, cfg)
    assert "pd/vllm-mooncake" not in summary
    ours = summary["pool/ours-mooncake"]
    assert ours["hit_over_recompute"] == pytest.approx(0.05)
    assert ours["hit_over_device_hit"] == pytest.approx(5.0)
    assert ours["missed"] == [] and ours["tokens_equal"]
    assert ours["throughput_over_baseline"] == pytest.approx(1.0)
    ex = summary["pool/vllm-example"]
    assert ex["missed"] == [65] and not ex["tokens_equal"]
    pd = summary["pd/ours"]
    assert pd["d_ttft_s"] == pytest.approx(0.06) and pd["tokens_equal"] and pd["failed"] == []
    # KV bytes over D's TTFT (median over the prompts)
    assert pd["kv_GBps"] == pytest.approx(65 * cfg.kv_bytes_per_token / 0.06 / 1e9)
    assert pd["d_ttft_over_device_hit"] == pytest.approx(6.0)
    comps = {c["what"]: c for c in comparisons(summary, DECLARED)}
    c = comps["P/D decode TTFT: ours / NixlConnector"]
    assert c["ratio"] == pytest.approx(0.06 / 0.11) and c["met"] is True and c["kind"] == "peer"
    c = comps["P/D KV throughput: ours / NixlConnector"]
    assert c["ratio"] == pytest.approx(0.11 / 0.06) and c["met"] is True
    assert comps["P/D decode TTFT: ours / vLLM MooncakeConnector"]["ratio"] is None
    c = comps["pool hit TTFT: ours-mooncake / MooncakeStoreConnector"]
    assert c["ratio"] == pytest.approx(0.5) and c["met"] is True
    assert comps["pool/ours-mooncake hit TTFT / recompute"]["kind"] == "recompute"
    # the miss path is compared too: prefill + save, and a batch of new prompts
    assert comps["pool cold TTFT (miss + save): ours-mooncake / MooncakeStoreConnector"][
        "ratio"] == pytest.approx(1.1 / 1.2)
    assert comps["pool serving throughput (new prompts, saved): ours-local / "
                 "ExampleConnector"]["ratio"] is None  # ours-local was not run
    rows = {r["scenario"]: r for r in bs.table_rows(results, summary)}
    assert rows["pool/vllm-example"]["note"] == "missed lengths [65]"
    assert rows["pd/vllm-mooncake"]["status"] == "skipped"


def test_failed_d_requests_are_reported(tmp_path: Path) -> None:
    results = {"baseline": _cache([64], 1.0, 1.0, [0], [5]),
               "pd/ours": _pd([64], 0.2, [None])}
    s = bs.summarize(results, _cfg(tmp_path))["pd/ours"]
    assert s["failed"] == [64] and not s["tokens_equal"]


def test_ratios_use_the_reference_measured_next_to_the_scenario(tmp_path: Path) -> None:
    lengths = [64, 65]
    results = {
        "baseline": _cache(lengths, 1.0, 1.0, [0, 0], [7, 8]),
        # the machine got twice as slow later: the reference measured next to it says so
        "offload/ours": {**_cache(lengths, 2.2, 0.1, [63, 64], [7, 8]),
                         "reference": {"recompute_s": {"64": 2.0, "65": 2.0},
                                       "device_hit_s": {"64": 0.05, "65": 0.05},
                                       "output_tok_per_s": 50.0}},
        "pd/ours": {**_pd(lengths, 0.3, [7, 8]),
                    "reference": {"recompute_s": {"64": 3.0, "65": 3.0},
                                  "device_hit_s": {"64": 0.1, "65": 0.1},
                                  "output_tok_per_s": 10.0}},
    }
    s = bs.summarize(results, _cfg(tmp_path))
    assert s["offload/ours"]["hit_over_recompute"] == pytest.approx(0.05)
    assert s["offload/ours"]["cold_over_baseline"] == pytest.approx(1.1)
    assert s["offload/ours"]["throughput_over_baseline"] == pytest.approx(2.0)
    assert s["offload/ours"]["reference_recompute_s"] == pytest.approx(2.0)
    assert s["pd/ours"]["d_ttft_over_recompute"] == pytest.approx(0.1)
    assert s["pd/ours"]["kv_GBps"] == pytest.approx(
        64.5 * _cfg(tmp_path).kv_bytes_per_token / 0.3 / 1e9)
    # ours / peer divides the normalized figures: drift between scenarios cancels
    results["pd/vllm-nixl"] = {**_pd(lengths, 0.3, [7, 8]),
                               "reference": {"recompute_s": {"64": 1.0, "65": 1.0},
                                             "device_hit_s": {"64": 0.1, "65": 0.1},
                                             "output_tok_per_s": 10.0}}
    comps = {c["what"]: c for c in comparisons(bs.summarize(results, _cfg(tmp_path)), DECLARED)}
    assert comps["P/D decode TTFT: ours / NixlConnector"]["ratio"] == pytest.approx(1 / 3)


def test_engines_keep_their_freed_memory_unless_the_environment_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.bench.engine_env import STEADY_MALLOC_ENV
    from vllm_ascend.distributed.kv_transfer.bench.serve.scenarios import (
        engine_malloc_env,
    )

    for key in STEADY_MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    assert engine_malloc_env() == STEADY_MALLOC_ENV
    assert STEADY_MALLOC_ENV["MALLOC_MMAP_MAX_"] == "0"
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")  # the user's own choice is kept
    assert engine_malloc_env()["MALLOC_MMAP_MAX_"] == "65536"
    assert engine_malloc_env()["MALLOC_TRIM_THRESHOLD_"] == STEADY_MALLOC_ENV[
        "MALLOC_TRIM_THRESHOLD_"]

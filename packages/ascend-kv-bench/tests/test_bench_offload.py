# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench offload --quick`` runs and writes its results (no timing is asserted)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.core.tooling.cli import main
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.host_pool import (
    SHM_DIR_ENV,
)


@pytest.fixture(autouse=True)
def _segments_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Host segments go to the test's temp dir; the test fails if one is left behind."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv(SHM_DIR_ENV, str(d))
    yield d
    leftovers = list(d.iterdir())
    assert not leftovers, f"host segments left behind: {leftovers}"


def test_quick_bench_writes_ratios(tmp_path: Path) -> None:
    assert main(["bench", "offload", "--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "offload.json").read_text())
    assert doc["benchmark"] == "offload" and "machine" in doc
    rows = doc["bandwidth"]
    assert [r["block_kib"] for r in rows] == [64, 1024]
    for r in rows:
        assert r["save_gbps"] > 0 and r["load_gbps"] > 0 and r["memcpy_gbps"] > 0
        for kind in ("save", "load"):
            # the ratio is the median of the rounds, the spread their min and max
            rounds = r["rounds"][f"{kind}_ratio"]
            assert len(rounds) == 3 and r[f"{kind}_ratio"] == sorted(rounds)[1]
            assert r[f"{kind}_spread"] == [min(rounds), max(rounds)]
    goal = doc["bandwidth_goal"]
    worst = min(r[k] for r in rows for k in ("save_ratio", "load_ratio"))
    assert goal["worst_ratio"] == worst and goal["met"] == (worst >= 0.8)
    assert "skipped" in doc["ttft"]


def test_alternating_rounds_rotate_the_order_and_take_median_call_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.bench import offload as bench

    calls: list[str] = []
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    rounds = bench.alternating_rounds(fns, rounds=2, pairs=3)
    # one warm-up call each, then passes in rotating order: abc, bca, cab, per round
    assert calls[:3] == ["a", "b", "c"]
    assert calls[3:12] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert len(rounds) == 2 and all(set(r) == {"a", "b", "c"} for r in rounds)
    assert all(t == 1.0 for r in rounds for t in r.values())  # every call timed alone


def test_full_bandwidth_runs_take_at_least_five_rounds() -> None:
    from vllm_ascend.distributed.kv_transfer.bench import offload as bench

    assert bench.FULL_ROUNDS >= 5 and bench.FULL_PAIRS >= 3


def test_ttft_uses_bench_serves_model_and_reports_both_ratios(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.bench import offload as bench
    from vllm_ascend.distributed.kv_transfer.bench.serve import command as bench_serve

    assert bench.BENCH_LLAMA == bench_serve.BENCH_MODEL  # 8 layers, hidden 512, 4 KV heads of 64
    assert (bench.TTFT_DTYPE, bench.TTFT_BLOCK_SIZE) == ("float32", 128)
    seen: list[tuple[bool, str, int]] = []

    def fake_engine(model: str, offload: bool, prompts: list[list[int]], timeout: float,
                    dtype: str, block_size: int) -> list[dict[str, object]]:
        seen.append((offload, dtype, block_size))
        third = 0.05 if offload else 1.0
        return [{"first_s": 1.1, "device_hit_s": 0.04, "third_s": third,
                 "third_cached": 1920 if offload else 0, "first_tokens": [p[0] % 7],
                 "third_tokens": [p[0] % 7]} for p in prompts]

    monkeypatch.setattr(bench, "_run_engine", fake_engine)
    r = bench.run_ttft("/m", 2000, 2, 60.0, model_spec=bench.BENCH_LLAMA)
    assert seen == [(False, "float32", 128), (True, "float32", 128)]
    assert r["model"] == {"path": "/m", "spec": bench.BENCH_LLAMA, "dtype": "float32",
                          "block_size": 128}
    assert abs(r["hit_over_recompute"] - 0.05) < 1e-9
    assert abs(r["device_hit_over_recompute"] - 0.04) < 1e-9
    assert r["first_token_equal"] is True and r["hit_cached_tokens"] == [1920, 1920]

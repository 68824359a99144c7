# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench offload --quick`` runs and writes its results (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.core.tooling.cli import main


def test_quick_bench_writes_ratios(tmp_path: Path) -> None:
    assert main(["bench", "offload", "--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "offload.json").read_text())
    assert doc["benchmark"] == "offload" and "machine" in doc
    rows = doc["bandwidth"]
    assert [r["block_kib"] for r in rows] == [64, 1024]
    for r in rows:
        assert r["save_gbps"] > 0 and r["load_gbps"] > 0 and r["memcpy_gbps"] > 0
        assert abs(r["save_ratio"] - r["save_gbps"] / r["memcpy_gbps"]) < 1e-6
    assert "skipped" in doc["ttft"]


def test_ttft_uses_bench_serves_model_and_reports_both_ratios(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.core.tooling import bench_serve
    from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.tooling import bench

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

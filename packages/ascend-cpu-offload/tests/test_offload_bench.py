# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench offload --quick`` runs and writes its results (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_ascend.distributed.kv_transfer.core.cli import main


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

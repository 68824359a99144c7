# SPDX-License-Identifier: Apache-2.0
"""The ``kernels`` benchmark runs, registers itself, and reports ratios (never asserts on them)."""

from __future__ import annotations

import argparse
import json
from importlib import metadata
from pathlib import Path

import pytest

from vllm_ascend.distributed.kernels.tooling import bench


def test_registered_under_the_bench_entry_point_group() -> None:
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="vllm_ascend_kv.bench")}
    assert eps.get("kernels") == "vllm_ascend.distributed.kernels.tooling.bench:add_parser"


def test_add_parser_plugs_into_a_cli() -> None:
    parser = argparse.ArgumentParser(prog="vllm-ascend-kv bench")
    sub = parser.add_subparsers(dest="bench")
    bench.add_parser(sub)
    args = parser.parse_args(["kernels", "--quick", "--out", "somewhere"])
    assert args.func is bench.run and args.quick and args.out == "somewhere"


@pytest.mark.timeout(300)
def test_quick_run_writes_json_and_prints_a_table(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick", "--out", str(tmp_path), "--total-mib", "2", "--layers", "2"]) == 0
    doc = json.loads((tmp_path / "kernels.json").read_text())
    assert doc["benchmark"] == "kernels" and doc["config"]["quick"] is True
    assert [r["block_kib"] for r in doc["results"]] == [16, 64, 2048]
    for row in doc["results"]:
        assert row["memcpy_gbps"] > 0
        for key in ("gather", "scatter", "gather_layers", "scatter_layers"):
            assert row[key] > 0 and len(row["ratios"][key]) == 3
    assert doc["goal"]["min_ratio"] == 0.8 and isinstance(doc["goal"]["met"], bool)
    out = capsys.readouterr().out
    assert "block_kib" in out and "scatter_layers" in out and "kernels.json" in out

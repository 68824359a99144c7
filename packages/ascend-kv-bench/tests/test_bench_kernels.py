# SPDX-License-Identifier: Apache-2.0
"""The ``kernels`` benchmark runs, registers itself, and reports ratios (never asserts on them)."""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.bench import kernels as bench


@pytest.fixture(autouse=True)
def _no_impl_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark chooses its implementations; an exported override must not leak in."""
    monkeypatch.delenv("VLLM_ASCEND_KERNELS_IMPL", raising=False)


def test_registered_under_the_bench_entry_point_group() -> None:
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    eps = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
    assert eps["vllm_ascend_kv.bench"]["kernels"] == (
        "vllm_ascend.distributed.kv_transfer.bench.kernels:add_parser")


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
            rounds = row["ratios"][key]
            assert row[key] > 0 and len(rounds) == 3
            # the reported figure is the median of the rounds, the spread their min and max
            assert row[key] == sorted(rounds)[1]
            assert row["spread"][key] == [min(rounds), max(rounds)]
    goal = doc["goal"]
    assert goal["min_ratio"] == 0.8 and isinstance(goal["met"], bool)
    assert set(goal["kernels"]) == {"gather", "scatter", "gather_layers", "scatter_layers"}
    judged = [row[k] for row in doc["results"] if row["block_kib"] >= 64 for k in goal["kernels"]]
    assert goal["worst_ratio"] == min(judged) == goal["worst_point"]["median"]
    assert goal["met"] == (goal["worst_ratio"] >= 0.8)
    assert doc["config"]["rounds"] == 3 and doc["config"]["pairs_per_round"] >= 1
    out = capsys.readouterr().out
    assert "block_kib" in out and "scatter_layers" in out and "kernels.json" in out
    assert "worst median" in out


def test_full_runs_take_at_least_five_alternating_rounds() -> None:
    assert bench.FULL_ROUNDS >= 5 and bench.FULL_PAIRS >= 3


def test_round_ratio_alternates_and_divides_median_call_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    times = iter([0.0, 1.0, 1.0, 3.0, 3.0, 5.0, 5.0, 6.0, 6.0, 100.0, 100.0, 102.0])

    def fake_clock() -> float:
        return next(times)

    # calls alternate (baseline first, then kernel first) and every call is timed
    monkeypatch.setattr(bench.time, "perf_counter", fake_clock)
    ratio, base_rate = bench.round_ratio(lambda: calls.append("k"), 10,
                                         lambda: calls.append("b"), 10,
                                         bench.torch.device("cpu"), pairs=3)
    assert calls == ["b", "k", "k", "b", "b", "k"]
    # baseline calls took 1, 1, 94 s (median 1), kernel calls 2, 2, 2 s (median 2): the
    # 94-second outlier (a descheduled call) does not move the ratio
    assert base_rate == 10.0 and ratio == 0.5


def test_worst_point_is_the_lowest_median_from_64_kib() -> None:
    rows = [{"block_kib": 16, "gather": 0.1, "spread": {"gather": [0.1, 0.1]}},
            {"block_kib": 64, "gather": 0.9, "scatter": 0.85,
             "spread": {"gather": [0.7, 1.0], "scatter": [0.6, 1.2]}}]
    assert bench.worst_point(rows, ("gather", "scatter")) == {
        "block_kib": 64, "kernel": "scatter", "median": 0.85, "min": 0.6, "max": 1.2}

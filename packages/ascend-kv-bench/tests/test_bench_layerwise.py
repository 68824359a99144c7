# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench layerwise`` runs (smoke size) and reports both connectors.

Timings are recorded, never asserted.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.bench import layerwise as layerwise_bench
from vllm_ascend.distributed.kv_transfer.bench import ledger


def test_quick_run_writes_both_connectors(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    parser = argparse.ArgumentParser()
    layerwise_bench.add_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["layerwise", "--quick", "--out", str(tmp_path),
                              "--ledger", str(tmp_path / "ledger")])
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "layerwise.json").read_text())
    assert [r["connector"] for r in doc["rows"]] == ["layerwise", "pull"]
    assert all(len(v) == doc["config"]["requests"] for v in doc["samples_s"].values())
    assert doc["request_bytes"] == 2 * 16 * 2 * 64 * 4 * 4 * 4  # heads*bs*2hd*f32*blocks*layers
    assert doc["pull_over_layerwise"] > 0 and "machine" in doc
    assert "pull / layerwise" in capsys.readouterr().out
    # the ledger entry holds every sample: a round per request, a round per push vs raw
    (entry,) = ledger.read_entries(tmp_path / "ledger", "layerwise")
    n = doc["config"]["requests"]
    for kind in ("layerwise", "pull"):
        (ready,) = ledger.entry_samples(entry, what="kv_ready", connector=kind)
        assert [r[0] for r in ready["rounds"]] == [s[1] for s in doc["samples_s"][kind]]
        assert len(ledger.entry_samples(entry, what="forward", connector=kind)[0]["rounds"]) == n
    for path in ("raw", "connector"):
        (bulk,) = ledger.entry_samples(entry, what="bulk", path=path)
        assert len(bulk["rounds"]) == n and bulk["tags"]["bytes"] == doc["request_bytes"]


def test_registered_as_a_bench_entry_point() -> None:
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    eps = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
    assert eps["vllm_ascend_kv.bench"]["layerwise"] == (
        "vllm_ascend.distributed.kv_transfer.bench.layerwise:add_parser")

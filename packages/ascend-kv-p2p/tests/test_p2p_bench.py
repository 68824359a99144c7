# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench p2p`` runs (smoke size): repeated alternating rounds, the median
ratio with its min-max, the claims sent ahead and the worker's two claim modes.

Timings are recorded, never asserted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.kv_p2p.tooling import bench


def test_quick_run_reports_the_connector_and_every_claim_mode(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["p2p", "--quick", "--out", str(tmp_path)])
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "p2p.json").read_text())
    assert [r["blocks"] for r in doc["results"]] == [1, 16]
    assert doc["claim_mode"] in bench.MODES and doc["cpus"] >= 1
    assert "until the worker marks the request finished receiving" in doc["description"]
    assert doc["claim_mode"] == "ahead" and doc["rounds"] == 3
    assert "D's scheduler sees the request" in doc["description"]
    for row in doc["results"]:
        assert row["ratio"] == row[f"ratio_{doc['claim_mode']}"] > 0
        assert 0 < row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
        assert row["ratio_overlapped"] > 0 and row["ratio_claims_first"] > 0
    assert "claims_first" in capsys.readouterr().out

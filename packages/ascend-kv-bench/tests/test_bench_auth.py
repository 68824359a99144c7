# SPDX-License-Identifier: Apache-2.0
"""``bench auth``: a smoke run writes its JSON with both modes and the ratio."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_ascend.distributed.kv_transfer.bench import auth as bench_auth


def test_bench_auth_quick_writes_both_modes_and_the_ratio(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_auth.add_parser(parser.add_subparsers())
    args = parser.parse_args(["auth", "--quick", "--seconds", "0.05", "--out", str(tmp_path)])
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "auth.json").read_text())
    assert doc["benchmark"] == "auth"
    assert [r["mode"] for r in doc["results"]] == ["no key", "key"]
    assert all(r["msgs_per_s"] > 0 and r["samples"] > 0 for r in doc["results"])
    assert doc["ratio"] > 0 and doc["envelope_us"] > 0

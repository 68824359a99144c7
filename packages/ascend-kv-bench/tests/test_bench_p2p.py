# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench p2p`` runs (smoke size): repeated alternating rounds, the median
ratio with its min-max, the claims sent ahead, the worker's two claim modes, and a pair
with a deployment key alternating with them.

Timings are recorded, never asserted. The run (real transfer engines, seconds of CPU) goes
in a child process started when this module is collected: it runs on a free core while the
tests before it do, and the test asserts on what it wrote.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from ascend_kv_testing.procs import start_in_background
from vllm_ascend.distributed.kv_transfer.bench import p2p as bench

_OUT = Path(tempfile.mkdtemp(prefix="p2p-bench-"))
atexit.register(shutil.rmtree, _OUT, ignore_errors=True)
#: what the test ran in-process before: the bench's own parser, ``p2p --quick --out``
_RUN = start_in_background([sys.executable, "-c", (
    "import argparse, sys\n"
    "from vllm_ascend.distributed.kv_transfer.bench import p2p as bench\n"
    "parser = argparse.ArgumentParser()\n"
    "bench.add_parser(parser.add_subparsers(dest='bench'))\n"
    "args = parser.parse_args(['p2p', '--quick', '--auth', '--out', sys.argv[1]])\n"
    "sys.exit(args.func(args))\n"), str(_OUT)], timeout=540)


def test_quick_run_reports_the_connector_and_every_claim_mode() -> None:
    proc = _RUN.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((_OUT / "p2p.json").read_text())
    assert [r["blocks"] for r in doc["results"]] == [1, 16]
    assert doc["claim_mode"] in bench.MODES and doc["cpus"] >= 1
    assert "until the worker marks the request finished receiving" in doc["description"]
    assert doc["claim_mode"] == "window" and doc["rounds"] == 3
    assert "D's scheduler sees the request" in doc["description"]
    for row in doc["results"]:
        assert row["ratio"] == row[f"ratio_{doc['claim_mode']}"] > 0
        assert 0 < row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
        assert row["ratio_overlapped"] > 0 and row["ratio_claims_first"] > 0
        assert row["ratio_ahead"] > 0
        # window loads read from start_load_kv and polled (inline_reads), beside the others
        assert row["ratio_inline"] > 0 and row["inline_ms"] > 0
        assert 0 < row["ratio_inline_low"] <= row["ratio_inline_high"]
        # P's params carried the read window: loads read unclaimed (a load that ended
        # after it would be claimed; on a loaded machine a few may)
        assert 0 < row["window_reads"] <= 1
        # a keyed pair's loads alternate with the plain ones in the same rounds
        assert row["keyed_ms"] > 0
        assert 0 < row["keyed_vs_plain_min"] <= row["keyed_vs_plain"] <= row["keyed_vs_plain_max"]
        # each pair's loads in units of its own raw reads, timed in the same rounds
        assert row["keyed_raw_ms"] > 0 and row["keyed_vs_plain_time"] > 0
        assert row["ratio_keyed"] > 0
        # the 95% bootstrap intervals over the rounds
        assert 0 < row["ratio_low"] <= row["ratio_high"]
        assert 0 < row["keyed_vs_plain_low"] <= row["keyed_vs_plain_high"]
    assert doc["keyed"] is True and "alternating with the others" in doc["description"]
    assert "its own pair's raw read" in doc["description"]
    assert "claims_first" in proc.stdout


def test_sizes_option_takes_distinct_block_counts_and_refuses_bad_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="bench"))
    assert parser.parse_args(["p2p", "--sizes", "64,1,16,16"]).sizes == [1, 16, 64]
    assert parser.parse_args(["p2p"]).sizes is None  # the run's default: 1, 16, 128
    for bad in ("0,16", "one", ","):
        with pytest.raises(SystemExit):
            parser.parse_args(["p2p", "--sizes", bad])
        assert "--sizes" in capsys.readouterr().err

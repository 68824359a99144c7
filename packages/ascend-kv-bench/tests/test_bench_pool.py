# SPDX-License-Identifier: Apache-2.0
"""The pool benchmarks compute what they claim (no timing is asserted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.bench import pool as bench
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import LocalBackend


def _trace(tmp_path: Path, records: list[list[int]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 0, "input_length": 512 * len(r),
                                        "output_length": 1, "hash_ids": r}) + "\n"
                            for r in records))
    return path


def test_replay_counts_leading_hits_only(tmp_path: Path) -> None:
    reqs = bench.load_trace(_trace(tmp_path, [[0, 1, 2], [0, 1, 3], [4, 1, 2], [0, 1, 2, 5]]))
    res = bench.replay(reqs, LocalBackend(capacity=1 << 20), 64)
    # hits: 0, then [0,1], then none (4 is new, 1 and 2 do not count after a miss), then [0,1,2]
    assert (res["hit_blocks"], res["blocks"]) == (5, 13)


def test_small_capacity_evicts(tmp_path: Path) -> None:
    reqs = bench.load_trace(_trace(tmp_path, [[0, 1], [2, 3], [0, 1]]))
    lru = bench.replay(reqs, LocalBackend(capacity=2 * 64, eviction_policy="lru"), 64)
    assert lru["hit_blocks"] == 0
    assert bench.replay(reqs, LocalBackend(capacity=4 * 64), 64)["hit_blocks"] == 2


@pytest.mark.parametrize("line", ["not json", '{"hash_ids": "abc"}', '{"no": 1}',
                                  '{"hash_ids": [1, "x"]}'])
def test_load_trace_rejects_malformed_lines(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        bench.load_trace(path)


def test_trace_command_writes_results(tmp_path: Path) -> None:
    path = _trace(tmp_path, [[0, 1, 2], [0, 1, 3], [0, 4], [5, 6], [0, 1, 2]] * 10)
    args = argparse.Namespace(trace=str(path), quick=True, block_bytes=256,
                              out=str(tmp_path / "out"), ledger=str(tmp_path / "ledger"))
    assert bench._run("trace", bench.run_trace, args) == 0
    result = json.loads((tmp_path / "out" / "trace.json").read_text())
    assert result["unbounded"]["hit_rate"] > 0
    for row in result["rows"]:
        assert 0 <= row["hit_rate"] <= row["best_hit_rate"] <= 1
    # the ledger keeps each policy's hit blocks by segment of the trace: they sum to the
    # replay's hit rate
    from vllm_ascend.distributed.kv_transfer.bench import ledger

    (entry,) = ledger.read_entries(tmp_path / "ledger", "trace")
    assert "ledger_samples" not in entry["result"]
    (blocks,) = ledger.entry_samples(entry, trace="conversation", what="blocks")
    assert sum(r[0] for r in blocks["rounds"]) == result["unbounded"]["blocks"]
    assert len(blocks["rounds"]) == bench.SEGMENTS
    conv = result["traces"]["conversation"]
    for row in conv["rows"]:
        for policy in (*conv["policies"], "optimum"):
            (hits,) = ledger.entry_samples(entry, trace="conversation", policy=policy,
                                           capacity_fraction=row["capacity_fraction"])
            assert sum(r[0] for r in hits["rounds"]) / result["unbounded"]["blocks"] == \
                row[policy]["hit_rate"]


def test_a_held_out_trace_is_replayed_beside_the_others_with_its_digest(tmp_path: Path) -> None:
    import hashlib

    path = _trace(tmp_path, [[0, 1, 2], [0, 1, 3], [0, 4], [5, 6], [0, 1, 2]] * 10)
    other = tmp_path / "held"
    other.mkdir()
    held = _trace(other, [[7, 8], [7, 9], [7, 8, 10]] * 20)
    args = argparse.Namespace(trace=str(path), quick=True, block_bytes=256,
                              out=str(tmp_path / "out"), ledger=str(tmp_path / "ledger"),
                              held_out=[f"mooncake-synthetic={held}"])
    assert bench._run("trace", bench.run_trace, args) == 0
    result = json.loads((tmp_path / "out" / "trace.json").read_text())
    about = result["config"]["held_out"]["mooncake-synthetic"]
    assert about["sha256"] == hashlib.sha256(held.read_bytes()).hexdigest()
    assert result["traces"]["mooncake-synthetic"]["unbounded"]["blocks"] == 7 * 20
    from vllm_ascend.distributed.kv_transfer.bench import ledger

    (entry,) = ledger.read_entries(tmp_path / "ledger", "trace")
    assert ledger.entry_samples(entry, trace="mooncake-synthetic", what="blocks")
    for bad, says in ((["x"], "expected NAME=PATH"), ([f"conversation={held}"], "taken"),
                      ([f"a={held}", f"a={held}"], "taken"), (["a=/no/such"], "no file")):
        with pytest.raises(ValueError, match=says):
            bench.held_out_traces(bad)


def test_trace_command_without_a_trace_says_what_to_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_ascend.distributed.kv_transfer.core.tooling.cli import main

    monkeypatch.delenv(bench.TRACE_ENV, raising=False)
    assert main(["bench", "trace", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no trace given" in err and bench.TRACE_ENV in err and "Traceback" not in err
    assert main(["bench", "trace", str(tmp_path / "missing.jsonl"), "--quick",
                 "--out", str(tmp_path)]) == 2
    assert "missing.jsonl' not found" in capsys.readouterr().err


def test_the_local_rows_are_measured_again_with_glibcs_threshold_at_4_mib() -> None:
    out = bench._local_rows_in_child(bench.LOW_NT_THRESHOLD, quick=True)
    assert "skipped" not in out, out
    assert out["memcpy"]["non_temporal_threshold"] == 4 << 20
    assert [r["path"] for r in out["rows"]] == [
        f"local {what}, non-temporal from 4 MiB"
        for what in ("put (empty pool)", "put (full pool)", "get")]
    assert all(r["ratio_min"] <= r["ratio"] <= r["ratio_max"] for r in out["rows"])
    # every round's calls of the child come back for the ledger, under the rows' paths
    paths = {(s["tags"]["path"], s["tags"]["role"]) for s in out["samples"]}
    assert paths == {(r["path"], role) for r in out["rows"] for role in ("backend", "baseline")}
    assert all(len(s["rounds"]) == 5 for s in out["samples"])


def test_a_threshold_glibc_refuses_is_reported_not_measured() -> None:
    out = bench._local_rows_in_child(0x1000, quick=True)  # below glibc's minimum (0x4040)
    assert "rows" not in out
    assert "glibc did not take the threshold" in out["skipped"]


def test_every_round_of_the_local_rows_and_lookups_goes_to_the_ledger() -> None:
    blocks = bench._Blocks(4, 2, 4096)
    local = LocalBackend(capacity=4 * blocks.nbytes)
    try:
        rows, per_round, times = bench._local_rows(local, blocks, rounds=3)
        samples = bench.local_series(times, blocks.nbytes)
        lookups = bench._lookup_rates(local, quick=True, samples=samples)
    finally:
        local.close()
    by = {(s["tags"]["path"], s["tags"]["role"]): s for s in samples}
    for row, ratios in zip(rows, zip(*(r.values() for r in per_round), strict=True),
                           strict=True):
        ours, copy = by[row["path"], "backend"], by[row["path"], "baseline"]
        assert ours["tags"]["bytes"] == blocks.nbytes and len(ours["rounds"]) == 3
        # the row's per-round ratios are the series' copy time / backend time, round by round
        assert [c[0] / o[0] for o, c in zip(ours["rounds"], copy["rounds"], strict=True)] == \
            list(ratios)
    for row in lookups:
        (series,) = [s for s in samples if s["tags"]["path"] == row["path"]]
        assert series["tags"]["role"] == "lookup" and len(series["rounds"]) == 5
        assert row["keys/s"] == series["tags"]["keys"] / min(r[0] for r in series["rounds"])

# SPDX-License-Identifier: Apache-2.0
"""``bench index``: the proxy's prefix indexes fed through its subscriber with vLLM-format
frames (tiny sizes, seconds); the pool index's bound; a run's JSON and ledger entry."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from vllm_ascend.distributed.kv_transfer.bench import index, index_child
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index import (
    POOL_MAX_BLOCKS,
    PREFIX_MAX_BLOCKS,
)

SPEC: dict[str, Any] = {"block_size": 16, "blocks_per_batch": 8, "blocks_per_event": 1,
                        "batches": 3, "lookups": 5}


def test_feed_frames_decode_with_vllms_own_event_classes() -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    feed = index_child.Feed(16, 8, 3, "GPU")
    topic, seq, payload = feed.stored(10, 8)
    assert topic == b"" and int.from_bytes(seq, "big") == 0
    batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
    assert [len(e.block_hashes) for e in batch.events] == [3, 3, 2]
    first = batch.events[0]
    assert isinstance(first, BlockStored) and first.block_size == 16
    assert first.block_hashes == [index_child.block_key(i) for i in (10, 11, 12)]
    assert first.parent_block_hash == index_child.block_key(9)
    assert len(first.token_ids) == 3 * 16
    _, seq, payload = feed.removed(10, 4)
    assert int.from_bytes(seq, "big") == 1  # the publisher's counter goes on
    removed = msgspec.msgpack.decode(payload, type=KVEventBatch).events
    assert all(isinstance(e, BlockRemoved) and len(e.block_hashes) == 1 for e in removed)


def test_instance_index_keeps_its_size_and_is_unbounded() -> None:
    ix = index_child.InstanceIndex({**SPEC, "blocks": 200})
    fill = ix.fill()
    assert fill["blocks"] == 200 and len(ix.index) == 200 and fill["fill_blocks_per_s"] > 0
    for r in range(2):  # one round stores first, the other removes first
        out = ix.round(r)
        assert out["held"] == 200 and out["held_is_stored_minus_removed"] is True
        assert len(out["store_s"]) == len(out["remove_s"]) == 3 and len(out["lookup_s"]) == 5
    # what it holds is what was stored minus what was removed: nothing bounds it
    assert ix.index.stored - ix.index.removed == len(ix.index) == 200
    # warm-up (2), fill (200 / 8), two rounds of 3 stored and 3 removed: all applied cleanly
    assert ix.stream.counts == {"batches": 2 + 25 + 2 * 6}


def test_the_pool_index_holds_at_most_its_bound_and_forgets_the_oldest() -> None:
    rounds = index_child.PoolRounds({**SPEC, "bound": 100, "stored": 200, "more": 24})
    out = rounds.round(0)
    assert out["held"] == 100 and out["evicted"] == 100 and out["stored"] == 200
    assert out["newest_matched"] == 64 and out["oldest_matched"] == 0
    assert out["instance_index_held"] == 0  # the pool's events feed the pool's index only
    # each batch that started past the bound was timed (it evicted as many as it stored)
    assert len(out["store_past_bound_s"]) == len(range(104, 200, 8))
    # a later round stores `more` past the bound into the same index: still bounded, the
    # newest prompt (blocks 160..223) matched whole, every batch of the round timed
    out = rounds.round(1)
    assert out["stored"] == 224 and out["held"] == 100 and out["evicted"] == 124
    assert out["newest_matched"] == 64 and out["oldest_matched"] == 0
    assert len(out["store_past_bound_s"]) == 3


def _args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    index.add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["index", "--out", str(tmp_path / "out"), *argv])


def test_a_small_run_writes_its_json_and_a_ledger_entry(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    ledger = tmp_path / "ledger"
    args = _args(tmp_path, "--sizes", "2000", "4000", "--rounds", "2", "--batches", "2",
                 "--lookups", "10", "--block-size", "16", "--pool-bound", "256",
                 "--ledger", str(ledger))
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "out" / "index.json").read_text())
    assert doc["sizes"] == [2000, 4000] and doc["instance_index_bounded"] is True
    assert doc["instance_default_bound"] == PREFIX_MAX_BLOCKS
    assert doc["pool_default_bound"] == POOL_MAX_BLOCKS
    assert [r["held"] for r in doc["rows"]] == [[2000, 2000], [4000, 4000]]
    assert doc["pool"]["held"] == [256, 256] and doc["pool"]["held_at_most_bound"] is True
    # the first round stored twice the bound, the second an eighth of it more
    assert doc["pool"]["stored"] == [512, 544] and doc["pool"]["stored_more_per_round"] == 32
    (entry_path,) = (ledger / "index").glob("*.json.gz")
    entry = json.loads(gzip.decompress(entry_path.read_bytes()))
    assert set(entry["source"]["packages"]) == {"ascend-kv-p2p"}
    tags = [s["tags"] for s in entry["samples"]]
    assert {"index": "instance", "blocks_tracked": 4000, "metric": "lookup",
            "prompt_blocks": 64} in tags
    pool = next(s for s in entry["samples"] if s["tags"]["metric"] == "held"
                and s["tags"]["index"] == "pool")
    assert pool["tags"]["bound"] == 256 and pool["rounds"] == [[256.0], [256.0]]
    lookups = next(s for s in entry["samples"] if s["tags"]["metric"] == "lookup")
    assert [len(r) for r in lookups["rounds"]] == [10, 10]
    assert "held = stored - removed" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (("--sizes", "10"), "--sizes 10: at least 1000"),
    (("--rounds", "0"), "--rounds 0: at least 1"),
    (("--blocks-per-event", "9", "--blocks-per-batch", "8"), "--blocks-per-event 9: at most"),
    (("--pool-bound", "-1"), "--pool-bound -1: at least 1"),
])
def test_bad_options_are_refused_with_a_clear_message(tmp_path: Path, argv: tuple[str, ...],
                                                      message: str) -> None:
    args = _args(tmp_path, *argv)
    with pytest.raises(SystemExit, match="bench index: .*" + message.replace("-", r"\-")):
        args.func(args)
    assert not (tmp_path / "out").exists()  # refused before anything ran

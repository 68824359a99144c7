# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.core.hashing import ROOT_HASH, chained_block_hashes, to_hex


def test_full_blocks_only_and_chaining() -> None:
    toks = list(range(1, 40))
    hashes = chained_block_hashes(toks, 16)
    assert len(hashes) == 2  # 39 tokens: two full blocks, the partial one has no hash
    assert chained_block_hashes(toks[:32], 16) == hashes
    # the second block's hash depends on the first block
    other = chained_block_hashes([0] + toks[1:32], 16)
    assert other[0] != hashes[0] and other[1] != hashes[1]
    assert chained_block_hashes(toks, 16, extra=("lora-a",)) != hashes
    assert chained_block_hashes([], 16) == []


@given(st.lists(st.integers(0, 200_000), max_size=200), st.integers(1, 64))
def test_incremental_equals_full(toks: list[int], bs: int) -> None:
    full = chained_block_hashes(toks, bs)
    k = len(full) // 2
    assert chained_block_hashes(toks, bs, start_block=k, previous=full[:k]) == full


def test_equal_across_processes_with_different_hash_seeds() -> None:
    code = ("from vllm_ascend.distributed.kv_transfer.core.hashing import chained_block_hashes, to_hex;"
            "print(','.join(map(to_hex, chained_block_hashes(list(range(100)), 16, extra=('salt',)))))")
    outs = set()
    for seed in ("0", "1", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))
    assert len(outs) == 1
    assert to_hex(ROOT_HASH) in {to_hex(ROOT_HASH)}

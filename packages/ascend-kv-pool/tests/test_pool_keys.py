# SPDX-License-Identifier: Apache-2.0
"""Pool keys: the upstream format, head sharing across TP ranks, hashes stable across processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_ascend.distributed.kernels.heads import head_group_of_rank as head_rank_and_step
from vllm_ascend.distributed.kernels.heads import num_head_groups
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.errors import PoolKeyError
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.keys import (
    BlockHasher,
    KeyMetadata,
    LayerPoolKey,
    PoolKey,
    model_key_name,
    parse_key,
)


def test_key_strings_have_the_upstream_format() -> None:
    meta = KeyMetadata("Qwen3-8B", head_or_tp_rank=3, pcp_rank=0, dcp_rank=1, pp_rank=2)
    assert PoolKey(meta, "ab12").to_string() == \
        "Qwen3-8B@pcp0@dcp1@head_or_tp_rank:3@pp_rank:2@ab12"
    assert LayerPoolKey(meta, "ab12", 7).to_string() == "Qwen3-8B@pcp0@dcp1@head_or_tp_rank:3@ab12@7"


def test_model_name_is_the_last_path_component() -> None:
    assert model_key_name("/models/org/Qwen3-8B/") == "Qwen3-8B"
    assert model_key_name("tiny") == "tiny"


@given(model=st.from_regex(r"[A-Za-z0-9._\-/]{1,20}", fullmatch=True).filter(
           lambda s: s.strip("/")),
       head=st.integers(0, 64), pp=st.integers(0, 8), layer=st.integers(0, 200),
       digest=st.binary(min_size=32, max_size=32))
def test_keys_parse_back(model: str, head: int, pp: int, layer: int, digest: bytes) -> None:
    meta = KeyMetadata(model_key_name(model), head, 0, 0, pp)
    key = PoolKey(meta, digest.hex())
    assert parse_key(key.to_string()) == key
    lkey = LayerPoolKey(meta.with_pp(0), digest.hex(), layer)
    assert parse_key(lkey.to_string()) == lkey


@pytest.mark.parametrize("text", ["", "model@pcp0", "m@pcp0@dcp0@head_or_tp_rank:x@pp_rank:0@ab",
                                  "m@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@XYZ"])
def test_parse_key_rejects_garbage(text: str) -> None:
    with pytest.raises(PoolKeyError, match="not a pool key"):
        parse_key(text)


@given(tp=st.sampled_from([1, 2, 4, 8, 16]), heads=st.sampled_from([1, 2, 4, 8, 16, 32]))
def test_ranks_holding_the_same_heads_share_keys(tp: int, heads: int) -> None:
    groups = {}
    for rank in range(tp):
        head, step = head_rank_and_step(rank, tp, heads)
        groups.setdefault(head, []).append(rank)
        if heads < tp:
            assert step == tp // heads
        else:
            assert (head, step) == (rank, 1)
    assert len(groups) == num_head_groups(tp, heads)
    # every group is the same size: put_step ranks write one key space between them
    assert {len(v) for v in groups.values()} == {max(1, tp // heads)}


def test_head_rank_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        head_rank_and_step(0, 0, 4)


def test_hashes_chain_and_depend_on_every_earlier_token() -> None:
    h = BlockHasher(4, salt="s")
    a = h.hashes(list(range(12)))
    b = h.hashes([99, *range(1, 12)])
    assert len(a) == 3 and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b, strict=True))  # the first token changes every block
    # a shared prefix gives shared hashes
    assert h.hashes(list(range(8)) + [7, 7, 7, 7])[:2] == a[:2]


def test_extra_key_material_separates_lora_salt_and_layout() -> None:
    tokens = list(range(8))
    base = BlockHasher(4, salt="fp32")
    assert base.hashes(tokens, extra=base.extra("lora-a")) != base.hashes(tokens, extra=base.extra())
    assert base.hashes(tokens, extra=base.extra(None, "salt")) != base.hashes(
        tokens, extra=base.extra())
    other = BlockHasher(4, salt="bf16")
    assert other.hashes(tokens, extra=other.extra()) != base.hashes(tokens, extra=base.extra())


def test_partial_tail_hash_only_matches_the_same_tail() -> None:
    h = BlockHasher(4)
    with_tail = h.hashes(list(range(10)), include_partial=True)
    assert len(with_tail) == 3
    assert h.hashes(list(range(10)), include_partial=False) == with_tail[:2]
    # a longer prompt sharing the two tail tokens hashes its third block differently
    assert h.hashes(list(range(12)))[2] != with_tail[2]
    assert h.hashes(list(range(8)), include_partial=True) == with_tail[:2]  # aligned: no tail


def test_previous_hashes_are_reused_not_recomputed() -> None:
    h = BlockHasher(4)
    tokens = list(range(16))
    full = h.full_block_hashes(tokens)
    fake_prev = [b"\x00" * 32, full[1]]
    # hashes after the reused ones chain from them
    assert h.full_block_hashes(tokens, previous=fake_prev)[:2] == fake_prev
    assert h.full_block_hashes(tokens, previous=full[:2]) == full


def test_hashes_are_equal_across_processes_without_pythonhashseed() -> None:
    code = ("from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.keys import "
            "BlockHasher\nh = BlockHasher(32, salt='x')\n"
            "print(','.join(h.hashes(list(range(100)), extra=h.extra('lora', 'salt'), "
            "include_partial=True)))")
    outs = set()
    for seed in ("0", "1", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True).stdout.strip())
    assert len(outs) == 1
    assert len(outs.pop().split(",")) == 4

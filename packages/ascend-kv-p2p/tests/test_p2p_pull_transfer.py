# SPDX-License-Identifier: Apache-2.0
"""D's byte plan (``pull.transfer``) for every head split, with a transfer engine that
copies memory in-process: the staged NPU-layout path merges P ranks' head parts,
equal or not, through ascend-kernels' head ops; a keyed P's ranks are read at the addresses
of their grants (a table of the claimed blocks), with no region base known to D."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from vllm_ascend.distributed.kernels.heads import kv_heads_of_rank
from vllm_ascend.distributed.kv_transfer.core.layout import KVCacheLayout
from vllm_ascend.distributed.kv_transfer.kv_p2p.errors import RemoteKVUnavailable
from vllm_ascend.distributed.kv_transfer.kv_p2p.grants import BlockAddresser, granted_table
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import RecvMeta
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.transfer import read_request
from vllm_ascend.distributed.kv_transfer.kv_p2p.worker_base import head_slices

BS, NB, HD = 4, 6, 3


class MemcpyEngine:
    """Reads by ``memmove`` within this process (every "session" is this process)."""

    def read(self, peer: str, local: Sequence[int], remote: Sequence[int],
             lengths: Sequence[int], *, merged: bool = False) -> int:
        for dst, src, n in zip(local, remote, lengths, strict=True):
            ctypes.memmove(dst, src, n)
        return sum(lengths)

    def register_memory(self, addr: int, length: int) -> None:
        pass

    def unregister_memory(self, addr: int, length: int | None = None) -> None:
        pass


def npu_caches(heads: list[int], fill: bool) -> dict[str, Any]:
    k = torch.zeros(NB, BS, len(heads), HD)
    v = torch.zeros_like(k)
    if fill:
        for i, h in enumerate(heads):
            k[:, :, i] = h + 1
            v[:, :, i] = -(h + 1)
    return {"model.layers.0.self_attn.attn": (k, v)}


def grant_of(layout: KVCacheLayout, block_ids: list[int]) -> np.ndarray:
    """What a keyed P's claim grant of ``block_ids`` names, as D reads it back."""
    addresser = BlockAddresser([g.base_addr for g in layout.regions],
                               [g.block_stride for g in layout.regions])
    return granted_table(addresser.of(block_ids), addresser.num_regions,
                         regions=len(layout.regions), blocks=len(block_ids), who="P")


@pytest.mark.parametrize("keyed", [False, True], ids=["regions", "grant"])
@pytest.mark.parametrize(("total", "p_tp", "d_tp"), [
    (4, 2, 1), (4, 4, 2), (4, 1, 2), (12, 3, 2), (12, 4, 6), (2, 4, 1)])
def test_every_d_rank_ends_with_exactly_its_heads(total: int, p_tp: int, d_tp: int,
                                                  keyed: bool) -> None:
    p_caches = [npu_caches(list(kv_heads_of_rank(total, p_tp, r)), True) for r in range(p_tp)]
    remotes, grants = {}, {}
    meta = RecvMeta("r", [1, 4], None, remote_block_ids=[5, 2])
    for r, caches in enumerate(p_caches):
        layout = KVCacheLayout.from_kv_caches(caches, block_size=BS)
        remotes[r] = SimpleNamespace(  # a keyed P's metadata: no region addresses
            session="self", layout=layout.descriptor(),
            region_addrs=[] if keyed else [g.base_addr for g in layout.regions],
            region_strides=[] if keyed else [g.block_stride for g in layout.regions])
        grants[r] = grant_of(layout, meta.remote_block_ids)
    for d in range(d_tp):
        mine = list(kv_heads_of_rank(total, d_tp, d))
        d_caches = npu_caches(mine, False)
        layout = KVCacheLayout.from_kv_caches(d_caches, block_size=BS)
        plan = head_slices(total, p_tp, d_tp, d)
        used = {s.remote_rank: remotes[s.remote_rank] for s in plan}
        assert read_request(MemcpyEngine(), layout, meta, dict(sorted(used.items())), plan,
                            grants=grants if keyed else None) > 0
        k, v = d_caches["model.layers.0.self_attn.attn"]
        for i, h in enumerate(mine):
            assert bool((k[[1, 4], :, i] == h + 1).all()) and bool((v[[1, 4], :, i] == -(h + 1)).all())
        assert k[[0, 2, 3, 5]].abs().sum() == 0  # blocks not pulled stay untouched


def _p_rank(caches: dict[str, Any]) -> SimpleNamespace:
    layout = KVCacheLayout.from_kv_caches(caches, block_size=BS)
    return SimpleNamespace(session="self", layout=layout.descriptor(),
                           region_addrs=[g.base_addr for g in layout.regions],
                           region_strides=[g.block_stride for g in layout.regions])


def test_a_kept_read_plan_serves_later_requests_and_a_new_p_meta_gets_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Address plans kept between requests: the same P metadata and head plan are planned
    once, each request still reads its own blocks, and P's new metadata (a restart: other
    regions) is planned again, so D never reads the old addresses."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import transfer as pull_transfer

    made: list[int] = []
    real = pull_transfer._rank_plan
    monkeypatch.setattr(pull_transfer, "_rank_plan",
                        lambda *a, **k: made.append(1) or real(*a, **k))
    plans = pull_transfer.AddressPlans()
    first = npu_caches([0, 1], True)
    remote = _p_rank(first)
    d_caches = npu_caches([0, 1], False)
    layout = KVCacheLayout.from_kv_caches(d_caches, block_size=BS)
    plan = head_slices(2, 1, 1, 0)
    k, _v = d_caches["model.layers.0.self_attn.attn"]
    for local, far in (([1], [3]), ([2, 4], [0, 5])):
        read_request(MemcpyEngine(), layout, RecvMeta("r", local, None, remote_block_ids=far),
                     {0: remote}, plan, plans=plans)
        assert bool((k[local, :, 1] == 2).all())
    assert len(made) == 1
    assert k[[0, 3, 5]].abs().sum() == 0
    restarted = npu_caches([0, 1], False)  # P came back with new (here: other) memory
    restarted["model.layers.0.self_attn.attn"][0][:, :, 1] = 7
    read_request(MemcpyEngine(), layout, RecvMeta("r2", [0], None, remote_block_ids=[3]),
                 {0: _p_rank(restarted)}, plan, plans=plans)
    assert len(made) == 2
    assert bool((k[0, :, 1] == 7).all())
    del first


def test_a_load_s_ranges_are_its_blocks_merged_where_consecutive_on_both_sides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DirectPlan.ranges (Python below VECTOR_MIN_RANGES, numpy from it) reads exactly the
    bytes of every block of every segment, in as many ranges as merging the per-block
    ranges adjacent on both sides gives."""
    import random

    from vllm_ascend.distributed.kv_transfer.core.transfer_engine import coalesce
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import transfer as pull_transfer

    def per_block(segments: list[Any], local: list[int], far: list[int]) -> Any:
        ranges = [(lb + b * ls + ol, rb + f * rs + orr, n)
                  for lb, ls, ol, rb, rs, orr, n in segments
                  for b, f in zip(local, far, strict=True)]
        return coalesce(*zip(*ranges, strict=True))

    def pieces(loc: list[int], rem: list[int], lens: list[int]) -> set[tuple[int, int]]:
        return {(a + k, b + k) for a, b, n in zip(loc, rem, lens, strict=True)
                for k in range(0, n, 16)}

    rng = random.Random(3)
    for _ in range(150):
        segments = []
        for i in range(rng.randint(1, 6)):
            whole = rng.random() < 0.6
            stride, length = (64, 64) if whole else (128, rng.choice([32, 64]))
            off = 0 if whole else rng.choice([0, 64])
            segments.append(((i + 1) << 20, stride, off, (i + 1) << 30, stride, off, length))
        n = rng.randint(1, 40)
        local = sorted(rng.sample(range(100), n))
        first = rng.randint(0, 50)
        far = [first + k if rng.random() < 0.8 else 200 + k for k in range(n)]
        want = per_block(segments, local, far)
        for threshold in (1 << 30, 1):
            monkeypatch.setattr(pull_transfer, "VECTOR_MIN_RANGES", threshold)
            got = pull_transfer.DirectPlan(segments).ranges(pull_transfer.LoadBlocks(local, far))
            assert pieces(*got) == pieces(*want)
            assert len(got[0]) == len(want[0]) and sum(got[2]) == sum(want[2])


def test_a_keyed_p_rank_is_read_only_at_its_grants_addresses() -> None:
    """Without a grant, a P rank whose metadata names no regions is not read at all
    (``no_regions``: D never guesses an address); with one, the claimed blocks land."""
    p_caches = npu_caches([0, 1], True)
    p_layout = KVCacheLayout.from_kv_caches(p_caches, block_size=BS)
    remote = SimpleNamespace(session="self", layout=p_layout.descriptor(), region_addrs=[],
                             region_strides=[])
    d_caches = npu_caches([0, 1], False)
    layout = KVCacheLayout.from_kv_caches(d_caches, block_size=BS)
    plan = head_slices(2, 1, 1, 0)
    meta = RecvMeta("r", [3, 0, 2], None, remote_block_ids=[1, 5, 4])
    with pytest.raises(RemoteKVUnavailable) as err:
        read_request(MemcpyEngine(), layout, meta, {0: remote}, plan)
    assert err.value.code == "no_regions"
    k, v = d_caches["model.layers.0.self_attn.attn"]
    assert k.abs().sum() == 0 and v.abs().sum() == 0
    p_k, p_v = p_caches["model.layers.0.self_attn.attn"]
    p_k.copy_(torch.arange(p_k.numel(), dtype=p_k.dtype).reshape(p_k.shape))
    assert read_request(MemcpyEngine(), layout, meta, {0: remote}, plan,
                        grants={0: grant_of(p_layout, meta.remote_block_ids)}) > 0
    torch.testing.assert_close(k[[3, 0, 2]], p_k[[1, 5, 4]], rtol=0, atol=0)
    torch.testing.assert_close(v[[3, 0, 2]], p_v[[1, 5, 4]], rtol=0, atol=0)
    assert k[[1, 4, 5]].abs().sum() == 0


def test_a_grants_ranges_are_those_of_the_regions_bases(monkeypatch: pytest.MonkeyPatch) -> None:
    """DirectPlan.granted_ranges over a grant's table reads exactly the bytes, in as many
    ranges, as DirectPlan.ranges over the bases and strides the table was made of, whatever
    the order of the load's blocks."""
    import random

    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import transfer as pull_transfer

    def pieces(loc: list[int], rem: list[int], lens: list[int]) -> set[tuple[int, int]]:
        return {(a + k, b + k) for a, b, n in zip(loc, rem, lens, strict=True)
                for k in range(0, n, 16)}

    rng = random.Random(5)
    for _ in range(150):
        segments, bases, strides = [], [], []
        for i in range(rng.randint(1, 6)):
            whole = rng.random() < 0.6
            stride, length = (64, 64) if whole else (128, rng.choice([32, 64]))
            off = 0 if whole else rng.choice([0, 64])
            segments.append(((i + 1) << 20, stride, off, (i + 1) << 30, stride, off, length))
            bases.append((i + 1) << 30)
            strides.append(stride)
        n = rng.randint(1, 40)
        local = rng.sample(range(100), n)  # the claim's order, not sorted
        first = rng.randint(0, 50)
        far = [first + k if rng.random() < 0.8 else 200 + k for k in range(n)]
        blocks = pull_transfer.LoadBlocks(local, far)
        monkeypatch.setattr(pull_transfer, "VECTOR_MIN_RANGES", 1 << 30)
        want = pull_transfer.DirectPlan(segments).ranges(blocks)
        addresser = BlockAddresser(bases, strides)
        table = granted_table(addresser.of(far), len(bases), regions=len(bases), blocks=n,
                              who="P")
        plan = pull_transfer.DirectPlan(segments, p_regions=range(len(segments)))
        got = plan.granted_ranges(blocks, table)
        assert pieces(*got) == pieces(*want)
        assert len(got[0]) == len(want[0]) and sum(got[2]) == sum(want[2])

# SPDX-License-Identifier: Apache-2.0
"""Head split/merge for heterogeneous TP, and the in-place transpose by block."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_strategies import DTYPES, IMPLS, fill

from vllm_ascend.distributed.kernels import (
    DuplicateIdError,
    KernelShapeError,
    gather_blocks,
    head_part_shape,
    merge_head_parts,
    select_head_part,
    split_head_parts,
    transpose_kv_by_block,
)

SETTINGS = settings(max_examples=50, deadline=None)

# vLLM CPU layout (heads on axis 0 of the block shape) and the NPU layout (axis 1).
LAYOUTS = {0: lambda nb, bs, h, d: (nb, h, bs, d), 1: lambda nb, bs, h, d: (nb, bs, h, d)}


def heads_of(full: torch.Tensor, axis: int, lo: int, hi: int) -> torch.Tensor:
    return full.narrow(axis + 1, lo, hi - lo).contiguous()


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (4, 2), (4, 1), (8, 2)])
def test_p_tp_multiple_of_d_tp_merges_parts(axis: int, p_tp: int, d_tp: int) -> None:
    heads, nb, bs, hd = 8, 6, 4, 3
    full = fill(LAYOUTS[axis](nb, bs, heads, hd), torch.bfloat16, seed=p_tp)
    p_caches = [heads_of(full, axis, r * heads // p_tp, (r + 1) * heads // p_tp)
                for r in range(p_tp)]
    n = p_tp // d_tp
    ids = [5, 0, 2]
    for q in range(d_tp):
        parts = [gather_blocks(p_caches[q * n + i], ids) for i in range(n)]
        merged = merge_head_parts(parts, axis)
        want = heads_of(full, axis, q * heads // d_tp, (q + 1) * heads // d_tp)[ids]
        assert torch.equal(merged, want)
        out = torch.empty_like(want)
        assert merge_head_parts(parts, axis, out=out) is out and torch.equal(out, want)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 4), (1, 4), (2, 8)])
def test_d_tp_multiple_of_p_tp_selects_a_part(axis: int, p_tp: int, d_tp: int) -> None:
    heads, nb, bs, hd = 8, 5, 2, 4
    full = fill(LAYOUTS[axis](nb, bs, heads, hd), torch.float32, seed=d_tp)
    p_caches = [heads_of(full, axis, r * heads // p_tp, (r + 1) * heads // p_tp)
                for r in range(p_tp)]
    n = d_tp // p_tp
    ids = [1, 4]
    for q in range(d_tp):
        blocks = gather_blocks(p_caches[q // n], ids)
        part = select_head_part(blocks, n, q % n, axis)
        want = heads_of(full, axis, q * heads // d_tp, (q + 1) * heads // d_tp)[ids]
        assert part.is_contiguous() and torch.equal(part, want)
        assert torch.equal(split_head_parts(blocks, n, axis)[q % n], want)


def pull_part_major(d_cache: torch.Tensor, p_caches: list[torch.Tensor], pairs: list[tuple]) -> None:
    """What D's byte-range reads do: P block i lands as chunk i of the D block."""
    flat = d_cache.view(d_cache.shape[0], -1)
    for src, dst in pairs:
        chunk = flat.shape[1] // len(p_caches)
        for i, pc in enumerate(p_caches):
            flat[dst, i * chunk:(i + 1) * chunk] = pc[src].flatten()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_transpose_after_multi_rank_pull(impl: str, axis: int, n: int) -> None:
    heads, nb, bs, hd = 4, 6, 3, 2
    full = fill(LAYOUTS[axis](nb, bs, heads, hd), torch.float16, seed=n)
    p_caches = [heads_of(full, axis, i * heads // n, (i + 1) * heads // n) for i in range(n)]
    d_cache = torch.zeros(nb, *full.shape[1:], dtype=full.dtype)
    untouched = fill(d_cache.shape, d_cache.dtype, seed=99)
    d_cache[3] = untouched[3]
    pairs = [(0, 4), (2, 1), (5, 0)]
    pull_part_major(d_cache, p_caches, pairs)
    transpose_kv_by_block([d_cache], [dst for _, dst in pairs], n, head_axis=axis, impl=impl)
    for src, dst in pairs:
        assert torch.equal(d_cache[dst], full[src])
    assert torch.equal(d_cache[3], untouched[3])  # blocks not listed do not move


@SETTINGS
@given(data=st.data(), axis=st.sampled_from([0, 1, 2]), n=st.sampled_from([1, 2, 3]),
       layers=st.integers(1, 3))
def test_transpose_inverse_round_trip(data: st.DataObject, axis: int, n: int,
                                      layers: int) -> None:
    shape = [data.draw(st.integers(1, 3)) for _ in range(3)]
    shape[axis] *= n
    nb = data.draw(st.integers(1, 6))
    dtype = data.draw(st.sampled_from(DTYPES))
    caches = [fill((nb, *shape), dtype, seed=i) for i in range(layers)]
    ids = data.draw(st.lists(st.integers(0, nb - 1), unique=True, max_size=nb))
    results = {}
    for impl in IMPLS:
        work = [c.clone() for c in caches]
        transpose_kv_by_block(work, ids, n, head_axis=axis, impl=impl)
        results[impl] = [w.clone() for w in work]
        transpose_kv_by_block(work, ids, n, head_axis=axis, inverse=True, impl=impl)
        for w, c in zip(work, caches, strict=True):
            assert torch.equal(w, c), impl
    for a, b in zip(results["reference"], results["torch"], strict=True):
        assert torch.equal(a, b)


def test_transpose_is_identity_for_the_cpu_layout() -> None:
    cache = fill((4, 4, 2, 3), torch.float32, seed=1)  # heads on axis 0
    before = cache.clone()
    transpose_kv_by_block([cache], [0, 1, 2, 3], 2, head_axis=0)
    assert torch.equal(cache, before)


def test_mla_has_no_heads_to_split() -> None:
    latent = fill((3, 4, 1, 8), torch.float32, seed=2)  # (num_blocks, block_size, 1, rank)
    assert head_part_shape(latent.shape[1:], 1, 1) == (4, 1, 8)
    with pytest.raises(KernelShapeError, match="1 KV heads .* 2 equal parts"):
        select_head_part(latent, 2, 0, 1)
    # head_axis=None: the latent is replicated, every part is all of it
    assert torch.equal(select_head_part(latent, 4, 3, None), latent)
    assert torch.equal(merge_head_parts([latent], None), latent)
    with pytest.raises(KernelShapeError, match="replicated"):
        merge_head_parts([latent, latent], None)
    transpose_kv_by_block([latent], [0, 1], 1, head_axis=1)  # one part: nothing to do


def test_head_errors() -> None:
    blocks = torch.zeros(2, 3, 6, 4)
    with pytest.raises(KernelShapeError, match="6 KV heads .* 4 equal parts"):
        split_head_parts(blocks, 4, 1)
    with pytest.raises(KernelShapeError, match="part must be in"):
        select_head_part(blocks, 2, 2, 1)
    with pytest.raises(KernelShapeError, match="num_parts"):
        select_head_part(blocks, 0, 0, 1)
    with pytest.raises(KernelShapeError, match="head_axis=3"):
        split_head_parts(blocks, 2, 3)
    with pytest.raises(KernelShapeError, match="parts must be equal"):
        merge_head_parts([blocks, blocks[:1]], 1)
    with pytest.raises(KernelShapeError, match="out is"):
        select_head_part(blocks, 2, 0, 1, out=torch.empty(2, 3, 6, 4))
    with pytest.raises(DuplicateIdError):
        transpose_kv_by_block([blocks], [1, 1], 2, head_axis=1)
    with pytest.raises(IndexError):
        transpose_kv_by_block([blocks, blocks[:1]], [1], 2, head_axis=1)
    with pytest.raises(KernelShapeError, match=r"caches\[1\]"):
        transpose_kv_by_block([blocks, torch.zeros(2, 3, 5, 4)], [0], 2, head_axis=1)

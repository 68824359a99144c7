# SPDX-License-Identifier: Apache-2.0
"""The NPU implementation's call plumbing, run against ``fake_torch_npu``.

The fake keeps the real operators' signatures (and their int32 index
tensors), so these tests check that the NPU path calls the right operator
with the right arguments and gets the reference result, and that it falls
back to the torch path where an operator does not apply.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernels_strategies import fill

from ascend_kv_testing import fake_torch_npu as fake
from vllm_ascend.distributed.kernels import (
    NpuUnavailableError,
    copy_blocks,
    copy_blocks_all_layers,
    gather_blocks,
    gather_blocks_all_layers,
    impl_npu,
    load_tokens,
    paged_cache_load,
    reshape_and_cache,
    scatter_blocks,
    transpose_kv_by_block,
)

SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def calls() -> list[str]:
    return [name for name, _ in fake.CALLS]


def test_npu_impl_without_torch_npu_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    with pytest.raises(NpuUnavailableError, match=r"ascend-kernels\[npu\]"):
        gather_blocks(torch.zeros(2, 3), [0], impl="npu")
    assert isinstance(NpuUnavailableError("x"), ImportError)


def test_importing_the_kernels_does_not_import_torch_npu() -> None:
    assert "torch_npu" not in sys.modules or sys.modules["torch_npu"] is None


def test_whole_blocks(fake_torch_npu: Any) -> None:
    cache = fill((6, 16, 2, 8), torch.float16, seed=1)
    ids = [5, 1, 1, 0]
    assert torch.equal(gather_blocks(cache, ids, impl="npu"), cache[ids])
    layers = [cache, cache * 2]
    assert torch.equal(gather_blocks_all_layers(layers, ids, impl="npu")[1], cache[ids] * 2)
    target = torch.zeros_like(cache)
    scatter_blocks(cache[[2, 3]], target, [4, 0], impl="npu")
    assert torch.equal(target[4], cache[2]) and torch.equal(target[0], cache[3])


def test_copy_blocks_npu_path(fake_torch_npu: Any) -> None:
    # device index_select + index_copy_ per layer; reads first when memory is shared
    src = [fill((6, 16, 2, 8), torch.float16, seed=2 + i) for i in range(2)]
    dst = [torch.zeros(5, 16, 2, 8, dtype=torch.float16) for _ in range(2)]
    copy_blocks_all_layers(src, [5, 0, 5], dst, [1, 2, 4], impl="npu")
    for s_, d in zip(src, dst, strict=True):
        assert torch.equal(d[[1, 2, 4]], s_[[5, 0, 5]]) and not d[0].any()
    cache = fill((4, 3), torch.float32, seed=9)
    expected = cache.clone()
    expected[[1, 2]] = cache[[0, 1]]
    copy_blocks(cache, [0, 1], cache, [1, 2], impl="npu")  # block 1 read before it is written
    assert torch.equal(cache, expected)


@SETTINGS
@given(data=st.data())
def test_paged_cache_load_calls_the_atb_operator(fake_torch_npu: Any,
                                                 data: st.DataObject) -> None:
    bs, nb, heads = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 6)), 2
    k = fill((nb, bs, heads, 3), torch.bfloat16, seed=data.draw(st.integers(0, 99)))
    v = fill((nb, bs, heads, 5), torch.bfloat16, seed=7)  # V head size differs (MLA-like)
    batch = data.draw(st.integers(1, 3))
    table = torch.tensor([[data.draw(st.integers(0, nb - 1)) for _ in range(3)]
                          for _ in range(batch)])
    starts = [bs * data.draw(st.integers(0, 2)) for _ in range(batch)]  # block aligned
    lens = [data.draw(st.integers(0, 3 * bs - s)) for s in starts]
    fake.CALLS.clear()
    key, value = paged_cache_load(k, v, table, lens, starts, impl="npu")
    ref_k, ref_v = paged_cache_load(k, v, table, lens, starts, impl="reference")
    assert torch.equal(key, ref_k) and torch.equal(value, ref_v)
    assert calls() == (["npu_paged_cache_load"] if sum(lens) else [])


def test_paged_cache_load_falls_back_where_the_operator_does_not_apply(
        fake_torch_npu: Any) -> None:
    k = fill((4, 4, 2, 3), torch.float32, seed=2)
    # starts inside a block: the ATB operator starts at a block boundary
    key, _ = paged_cache_load(k, k, [[1, 3]], [3], [2], impl="npu")
    assert torch.equal(key, torch.stack([k[1, 2], k[1, 3], k[3, 0]]))
    # vLLM's CPU layout: tokens on axis 1 of the block shape
    cpu = fill((4, 2, 4, 6), torch.float32, seed=3)
    key, _ = paged_cache_load(cpu, cpu, [[2]], [2], token_axis=1, impl="npu")
    assert torch.equal(key, cpu[2, :, :2].transpose(0, 1))
    assert torch.equal(load_tokens(cpu, [[2]], [2], token_axis=1, impl="npu"), key)
    assert calls() == []


@SETTINGS
@given(data=st.data())
def test_reshape_and_cache_calls_the_operator(fake_torch_npu: Any, data: st.DataObject) -> None:
    nb, bs = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    slots = data.draw(st.lists(st.integers(0, nb * bs - 1), unique=True, min_size=1,
                               max_size=nb * bs))
    if data.draw(st.booleans()):
        slots.insert(data.draw(st.integers(0, len(slots))), -1)  # a padding row
    mla = data.draw(st.booleans())
    k_rows = fill((len(slots), 1, 6), torch.float16, seed=len(slots))
    v_rows = fill((len(slots), 1, 2 if mla else 6), torch.float16, seed=3)
    results = {}
    for impl in ("npu", "reference"):
        kc = torch.zeros(nb, bs, 1, 6, dtype=torch.float16)
        vc = torch.zeros(nb, bs, 1, v_rows.shape[-1], dtype=torch.float16)
        fake.CALLS.clear()
        reshape_and_cache(k_rows, v_rows, kc, vc, torch.tensor(slots), impl=impl)
        results[impl] = (kc, vc, calls())
    assert torch.equal(results["npu"][0], results["reference"][0])
    assert torch.equal(results["npu"][1], results["reference"][1])
    assert results["npu"][2] == ["npu_scatter_pa_kv_cache" if mla else "_npu_reshape_and_cache"]
    assert results["reference"][2] == []


def _pulled(n: int, layers: int) -> tuple[list[torch.Tensor], list[int]]:
    caches = [fill((6, 4, 4, 2), torch.bfloat16, seed=i) for i in range(2 * layers)]
    return caches, [4, 0, 3]


@pytest.mark.parametrize("n", [2, 4])
def test_transpose_composed_path_without_the_fused_op(fake_torch_npu: Any, n: int) -> None:
    caches, ids = _pulled(n, layers=2)
    want = [c.clone() for c in caches]
    transpose_kv_by_block(want, ids, n, head_axis=1, impl="reference")
    got = [c.clone() for c in caches]
    transpose_kv_by_block(got, ids, n, head_axis=1, impl="npu")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert calls() == ["npu_paged_cache_load", "_npu_reshape_and_cache"] * 2
    # inverse through the same operators restores the pulled bytes
    transpose_kv_by_block(got, ids, n, head_axis=1, inverse=True, impl="npu")
    assert all(torch.equal(a, b) for a, b in zip(got, caches, strict=True))


def test_transpose_odd_number_of_caches(fake_torch_npu: Any) -> None:
    caches, ids = _pulled(2, layers=1)
    caches = caches[:1]
    want = caches[0].clone()
    transpose_kv_by_block([want], ids, 2, head_axis=1, impl="reference")
    transpose_kv_by_block(caches, ids, 2, head_axis=1, impl="npu")
    assert torch.equal(caches[0], want)


def test_transpose_uses_the_fused_op_when_loaded(fake_torch_npu: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple] = []

    def fused(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_ids: torch.Tensor,
              block_size: int, num_kv_head: int, head_dim: int, split_num: int,
              layers: int) -> None:
        # upstream's golden: per block, (split, block_size, -1) -> (block_size, split, -1)
        seen.append((len(k_caches), len(v_caches), block_ids.dtype, block_size, num_kv_head,
                     head_dim, split_num, layers))
        for cache in (*k_caches, *v_caches):
            for b in block_ids.tolist():
                sel = cache[b].clone()
                cache[b].copy_(sel.reshape(split_num, block_size, -1).transpose(0, 1)
                               .reshape_as(sel))

    monkeypatch.setattr(impl_npu, "fused_transpose_op", lambda: fused)
    caches, ids = _pulled(2, layers=3)
    want = [c.clone() for c in caches]
    transpose_kv_by_block(want, ids, 2, head_axis=1, impl="reference")
    transpose_kv_by_block(caches, ids, 2, head_axis=1, impl="npu")
    assert seen == [(3, 3, torch.int64, 4, 4, 2, 2, 3)]
    assert all(torch.equal(a, b) for a, b in zip(caches, want, strict=True))
    assert calls() == []


def test_transpose_other_head_axes_use_the_torch_path(fake_torch_npu: Any) -> None:
    cache = fill((3, 4, 5, 2), torch.float32, seed=4)
    want = cache.clone()
    transpose_kv_by_block([want], [2, 1], 2, head_axis=2, impl="reference")
    transpose_kv_by_block([cache], [2, 1], 2, head_axis=2, impl="npu")
    assert torch.equal(cache, want) and calls() == []

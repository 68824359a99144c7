# SPDX-License-Identifier: Apache-2.0
"""gather/scatter of whole blocks: every implementation against the reference and an oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_strategies import IMPLS, caches, fill

from vllm_ascend.distributed.kernels import (
    BlockIdError,
    DuplicateIdError,
    KernelShapeError,
    gather_blocks,
    gather_blocks_all_layers,
    scatter_blocks,
    scatter_blocks_all_layers,
)

SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(data=st.data(), cache=caches())
def test_gather_matches_reference_and_oracle(data: st.DataObject, cache: torch.Tensor) -> None:
    nb = cache.shape[0]
    ids = data.draw(st.lists(st.integers(0, nb - 1), max_size=15) if nb else st.just([]))
    as_tensor = data.draw(st.booleans())
    arg = torch.tensor(ids, dtype=data.draw(st.sampled_from([torch.int32, torch.int64]))) \
        if as_tensor else ids
    oracle = cache[torch.tensor(ids, dtype=torch.long)] if ids else cache[:0].clone()
    before = cache.clone()
    for impl in IMPLS:
        out = gather_blocks(cache, arg, impl=impl)
        assert out.is_contiguous() and out.shape == (len(ids), *cache.shape[1:])
        assert torch.equal(out, oracle), impl
    assert torch.equal(cache, before)  # a gather never writes the cache


@SETTINGS
@given(data=st.data(), cache=caches())
def test_scatter_matches_reference_and_oracle(data: st.DataObject, cache: torch.Tensor) -> None:
    nb = cache.shape[0]
    ids = data.draw(st.lists(st.integers(0, max(nb - 1, 0)), unique=True, max_size=nb)
                    if nb else st.just([]))
    buf = fill((len(ids), *cache.shape[1:]), cache.dtype, seed=len(ids) + 7)
    if data.draw(st.booleans()) and buf.dim() >= 3:  # a non-contiguous source is fine too
        buf = buf.transpose(1, 2).contiguous().transpose(1, 2)
    expected = cache.clone()
    for j, b in enumerate(ids):
        expected[b] = buf[j]
    for impl in IMPLS:
        target = cache.clone() if cache.is_contiguous() else _same_layout_copy(cache)
        scatter_blocks(buf, target, ids, impl=impl)
        assert torch.equal(target, expected), impl


def _same_layout_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    out.copy_(t)
    return out


def test_scatter_writes_through_kv_views() -> None:
    # K and V regions of one allocation: scattering into K leaves V untouched.
    alloc = fill((6, 2, 4, 3, 8), torch.bfloat16, seed=1)
    original = alloc.clone()
    k = alloc[:, 0]
    buf = fill((2, 4, 3, 8), torch.bfloat16, seed=2)
    scatter_blocks(buf, k, [4, 1])
    assert torch.equal(alloc[:, 1], original[:, 1])
    assert torch.equal(alloc[4, 0], buf[0]) and torch.equal(alloc[1, 0], buf[1])
    assert torch.equal(alloc[0, 0], original[0, 0])


@SETTINGS
@given(data=st.data(), num_layers=st.integers(1, 4))
def test_all_layers_forms(data: st.DataObject, num_layers: int) -> None:
    first = data.draw(caches(min_blocks=1))
    layers = [first] + [data.draw(caches(min_blocks=first.shape[0], block_shape=first.shape[1:],
                                         dtype=first.dtype)) for _ in range(num_layers - 1)]
    nb = min(c.shape[0] for c in layers)
    ids = data.draw(st.lists(st.integers(0, nb - 1), unique=True, max_size=nb))
    for impl in IMPLS:
        out = gather_blocks_all_layers(layers, ids, impl=impl)
        assert out.shape == (num_layers, len(ids), *first.shape[1:])
        for i, c in enumerate(layers):
            assert torch.equal(out[i], gather_blocks(c, ids, impl="reference"))
    # round trip: scatter into fresh caches what was gathered, read it back
    targets = [torch.zeros_like(c) for c in layers]
    scatter_blocks_all_layers(out, targets, ids)
    for t, c in zip(targets, layers, strict=True):
        for b in ids:
            assert torch.equal(t[b], c[b])


def test_out_buffer_is_used_and_checked() -> None:
    cache = fill((5, 2, 32, 16), torch.float32, seed=3)
    out = torch.empty(3, 2, 32, 16)
    assert gather_blocks(cache, [0, 4, 2], out) is out
    assert torch.equal(out[1], cache[4])
    with pytest.raises(KernelShapeError, match="shape"):
        gather_blocks(cache, [0, 1], out)
    with pytest.raises(KernelShapeError, match="float16"):
        gather_blocks(cache, [0, 1, 2], out.half())
    with pytest.raises(KernelShapeError, match="contiguous"):
        gather_blocks(cache, [0, 1, 2], torch.empty(3, 16, 32, 2).transpose(1, 3))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [[5], [0, 7], [-1], [2, -3]])
def test_out_of_range_ids_raise_and_write_nothing(impl: str, bad: list[int]) -> None:
    cache = fill((5, 4, 8), torch.float32, seed=4)
    before = cache.clone()
    with pytest.raises(IndexError, match=str(max(bad) if min(bad) >= 0 else min(bad))):
        gather_blocks(cache, bad, impl=impl)
    with pytest.raises(BlockIdError):
        gather_blocks(cache, torch.tensor(bad), impl=impl)
    with pytest.raises(BlockIdError):
        scatter_blocks(torch.zeros(len(bad), 4, 8), cache, bad, impl=impl)
    with pytest.raises(BlockIdError):
        gather_blocks_all_layers([cache, cache[:3]], [3], impl=impl)  # valid in one, not both
    assert torch.equal(cache, before)


def test_empty_cache_and_empty_ids() -> None:
    empty = torch.zeros(0, 4, 8)
    assert gather_blocks(empty, []).shape == (0, 4, 8)
    scatter_blocks(torch.zeros(0, 4, 8), empty, torch.tensor([], dtype=torch.long))
    with pytest.raises(BlockIdError, match="0 blocks"):
        gather_blocks(empty, [0])
    assert gather_blocks_all_layers([torch.ones(3, 2)], []).shape == (1, 0, 2)


def test_malformed_ids_and_shapes() -> None:
    cache = fill((4, 2, 3), torch.float32, seed=5)
    with pytest.raises(KernelShapeError, match="integers"):
        gather_blocks(cache, [0.5])
    with pytest.raises(KernelShapeError, match="integers"):
        gather_blocks(cache, [True])
    with pytest.raises(KernelShapeError, match="integers"):
        gather_blocks(cache, torch.tensor([1.0]))
    with pytest.raises(KernelShapeError, match="1-D"):
        gather_blocks(cache, torch.tensor([[0, 1]]))
    with pytest.raises(KernelShapeError, match="sequence"):
        gather_blocks(cache, 3)  # type: ignore[arg-type]
    with pytest.raises(KernelShapeError, match="0-d"):
        gather_blocks(torch.tensor(1.0), [0])
    with pytest.raises(KernelShapeError, match="buffer"):
        scatter_blocks(torch.zeros(2, 3, 2), cache, [0, 1])
    with pytest.raises(KernelShapeError, match="same block shape"):
        gather_blocks_all_layers([cache, torch.zeros(4, 3, 2)], [0])
    with pytest.raises(KernelShapeError, match="no caches"):
        gather_blocks_all_layers([], [0])
    with pytest.raises(KernelShapeError, match="sequence of tensors"):
        gather_blocks_all_layers(cache, [0])  # type: ignore[arg-type]


def test_scatter_rejects_duplicate_ids() -> None:
    cache = torch.zeros(4, 2)
    with pytest.raises(DuplicateIdError, match="block id 2"):
        scatter_blocks(torch.ones(3, 2), cache, [2, 0, 2])
    with pytest.raises(DuplicateIdError, match="block id 1"):
        scatter_blocks(torch.ones(2, 2), cache, torch.tensor([1, 1]))
    assert not cache.any()


def test_id_lists_of_every_kind_validate_alike() -> None:
    """Plain-int lists take a packed fast path; int subclasses and huge ints keep the checks."""

    class Id(int):  # stands for numpy's integers: Integral, not exactly int
        pass

    cache = fill((6, 2, 3), torch.float32, seed=7)
    want = cache[torch.tensor([4, 0, 5])]
    for ids in ([4, 0, 5], (4, 0, 5), [Id(4), 0, Id(5)], range(3, 6)):
        got = gather_blocks(cache, ids)
        expect = want if not isinstance(ids, range) else cache[3:6]
        assert torch.equal(got, expect), ids
    with pytest.raises(BlockIdError, match=str(2**70)):
        gather_blocks(cache, [0, 2**70])
    with pytest.raises(BlockIdError, match="-1"):
        gather_blocks(cache, (0, -1))
    with pytest.raises(KernelShapeError, match="integers"):
        gather_blocks(cache, [0, False])
    # the first id seen twice is named, as in the per-id path
    with pytest.raises(DuplicateIdError, match="block id 3 "):
        scatter_blocks(torch.ones(4, 2, 3), cache, [5, 3, 1, 3])
    with pytest.raises(DuplicateIdError, match="block id 5 "):
        scatter_blocks(torch.ones(4, 2, 3), cache, (5, 1, 5, 1))
    assert torch.equal(cache, fill((6, 2, 3), torch.float32, seed=7))


@pytest.mark.parametrize("layout", ["cpu", "npu", "mla"])
def test_vllm_layouts_odd_counts(layout: str) -> None:
    shape = {"cpu": (7, 2, 32, 32), "npu": (7, 32, 2, 16), "mla": (7, 32, 1, 24)}[layout]
    cache = fill(shape, torch.bfloat16, seed=6)
    ids = [6, 0, 3]
    for impl in IMPLS:
        assert torch.equal(gather_blocks(cache, ids, impl=impl), cache[ids])


@pytest.mark.parametrize("block_shape", [
    (16, 32, 256),   # 512 KiB of float32: cut into sub-rows for index_select
    (4, 32771),      # 16 * 32771 bytes, a prime number of 16-byte units: not cut
    (2, 131072),     # 1 MiB
])
def test_big_blocks(block_shape: tuple[int, ...]) -> None:
    cache = fill((5, *block_shape), torch.float32, seed=8)
    ids = [4, 0, 2, 4]
    assert torch.equal(gather_blocks(cache, ids), cache[ids])
    kv = fill((5, 2, *block_shape), torch.float32, seed=9)[:, 1]  # block stride twice the block
    assert torch.equal(gather_blocks(kv, ids), kv[ids])
    target = torch.zeros_like(cache)
    scatter_blocks(cache[[1, 3]], target, [3, 1])
    assert torch.equal(target[3], cache[1]) and torch.equal(target[1], cache[3])


# ---------------------------------------------------------------- all layers in one call (CPU)
@st.composite
def layer_groups(draw: st.DrawFn) -> list[torch.Tensor]:
    """Per-layer regions as callers hold them: separate allocations (any order in memory), K and
    V views of one allocation (interleaved blocks), views of one big buffer, MLA, and mixes."""
    shape = draw(st.sampled_from([(2, 4, 8), (4, 1, 24), (3, 5), (8,), (), (2, 2, 16, 4)]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.int64]))
    nb = draw(st.integers(1, 9))
    kind = draw(st.sampled_from(["separate", "kv_interleaved", "kv_split", "one_buffer", "mixed"]))
    num = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    if kind == "kv_interleaved":  # (nb, 2, *block): K and V of each layer interleave
        allocs = [fill((nb, 2, *shape), dtype, seed + i) for i in range(num)]
        return [a[:, kv] for a in allocs for kv in (0, 1)]
    if kind == "kv_split":  # vLLM's CPU layout: (2, nb, *block), K then V
        allocs = [fill((2, nb, *shape), dtype, seed + i) for i in range(num)]
        return [a[kv] for a in allocs for kv in (0, 1)]
    if kind == "one_buffer":  # layers as consecutive views of one buffer, maybe reversed
        buf = fill((num, nb, *shape), dtype, seed)
        layers = list(buf.unbind(0))
        return layers[::-1] if draw(st.booleans()) else layers
    if kind == "mixed":
        caches_ = [draw(caches(min_blocks=nb, block_shape=shape, dtype=dtype)) for _ in range(num)]
        return [c[:nb] for c in caches_]
    return [fill((nb + draw(st.integers(0, 3)), *shape), dtype, seed + i) for i in range(num)]


@SETTINGS
@given(data=st.data(), layers=layer_groups())
def test_all_layers_fast_path_matches_reference(data: st.DataObject,
                                                layers: list[torch.Tensor]) -> None:
    nb = min(c.shape[0] for c in layers)
    ids = data.draw(st.lists(st.integers(0, nb - 1), unique=True, max_size=nb))
    gathered = {impl: gather_blocks_all_layers(layers, ids, impl=impl) for impl in IMPLS}
    assert torch.equal(gathered["torch"], gathered["reference"])
    buf = fill((len(layers), len(ids), *layers[0].shape[1:]), layers[0].dtype, seed=len(ids))
    results = {}
    for impl in IMPLS:
        targets = _clone_group(layers)
        scatter_blocks_all_layers(buf, targets, ids, impl=impl)
        results[impl] = targets
    for got, want in zip(results["torch"], results["reference"], strict=True):
        assert torch.equal(got, want)
    for layer, c in enumerate(results["torch"]):
        for j, b in enumerate(ids):
            assert torch.equal(c[b], buf[layer, j])


def _clone_group(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``layers`` that share memory exactly as the originals do."""
    storages: dict[int, torch.UntypedStorage] = {}
    out = []
    for c in layers:
        src = c.untyped_storage()
        new = storages.setdefault(src.data_ptr(), src.clone())
        out.append(torch.empty(0, dtype=c.dtype).set_(new, c.storage_offset(), c.shape,
                                                      c.stride()))
    return out


def test_all_layers_alias_writes_in_layer_order() -> None:
    # the same region twice (cross-layer KV sharing): the last layer's rows win, as in the reference
    cache = fill((6, 2, 8), torch.float32, seed=10)
    buf = fill((3, 2, 2, 8), torch.float32, seed=11)
    for impl in IMPLS:
        target = cache.clone()
        scatter_blocks_all_layers(buf, [target, target[1:], target], [4, 0], impl=impl)
        expected = cache.clone()
        for layer, view in enumerate([expected, expected[1:], expected]):
            view[4], view[0] = buf[layer, 0], buf[layer, 1]
        assert torch.equal(target, expected), impl
        out = gather_blocks_all_layers([target, target], [1, 5], impl=impl)
        assert torch.equal(out[0], out[1]) and torch.equal(out[0], target[[1, 5]])


def test_all_layers_move_in_one_call_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = [fill((8, 2, 4, 16), torch.bfloat16, seed=20 + i) for i in range(6)]
    calls: list[str] = []
    real_select, real_copy = torch.index_select, torch.Tensor.index_copy_

    def select(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append("index_select")
        return real_select(*args, **kwargs)  # type: ignore[arg-type]

    def copy(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append("index_copy_")
        return real_copy(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "index_select", select)
    monkeypatch.setattr(torch.Tensor, "index_copy_", copy)
    out = gather_blocks_all_layers(layers, [7, 0, 3])
    assert calls == ["index_select"]
    targets = [torch.zeros_like(c) for c in layers]
    scatter_blocks_all_layers(out, targets, [7, 0, 3])
    assert calls == ["index_select", "index_copy_"]
    monkeypatch.undo()
    for t, c in zip(targets, layers, strict=True):
        assert torch.equal(t[[7, 0, 3]], c[[7, 0, 3]])


@pytest.mark.parametrize("block_shape", [(16, 32, 256), (2, 131072), (4, 32771)])
def test_all_layers_big_blocks_and_kv_views(block_shape: tuple[int, ...]) -> None:
    # K/V views of one allocation (block stride twice the block), 512 KiB - 1 MiB blocks:
    # cut into sub-rows, in one call, whatever the stride
    allocs = [fill((4, 2, *block_shape), torch.float32, seed=30 + i) for i in range(2)]
    layers = [a[:, kv] for a in allocs for kv in (0, 1)]
    ids = [3, 0, 2]
    out = gather_blocks_all_layers(layers, ids)
    for layer, c in enumerate(layers):
        assert torch.equal(out[layer], c[ids])
    targets = [torch.zeros((4, 2, *block_shape)) for _ in range(2)]
    target_layers = [t[:, kv] for t in targets for kv in (0, 1)]
    scatter_blocks_all_layers(out, target_layers, ids)
    for t, a in zip(targets, allocs, strict=True):
        assert torch.equal(t[ids], a[ids]) and not t[1].any()


@pytest.mark.parametrize("impl", IMPLS)
def test_all_layers_bad_ids_write_nothing(impl: str) -> None:
    layers = [fill((5, 4, 8), torch.float32, seed=40 + i) for i in range(3)]
    before = [c.clone() for c in layers]
    buf = torch.zeros(3, 2, 4, 8)
    for bad in ([5, 0], [-1, 2], torch.tensor([0, 9])):
        with pytest.raises(IndexError):
            gather_blocks_all_layers(layers, bad, impl=impl)
        with pytest.raises(BlockIdError):
            scatter_blocks_all_layers(buf, layers, bad, impl=impl)
    with pytest.raises(DuplicateIdError):
        scatter_blocks_all_layers(buf, layers, [1, 1], impl=impl)
    with pytest.raises(ValueError, match="buffer"):
        scatter_blocks_all_layers(torch.zeros(2, 2, 4, 8), layers, [0, 1], impl=impl)
    for c, b in zip(layers, before, strict=True):
        assert torch.equal(c, b)
    # empty ids: nothing moves, shapes hold
    assert gather_blocks_all_layers(layers, [], impl=impl).shape == (3, 0, 4, 8)
    scatter_blocks_all_layers(torch.zeros(3, 0, 4, 8), layers, [], impl=impl)
    for c, b in zip(layers, before, strict=True):
        assert torch.equal(c, b)


def test_all_layers_out_and_strided_buffer() -> None:
    layers = [fill((6, 3, 16), torch.bfloat16, seed=50 + i) for i in range(3)]
    out = torch.empty(3, 2, 3, 16, dtype=torch.bfloat16)
    assert gather_blocks_all_layers(layers, [5, 1], out) is out
    assert torch.equal(out[2], layers[2][[5, 1]])
    with pytest.raises(KernelShapeError, match="contiguous"):
        gather_blocks_all_layers(layers, [5, 1], torch.empty(2, 3, 3, 16, dtype=torch.bfloat16)
                                 .transpose(0, 1))
    # a buffer whose layer and block axes do not merge (layers innermost) still scatters right
    strided = out.transpose(0, 1).contiguous().transpose(0, 1)
    targets = [torch.zeros_like(c) for c in layers]
    scatter_blocks_all_layers(strided, targets, [5, 1])
    for t, c in zip(targets, layers, strict=True):
        assert torch.equal(t[[5, 1]], c[[5, 1]]) and not t[0].any()

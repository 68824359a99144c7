# SPDX-License-Identifier: Apache-2.0
"""copy_blocks / copy_blocks_all_layers: blocks between two scattered regions, against the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_strategies import IMPLS, fill

from vllm_ascend.distributed.kernels import (
    BlockIdError,
    DuplicateIdError,
    KernelShapeError,
    copy_blocks,
    copy_blocks_all_layers,
    impl_torch,
)

SETTINGS = settings(max_examples=80, deadline=None)
SHAPES = [(2, 4, 8), (4, 1, 24), (3, 5), (8,), (), (2, 2, 16, 4), (16, 1, 576)]


@st.composite
def region_group(draw: st.DrawFn, num: int, shape: tuple[int, ...], dtype: torch.dtype,
                 nb: int) -> list[torch.Tensor]:
    """``num`` regions of ``nb`` blocks or more, laid out as callers hold them."""
    seed = draw(st.integers(0, 2**16))
    kind = draw(st.sampled_from(["separate", "one_buffer", "one_buffer_gaps", "kv_interleaved",
                                 "reversed"]))
    if kind == "one_buffer":  # the offload host pool: layers back to back in one allocation
        return list(fill((num, nb, *shape), dtype, seed).unbind(0))
    if kind == "one_buffer_gaps":  # equally spaced with gaps, blocks strided
        return [v[:nb, 0] for v in fill((num, nb + 1, 2, *shape), dtype, seed).unbind(0)]
    if kind == "reversed":  # one allocation, layers in decreasing address order
        return list(fill((num, nb, *shape), dtype, seed).unbind(0))[::-1]
    if kind == "kv_interleaved":
        a = fill((nb, num, *shape), dtype, seed)
        return [a[:, i] for i in range(num)]
    return [fill((nb + draw(st.integers(0, 2)), *shape), dtype, seed + i) for i in range(num)]


@st.composite
def id_pairs(draw: st.DrawFn, nb_src: int, nb_dst: int) -> tuple[list[int], list[int]]:
    k = draw(st.integers(0, min(nb_src * 2, nb_dst)))
    def ids(nb: int, unique: bool) -> list[int]:
        # a run, sorted runs, or scattered (with repeats where allowed: sources)
        style = draw(st.sampled_from(["run", "runs", "scattered"]))
        if k > nb:  # only sources can have more ids than blocks
            return draw(st.lists(st.integers(0, nb - 1), min_size=k, max_size=k))
        if style == "run":
            first = draw(st.integers(0, nb - k))
            return list(range(first, first + k))
        if style == "runs" or unique:
            perm = draw(st.permutations(range(nb)))
            return sorted(perm[:k]) if style == "runs" else list(perm[:k])
        return draw(st.lists(st.integers(0, nb - 1), min_size=k, max_size=k))

    return ids(nb_src, unique=False), ids(nb_dst, unique=True)


@SETTINGS
@given(data=st.data(), num=st.integers(1, 4), shape=st.sampled_from(SHAPES),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8]),
       nb_src=st.integers(1, 10), nb_dst=st.integers(1, 10))
def test_copy_matches_reference(data: st.DataObject, num: int, shape: tuple[int, ...],
                                dtype: torch.dtype, nb_src: int, nb_dst: int) -> None:
    srcs = data.draw(region_group(num, shape, dtype, nb_src))
    dsts = data.draw(region_group(num, shape, dtype, nb_dst))
    src_ids, dst_ids = data.draw(id_pairs(nb_src, nb_dst))
    before = [s.clone() for s in srcs]
    results = {}
    for impl in (*IMPLS, "torch-runs"):
        targets = [d.clone() for d in dsts]
        # torch-runs: small copies too take the run-by-run path (not the buffer)
        small, impl_torch._SMALL_COPY = impl_torch._SMALL_COPY, (
            0 if impl == "torch-runs" else impl_torch._SMALL_COPY)
        try:
            copy_blocks_all_layers(srcs, src_ids, targets, dst_ids, impl=impl.split("-")[0])
        finally:
            impl_torch._SMALL_COPY = small
        results[impl] = targets
    for runs, got, want, src, dst in zip(results["torch-runs"], results["torch"],
                                         results["reference"], srcs, dsts, strict=True):
        assert torch.equal(got, want) and torch.equal(runs, want)
        expected = dst.clone()
        for s, d in zip(src_ids, dst_ids, strict=True):
            expected[d] = src[s]
        assert torch.equal(got, expected)
    for s, b in zip(srcs, before, strict=True):
        assert torch.equal(s, b)  # sources are never written


@SETTINGS
@given(data=st.data(), shape=st.sampled_from(SHAPES[:4]), nb=st.integers(2, 10))
def test_copy_within_one_region_reads_before_writing(data: st.DataObject, shape: tuple[int, ...],
                                                     nb: int) -> None:
    # source and destination blocks of one cache (a copy-on-write fork, a compaction)
    k = data.draw(st.integers(1, nb))
    src_ids = data.draw(st.lists(st.integers(0, nb - 1), min_size=k, max_size=k))
    dst_ids = data.draw(st.permutations(range(nb)))[:k]
    cache = fill((nb, *shape), torch.float32, seed=k)
    expected = cache.clone()
    for s, d in zip(src_ids, dst_ids, strict=True):
        expected[d] = cache[s]
    for impl in IMPLS:
        target = cache.clone()
        copy_blocks(target, src_ids, target, dst_ids, impl=impl)
        assert torch.equal(target, expected), impl


def test_one_run_moves_every_layer_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # the offload shape: scattered device blocks, a run of host blocks, layers back to back
    monkeypatch.setattr(impl_torch, "_SMALL_COPY", 0)
    dev = [fill((32, 4, 16, 64), torch.float32, seed=i) for i in range(6)]
    host = torch.zeros(6, 20, 4, 16, 64)
    dev_ids, host_ids = [30, 2, 17, 9, 11], [7, 8, 9, 10, 11]
    calls: list[str] = []
    real_index, real_put = torch.ops.aten.index.Tensor_out, torch.Tensor.index_put_

    def index_out(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append("index")
        return real_index(*args, **kwargs)  # type: ignore[no-any-return]

    def put(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append("index_put_")
        return real_put(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(impl_torch.torch.ops.aten.index, "Tensor_out", index_out, raising=False)
    monkeypatch.setattr(torch.Tensor, "index_put_", put)
    copy_blocks_all_layers(dev, dev_ids, list(host.unbind(0)), host_ids)
    back = [torch.zeros_like(d) for d in dev]
    copy_blocks_all_layers(list(host.unbind(0)), host_ids, back, dev_ids)
    monkeypatch.undo()
    assert calls == ["index", "index_put_"]
    # a small copy goes through the buffer instead: two calls that run inline
    seen: list[int] = []
    real = impl_torch._copy_through_buffer
    monkeypatch.setattr(impl_torch, "_copy_through_buffer", lambda *a: (seen.append(1), real(*a)))
    copy_blocks_all_layers(dev[:1], [3], [host[0]], [19])
    assert seen == [1] and torch.equal(host[0, 19], dev[0][3])
    for layer, (d, b) in enumerate(zip(dev, back, strict=True)):
        assert torch.equal(b[dev_ids], d[dev_ids])
        assert torch.equal(host[layer, 7:12], d[dev_ids])


@pytest.mark.parametrize("direction", ["save", "load"])
@pytest.mark.parametrize("layout", ["host_pool", "separate", "kv_parts"])
def test_big_blocks_both_directions(direction: str, layout: str) -> None:
    # 1 MiB blocks (no sub-rows needed by the TensorIterator kernels), several host runs
    block = (2, 131072)
    dev = [fill((6, *block), torch.float32, seed=60 + i) for i in range(2)]
    if layout == "host_pool":
        host = list(torch.zeros(2, 8, *block).unbind(0))
    elif layout == "separate":
        host = [torch.zeros(8, *block) for _ in range(2)]
    else:  # K and V parts of each host block next to each other: not equally spaced layers
        host = [v[:, i] for v in [torch.zeros(8, 2, *block)] for i in range(2)]
    dev_ids, host_ids = [5, 0, 3, 1], [0, 1, 5, 6]
    if direction == "save":
        copy_blocks_all_layers(dev, dev_ids, host, host_ids)
        for d, h in zip(dev, host, strict=True):
            assert torch.equal(h[host_ids], d[dev_ids]) and not h[2].any()
    else:
        for h in host:
            h.copy_(fill(tuple(h.shape), torch.float32, seed=70))
        targets = [torch.zeros_like(d) for d in dev]
        copy_blocks_all_layers(host, host_ids, targets, dev_ids)
        for t, h in zip(targets, host, strict=True):
            assert torch.equal(t[dev_ids], h[host_ids]) and not t[2].any()


def test_scattered_on_both_sides_goes_through_a_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(impl_torch, "_SMALL_COPY", 0)  # not for being small: for its 32 runs
    src = [fill((64, 2, 8), torch.float32, seed=80 + i) for i in range(2)]
    dst = [torch.zeros(64, 2, 8) for _ in range(2)]
    src_ids, dst_ids = list(range(0, 64, 2)), list(range(63, 0, -2))
    seen: list[int] = []
    real = impl_torch._copy_through_buffer

    def spy(*args: object) -> None:
        seen.append(1)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(impl_torch, "_copy_through_buffer", spy)
    copy_blocks_all_layers(src, src_ids, dst, dst_ids)
    assert seen == [1]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[dst_ids], s[src_ids])


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise_and_write_nothing(impl: str) -> None:
    src = [fill((5, 4, 8), torch.float32, seed=90 + i) for i in range(2)]
    dst = [torch.zeros(4, 4, 8) for _ in range(2)]
    with pytest.raises(BlockIdError, match="source block id 5"):
        copy_blocks_all_layers(src, [5], dst, [0], impl=impl)
    with pytest.raises(IndexError, match="destination block id 4"):
        copy_blocks_all_layers(src, [0], dst, [4], impl=impl)
    with pytest.raises(BlockIdError, match="negative"):
        copy_blocks(src[0], [-1], dst[0], [0], impl=impl)
    with pytest.raises(DuplicateIdError):
        copy_blocks_all_layers(src, [0, 1], dst, [2, 2], impl=impl)
    with pytest.raises(KernelShapeError, match="2 source ids but 1"):
        copy_blocks_all_layers(src, [0, 1], dst, [2], impl=impl)
    with pytest.raises(ValueError, match="destinations"):
        copy_blocks_all_layers(src, [0], dst[:1], [0], impl=impl)
    with pytest.raises(KernelShapeError, match="destination blocks"):
        copy_blocks(src[0], [0], torch.zeros(4, 4, 4), [0], impl=impl)
    with pytest.raises(KernelShapeError, match="destination blocks"):
        copy_blocks(src[0], [0], torch.zeros(4, 4, 8, dtype=torch.float16), [0], impl=impl)
    assert all(not d.any() for d in dst)
    copy_blocks_all_layers(src, [], dst, [], impl=impl)  # empty: nothing to do
    copy_blocks(src[0], torch.tensor([], dtype=torch.int32), dst[0], [], impl=impl)
    assert all(not d.any() for d in dst)


def test_mla_layout_and_int_tensor_ids() -> None:
    # MLA: (blocks, block_size, 1, rank), one region a layer; ids as int32 tensors
    src = [fill((9, 16, 1, 576), torch.bfloat16, seed=100 + i) for i in range(3)]
    host = list(torch.zeros(3, 9, 16, 1, 576, dtype=torch.bfloat16).unbind(0))
    sid, did = torch.tensor([8, 3, 4], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    copy_blocks_all_layers(src, sid, host, did)
    for s, h in zip(src, host, strict=True):
        assert torch.equal(h[:3], s[[8, 3, 4]])

# SPDX-License-Identifier: Apache-2.0
"""Paged-cache load and reshape-and-cache: implementations against the reference and an oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_strategies import DTYPES, IMPLS, fill

from vllm_ascend.distributed.kernels import (
    BlockIdError,
    DuplicateIdError,
    KernelShapeError,
    load_tokens,
    paged_cache_load,
    reshape_and_cache,
    store_tokens,
)

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def paged(draw: st.DrawFn) -> dict:
    """A cache (either token axis), and a batch of sequences over its blocks."""
    token_axis = draw(st.sampled_from([0, 1]))
    bs = draw(st.integers(1, 5))
    heads, hd = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    nb = draw(st.integers(1, 8))
    block_shape = (bs, heads, hd) if token_axis == 0 else (heads, bs, hd)
    dtype = draw(st.sampled_from(DTYPES))
    cols = draw(st.integers(1, 4))
    batch = draw(st.integers(0, 4))
    table, lens, starts = [], [], []
    for _ in range(batch):
        start = draw(st.integers(0, cols * bs - 1))
        length = draw(st.integers(0, cols * bs - start))
        used = (start + length - 1) // bs + 1 if length else 0
        row = [draw(st.integers(0, nb - 1)) for _ in range(used)] + [-1] * (cols - used)
        table.append(row)
        lens.append(length)
        starts.append(start)
    return {"cache": fill((nb, *block_shape), dtype, seed=draw(st.integers(0, 999))),
            "table": table, "lens": lens, "starts": starts, "axis": token_axis, "bs": bs}


def _table(case: dict, dtype: torch.dtype) -> torch.Tensor:
    if not case["table"]:
        return torch.zeros(0, 3, dtype=dtype)
    return torch.tensor(case["table"], dtype=dtype)


def oracle_rows(cache: torch.Tensor, case: dict) -> torch.Tensor:
    rows = []
    for row, n, s in zip(case["table"], case["lens"], case["starts"], strict=True):
        for pos in range(s, s + n):
            rows.append(cache[row[pos // case["bs"]]].select(case["axis"], pos % case["bs"]))
    shape = list(cache.shape[1:])
    del shape[case["axis"]]
    return torch.stack(rows) if rows else torch.empty(0, *shape, dtype=cache.dtype)


@SETTINGS
@given(case=paged(), as_tensors=st.booleans())
def test_load_tokens(case: dict, as_tensors: bool) -> None:
    cache = case["cache"]
    table = _table(case, torch.int32) if as_tensors else case["table"]
    expected = oracle_rows(cache, case)
    for impl in IMPLS:
        got = load_tokens(cache, table, case["lens"], case["starts"], token_axis=case["axis"],
                          impl=impl)
        assert torch.equal(got, expected), impl


@SETTINGS
@given(case=paged())
def test_paged_cache_load_k_and_v(case: dict) -> None:
    k = case["cache"]
    v = (k.float() * 2 + 1).to(k.dtype)
    table = _table(case, torch.int64)
    for impl in IMPLS:
        key, value = paged_cache_load(k, v, table, case["lens"], case["starts"],
                                      token_axis=case["axis"], impl=impl)
        assert torch.equal(key, oracle_rows(k, case)), impl
        assert torch.equal(value, oracle_rows(v, case)), impl


@st.composite
def stores(draw: st.DrawFn) -> dict:
    token_axis = draw(st.sampled_from([0, 1]))
    bs, heads, hd, nb = (draw(st.integers(1, 4)) for _ in range(4))
    block_shape = (bs, heads, hd) if token_axis == 0 else (heads, bs, hd)
    dtype = draw(st.sampled_from(DTYPES))
    slots = draw(st.lists(st.integers(0, nb * bs - 1), unique=True, max_size=nb * bs))
    pads = draw(st.lists(st.integers(0, len(slots)), max_size=3))
    for p in pads:
        slots.insert(p, -1)
    row_shape = (heads, hd)
    return {"cache": fill((nb, *block_shape), dtype, seed=draw(st.integers(0, 999))),
            "slots": slots, "axis": token_axis, "bs": bs,
            "rows": fill((len(slots), *row_shape), dtype, seed=draw(st.integers(0, 999)))}


def oracle_store(cache: torch.Tensor, rows: torch.Tensor, case: dict) -> torch.Tensor:
    out = cache.clone()
    for i, slot in enumerate(case["slots"]):
        if slot >= 0:
            out[slot // case["bs"]].select(case["axis"], slot % case["bs"]).copy_(rows[i])
    return out


@SETTINGS
@given(case=stores(), as_tensor=st.booleans())
def test_store_tokens(case: dict, as_tensor: bool) -> None:
    slots = torch.tensor(case["slots"], dtype=torch.int64) if as_tensor else case["slots"]
    expected = oracle_store(case["cache"], case["rows"], case)
    for impl in IMPLS:
        target = case["cache"].clone()
        store_tokens(case["rows"], target, slots, token_axis=case["axis"], impl=impl)
        assert torch.equal(target, expected), impl


@SETTINGS
@given(case=stores())
def test_reshape_and_cache_k_and_v(case: dict) -> None:
    k_rows = case["rows"]
    v_rows = (k_rows.float() - 3).to(k_rows.dtype)
    for impl in IMPLS:
        kc, vc = case["cache"].clone(), torch.zeros_like(case["cache"])
        reshape_and_cache(k_rows, v_rows, kc, vc, case["slots"], token_axis=case["axis"],
                          impl=impl)
        assert torch.equal(kc, oracle_store(case["cache"], k_rows, case)), impl
        assert torch.equal(vc, oracle_store(torch.zeros_like(case["cache"]), v_rows, case)), impl


def test_mla_k_and_v_of_different_head_sizes() -> None:
    nope = fill((6, 4, 1, 16), torch.float16, seed=1)
    rope = fill((6, 4, 1, 4), torch.float16, seed=2)
    key, value = paged_cache_load(nope, rope, [[5, 2]], [6], [0])
    assert key.shape == (6, 1, 16) and value.shape == (6, 1, 4)
    assert torch.equal(key[4], nope[2, 0]) and torch.equal(value[5], rope[2, 1])
    kc, vc = torch.zeros_like(nope), torch.zeros_like(rope)
    reshape_and_cache(key, value, kc, vc, [20, 21, 22, 23, 8, 9])
    assert torch.equal(kc[5], nope[5]) and torch.equal(vc[2, :2], rope[2, :2])


def test_load_errors() -> None:
    cache = fill((4, 2, 3), torch.float32, seed=3)  # 4 blocks of 2 tokens
    with pytest.raises(BlockIdError, match="column 2"):
        load_tokens(cache, [[0, 1]], [5])
    with pytest.raises(BlockIdError, match="block id .* 4 out of range"):
        load_tokens(cache, [[0, 4]], [3])
    with pytest.raises(BlockIdError, match="negative"):
        load_tokens(cache, [[-1, 2]], [2], [0])
    load_tokens(cache, [[1, -1]], [2])  # padding past the used columns is fine
    with pytest.raises(KernelShapeError, match="2-D"):
        load_tokens(cache, [0, 1], [2])
    with pytest.raises(KernelShapeError, match="seq_lens has 2"):
        load_tokens(cache, [[0]], [1, 1])
    with pytest.raises(KernelShapeError, match="negative sequence length"):
        load_tokens(cache, [[0]], [-1])
    with pytest.raises(KernelShapeError, match="token_axis=2"):
        load_tokens(cache, [[0]], [1], token_axis=2)
    with pytest.raises(KernelShapeError, match="integers"):
        load_tokens(cache, torch.tensor([[0.0]]), [1])
    with pytest.raises(KernelShapeError, match="block axis and a token axis"):
        load_tokens(torch.zeros(3), [[0]], [1])
    with pytest.raises(KernelShapeError, match="value_cache"):
        paged_cache_load(cache, torch.zeros(5, 2, 3), [[0]], [1])


def test_store_errors_write_nothing() -> None:
    cache = torch.zeros(3, 2, 4)  # 6 slots
    with pytest.raises(BlockIdError, match="slot 6"):
        store_tokens(torch.ones(2, 4), cache, [0, 6])
    with pytest.raises(DuplicateIdError, match="slot 1"):
        store_tokens(torch.ones(3, 4), cache, [1, -1, 1])
    with pytest.raises(KernelShapeError, match="3 entries for 2"):
        store_tokens(torch.ones(2, 4), cache, [0, 1, 2])
    with pytest.raises(KernelShapeError, match="rows has shape"):
        store_tokens(torch.ones(2, 5), cache, [0, 1])
    with pytest.raises(KernelShapeError, match="rows is torch.float16"):
        store_tokens(torch.ones(2, 4, dtype=torch.float16), cache, [0, 1])
    with pytest.raises(BlockIdError):
        reshape_and_cache(torch.ones(1, 4), torch.ones(1, 4), cache, cache.clone(), [99])
    assert not cache.any()

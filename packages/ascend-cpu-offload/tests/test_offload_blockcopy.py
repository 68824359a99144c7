# SPDX-License-Identifier: Apache-2.0
"""Block copies against plain torch indexing, on every KV layout the layout module knows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.core.layout import KVCacheLayout
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.blockcopy import (
    _copy_staged,
    _host_runs,
    block_rows,
    copy_blocks,
    copy_blocks_all,
    runs,
)


def test_runs_split_where_either_side_jumps() -> None:
    assert runs([], []) == []
    assert runs([3, 4, 5, 9], [0, 1, 2, 3]) == [(3, 0, 3), (9, 3, 1)]
    assert runs([1, 2, 3], [5, 6, 8]) == [(1, 5, 2), (3, 8, 1)]
    assert runs([2, 1], [0, 1]) == [(2, 0, 1), (1, 1, 1)]
    assert _host_runs([4, 5, 6, 1, 2, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1)]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n_src=st.integers(1, 12), n_dst=st.integers(1, 12),
       row=st.integers(1, 96), pad=st.integers(0, 16),
       path=st.sampled_from(["kernels", "memmove", "runs", "staged-gather", "staged-scatter"]))
def test_copy_matches_reference(data: st.DataObject, n_src: int, n_dst: int, row: int, pad: int,
                                path: str) -> None:
    # strided rows (pad > 0) are what a host layer slice looks like
    src_full = torch.randint(0, 256, (n_src, row + pad), dtype=torch.uint8)
    dst_full = torch.randint(0, 256, (n_dst, row + pad), dtype=torch.uint8)
    src, dst = src_full[:, :row], dst_full[:, pad:pad + row]
    k = data.draw(st.integers(0, min(n_src, n_dst)))
    src_ids = data.draw(st.lists(st.integers(0, n_src - 1), min_size=k, max_size=k))
    dst_ids = data.draw(st.lists(st.integers(0, n_dst - 1), min_size=k, max_size=k, unique=True))
    expected = dst_full.clone()
    expected_view = expected[:, pad:pad + row]
    for s, d in zip(src_ids, dst_ids, strict=True):
        expected_view[d] = src[s]
    if path.startswith("staged"):
        # both branches of the device path, run by ascend-kernels' CPU implementation
        _copy_staged(src, src_ids, dst, dst_ids, row, False,
                     gather_on_src=path == "staged-gather")
        n = row * k
    else:
        n = copy_blocks(src, src_ids, dst, dst_ids, path=path)
    assert n == row * k
    assert torch.equal(dst_full, expected), "only the destination rows change, padding intact"


@pytest.mark.parametrize("path", ["kernels", "memmove", "runs", "staged"])
def test_bad_ids_raise_before_any_copy(path: str) -> None:
    src = torch.arange(40, dtype=torch.uint8).view(4, 10)
    dst = torch.zeros(3, 10, dtype=torch.uint8)
    for s, d, needle in (([0, 4], [0, 1], "source: block id 4 is outside [0, 4)"),
                         ([0, 1], [0, -1], "destination: block id -1 is outside [0, 3)"),
                         ([True], [0], "block id True")):
        with pytest.raises(IndexError, match=needle.replace("[", r"\[").replace(")", r"\)")):
            copy_blocks(src, s, dst, d, path=path)
        assert not dst.any(), "nothing was written"
    with pytest.raises(ValueError, match="2 source ids but 1 destination ids"):
        copy_blocks(src, [0, 1], dst, [0])
    with pytest.raises(ValueError, match="source blocks hold 10 bytes, destination blocks 5"):
        copy_blocks(src, [0], torch.zeros(3, 5, dtype=torch.uint8), [0])
    with pytest.raises(ValueError, match="uint8 view"):
        copy_blocks(src.float(), [0], dst, [0])
    with pytest.raises(ValueError, match="unknown copy path 'dma'"):
        copy_blocks(src, [0], dst, [0], path="dma")


def _kv_caches(kind: str, num_blocks: int = 6, bs: int = 32) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    if kind == "cpu":  # vLLM CPU backend: (blocks, heads, block_size, 2 * head_size)
        return {f"model.layers.{i}.attn": torch.randn(num_blocks, 2, bs, 16, generator=g)
                for i in range(2)}
    if kind == "npu":  # separate K and V
        return {f"model.layers.{i}.attn": (torch.randn(num_blocks, bs, 2, 8, generator=g),
                                           torch.randn(num_blocks, bs, 2, 8, generator=g))
                for i in range(2)}
    if kind == "stacked":  # (2, blocks, block_size, heads, head_size): strided K and V views
        return {f"model.layers.{i}.attn": torch.randn(2, num_blocks, bs, 2, 8, generator=g)
                for i in range(2)}
    if kind == "mla":  # (k_nope, k_rope)
        return {f"model.layers.{i}.attn": (torch.randn(num_blocks, bs, 1, 24, generator=g),
                                           torch.randn(num_blocks, bs, 1, 8, generator=g))
                for i in range(2)}
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["cpu", "npu", "stacked", "mla"])
def test_round_trip_through_host_rows_on_every_layout(kind: str) -> None:
    caches = _kv_caches(kind)
    layout = KVCacheLayout.from_kv_caches(caches, block_size=32)
    assert layout.is_mla == (kind == "mla")
    rows = [block_rows(r.tensor) for r in layout.regions]
    host = [torch.zeros(8, r.shape[1], dtype=torch.uint8) for r in rows]
    before = [r.tensor.clone() for r in layout.regions]
    for r, h in zip(rows, host, strict=True):
        copy_blocks(r, [1, 2, 5], h, [7, 0, 3])
    for r in layout.regions:
        r.tensor.zero_()
    for r, h in zip(rows, host, strict=True):
        copy_blocks(h, [7, 0, 3], r, [0, 4, 2])
    for r, b in zip(layout.regions, before, strict=True):
        assert torch.equal(r.tensor[0], b[1]) and torch.equal(r.tensor[4], b[2])
        assert torch.equal(r.tensor[2], b[5])
        assert not r.tensor[1].any() and not r.tensor[3].any()


def test_block_rows_refuses_non_contiguous_blocks() -> None:
    t = torch.zeros(4, 8, 6).transpose(1, 2)
    with pytest.raises(ValueError, match="not contiguous"):
        block_rows(t)


@pytest.mark.parametrize("threads", ["1", "3"])
@pytest.mark.parametrize("strided", [False, True])
def test_large_batches_split_across_threads_match_reference(
        monkeypatch: pytest.MonkeyPatch, threads: str, strided: bool) -> None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.blockcopy import (
        COPY_THREADS_ENV,
        PARALLEL_MIN_BYTES,
    )

    monkeypatch.setenv(COPY_THREADS_ENV, threads)
    row = 96 << 10
    n = PARALLEL_MIN_BYTES // row * 3  # well over the threshold
    src = torch.randint(0, 256, (2 * n, row + (64 if strided else 0)), dtype=torch.uint8)
    dst_full = torch.zeros(n + 5, row + (64 if strided else 0), dtype=torch.uint8)
    src_v, dst_v = src[:, :row], dst_full[:, :row]
    g = torch.Generator().manual_seed(1)
    src_ids = torch.randperm(2 * n, generator=g)[:n].tolist()
    # one long run (cut into pieces) and a scattered tail
    dst_ids = list(range(n - 7)) + [n + 4, n + 2, n, n - 3, n - 5, n + 1, n - 1]
    assert copy_blocks(src_v, src_ids, dst_v, dst_ids, path="memmove") == row * n
    expected = torch.zeros_like(dst_full)
    expected[dst_ids, :row] = src[src_ids, :row]
    assert torch.equal(dst_full, expected)


def test_bad_thread_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.blockcopy import (
        COPY_THREADS_ENV,
        copy_threads,
    )

    monkeypatch.setenv(COPY_THREADS_ENV, "lots")
    with pytest.raises(ValueError, match="VLLM_ASCEND_KV_COPY_THREADS='lots'"):
        copy_threads()


@settings(max_examples=60, deadline=None)
@given(data=st.data(), layers=st.integers(1, 4), rows=st.lists(st.integers(1, 80), min_size=1,
                                                              max_size=3),
       n_dev=st.integers(1, 12), n_host=st.integers(1, 12),
       path=st.sampled_from(["auto", "kernels", "memmove", "runs", "staged"]))
def test_copy_all_layers_matches_reference(data: st.DataObject, layers: int, rows: list[int],
                                           n_dev: int, n_host: int, path: str) -> None:
    # the worker's shape: region kinds of several row lengths, host rows of one pool
    # (layer-major, regions side by side in a host row), device regions apart
    layer_bytes = sum(rows)
    pool = torch.randint(0, 256, (layers, n_host, layer_bytes), dtype=torch.uint8)
    host, dev = [], []
    for layer in range(layers):
        off = 0
        for length in rows:
            host.append(pool[layer, :, off:off + length])
            dev.append(torch.randint(0, 256, (n_dev, length), dtype=torch.uint8))
            off += length
    k = data.draw(st.integers(0, min(n_dev, n_host)))
    dev_ids = data.draw(st.lists(st.integers(0, n_dev - 1), min_size=k, max_size=k, unique=True))
    host_ids = data.draw(st.one_of(
        st.lists(st.integers(0, n_host - 1), min_size=k, max_size=k, unique=True),
        st.integers(0, n_host - k).map(lambda f: list(range(f, f + k)))))
    expected_pool = pool.clone()
    for i, layer in enumerate(range(layers)):
        off = 0
        for r, length in enumerate(rows):
            for d, h in zip(dev_ids, host_ids, strict=True):
                expected_pool[layer, h, off:off + length] = dev[i * len(rows) + r][d]
            off += length
    # save, then load back into zeroed device regions
    assert copy_blocks_all(dev, dev_ids, host, host_ids, path=path) == layer_bytes * layers * k
    assert torch.equal(pool, expected_pool)
    expected_dev = [d.clone() for d in dev]
    for d in dev:
        d[dev_ids] = 0
    assert copy_blocks_all(host, host_ids, dev, dev_ids, path=path) == layer_bytes * layers * k
    for got, want in zip(dev, expected_dev, strict=True):
        assert torch.equal(got, want)


def test_copy_all_layers_checks_before_copying() -> None:
    src = [torch.ones(4, 8, dtype=torch.uint8) for _ in range(2)]
    dst = [torch.zeros(3, 8, dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(IndexError, match=r"source: block id 4 is outside \[0, 4\)"):
        copy_blocks_all(src, [4], dst, [0])
    with pytest.raises(IndexError, match="destination: block id 3"):
        copy_blocks_all(src, [0], dst, [3])
    with pytest.raises(ValueError, match="appears more than once"):
        copy_blocks_all(src, [0, 1], dst, [2, 2])
    with pytest.raises(ValueError, match="2 source views but 1 destination views"):
        copy_blocks_all(src, [0], dst[:1], [0])
    with pytest.raises(ValueError, match="2 source ids but 1 destination ids"):
        copy_blocks_all(src, [0, 1], dst, [0])
    with pytest.raises(ValueError, match="source blocks hold 8 bytes, destination blocks 4"):
        copy_blocks_all(src, [0], [dst[0], torch.zeros(3, 4, dtype=torch.uint8)], [0])
    with pytest.raises(ValueError, match="uint8 view"):
        copy_blocks_all([src[0].float()], [0], dst[:1], [0])
    assert not any(d.any() for d in dst)
    assert copy_blocks_all(src, [], dst, []) == 0
    assert copy_blocks_all([], [], [], []) == 0

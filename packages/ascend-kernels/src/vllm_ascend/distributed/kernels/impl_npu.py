# SPDX-License-Identifier: Apache-2.0
"""NPU implementations: the ``torch_npu`` operators, imported on first use.

* paged-cache load: ``torch_npu.atb.npu_paged_cache_load``;
* reshape-and-cache: ``torch_npu._npu_reshape_and_cache`` (K and V of the same
  block shape) or ``torch_npu.npu_scatter_pa_kv_cache`` (K and V of different
  head sizes, as MLA's latent and rope parts);
* transpose by block: vLLM-Ascend's fused ``torch.ops._C_ascend.
  transpose_kv_cache_by_block`` when its custom ops are loaded, otherwise
  upstream's composed path (paged-cache load, transpose, reshape-and-cache);
* gather/scatter of whole blocks: the device's ``index_select`` /
  ``index_copy_`` (one kernel launch each).

These operators need the NPU layout: tokens on axis 0 of the block shape,
``(block_size, kv_heads, head_size)``. Calls outside what an operator supports
(another token axis, sequence starts not aligned to blocks, another head axis)
run the vectorised torch implementation instead, which is correct on any device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from . import impl_torch
from .errors import NpuUnavailableError
from .heads import head_part_shape
from .validation import TokenIndex

logger = logging.getLogger(__name__)


def torch_npu() -> ModuleType:
    """``import torch_npu``, or an error naming the extra to install."""
    try:
        import torch_npu as mod
    except ImportError as exc:
        raise NpuUnavailableError(
            "the NPU kernels need torch_npu (and the CANN toolkit): "
            f"pip install 'ascend-kernels[npu]' ({exc})") from exc
    return mod


def fused_transpose_op() -> Callable[..., Any] | None:
    """vLLM-Ascend's ``transpose_kv_cache_by_block`` custom op, if loaded."""
    try:
        return torch.ops._C_ascend.transpose_kv_cache_by_block  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):
        return None


def gather(cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if ids.numel():
        torch.index_select(cache, 0, ids, out=out)
    return out


def scatter(buf: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor) -> None:
    if ids.numel():
        cache.index_copy_(0, ids, buf)


def gather_layers(caches: Sequence[torch.Tensor], ids: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    for layer, cache in enumerate(caches):
        gather(cache, ids, out[layer])
    return out


def scatter_layers(buf: torch.Tensor, caches: Sequence[torch.Tensor], ids: torch.Tensor) -> None:
    for layer, cache in enumerate(caches):
        scatter(buf[layer], cache, ids)


def copy_layers(srcs: Sequence[torch.Tensor], src_ids: torch.Tensor,
                dsts: Sequence[torch.Tensor], dst_ids: torch.Tensor) -> None:
    # two launches a layer (a gather, a scatter)
    if not src_ids.numel():
        return
    shared = ({s.untyped_storage().data_ptr() for s in srcs}
              & {d.untyped_storage().data_ptr() for d in dsts})
    if shared:  # every source block is read before the first write
        picked = [src.index_select(0, src_ids) for src in srcs]
        for blocks, dst in zip(picked, dsts, strict=True):
            dst.index_copy_(0, dst_ids, blocks)
        return
    for src, dst in zip(srcs, dsts, strict=True):
        dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32)


def paged_cache_load(key_cache: torch.Tensor, value_cache: torch.Tensor, tix: TokenIndex,
                     token_axis: int, key: torch.Tensor, value: torch.Tensor) -> None:
    block_size = key_cache.shape[1 + token_axis]
    aligned = not bool((tix.seq_starts % block_size).any()) if tix.seq_starts.numel() else True
    if token_axis != 0 or not aligned:
        logger.debug("paged_cache_load: token_axis=%s aligned=%s, using the torch path",
                     token_axis, aligned)
        impl_torch.load_tokens(key_cache, tix, token_axis, key)
        impl_torch.load_tokens(value_cache, tix, token_axis, value)
        return
    if not tix.num_tokens:
        return
    torch_npu().atb.npu_paged_cache_load(
        key_cache, value_cache, _i32(tix.block_table), _i32(tix.seq_lens),
        seq_starts=_i32(tix.seq_starts), key=key, value=value)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, row_idx: torch.Tensor, block: torch.Tensor,
                      offset: torch.Tensor, token_axis: int) -> None:
    if token_axis != 0:
        logger.debug("reshape_and_cache: token_axis=%s, using the torch path", token_axis)
        impl_torch.store_tokens(key, key_cache, row_idx, block, offset, token_axis)
        impl_torch.store_tokens(value, value_cache, row_idx, block, offset, token_axis)
        return
    if not row_idx.numel():
        return
    if row_idx.numel() != key.shape[0]:  # padding rows (negative slots) are dropped first
        key, value = key.index_select(0, row_idx), value.index_select(0, row_idx)
    slots = _i32(block * key_cache.shape[1] + offset)
    npu = torch_npu()
    if key_cache.shape[1:] == value_cache.shape[1:]:
        npu._npu_reshape_and_cache(key=key, value=value, key_cache=key_cache,
                                   value_cache=value_cache, slot_indices=slots)
    else:
        npu.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slots)


def transpose_blocks(caches: Sequence[torch.Tensor], ids: torch.Tensor, num_parts: int,
                     head_axis: int, inverse: bool) -> None:
    if not ids.numel() or num_parts == 1:
        return
    npu_layout = head_axis == 1 and all(c.dim() == 4 for c in caches)
    if not npu_layout:
        logger.debug("transpose_kv_by_block: head_axis=%s, using the torch path", head_axis)
        for c in caches:
            impl_torch.transpose_blocks(c, ids, num_parts, head_axis, inverse)
        return
    op = fused_transpose_op() if not inverse else None
    same = all(c.shape[1:] == caches[0].shape[1:] for c in caches)
    if op is not None and same and len(caches) % 2 == 0:
        half = len(caches) // 2
        _, block_size, heads, head_dim = caches[0].shape
        op(list(caches[:half]), list(caches[half:]), ids, block_size, heads, head_dim,
           num_parts, half)
        return
    # Upstream's composed path: load the blocks' tokens, reorder heads, write them back.
    pairs = [(caches[i], caches[i + 1] if i + 1 < len(caches) else caches[i])
             for i in range(0, len(caches), 2)]
    for k_cache, v_cache in pairs:
        _transpose_pair(k_cache, v_cache, ids, num_parts, inverse)


def _transpose_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, ids: torch.Tensor,
                    num_parts: int, inverse: bool) -> None:
    n, block_size = ids.numel(), k_cache.shape[1]
    tokens = n * block_size
    table = ids.view(1, -1)
    lens = torch.tensor([tokens], dtype=torch.int64, device=ids.device)
    starts = torch.zeros(1, dtype=torch.int64, device=ids.device)
    offs = torch.arange(block_size, device=ids.device).repeat(n)
    blocks = ids.repeat_interleave(block_size)
    tix = TokenIndex(blocks, offs, table, lens, starts)
    bufs = []
    for cache in (k_cache, v_cache):
        head_part_shape(cache.shape[1:], num_parts, 1, op="transpose_kv_by_block")
        bufs.append(torch.empty((tokens, *cache.shape[2:]), dtype=cache.dtype,
                                device=cache.device))
    paged_cache_load(k_cache, v_cache, tix, 0, bufs[0], bufs[1])
    out = []
    for buf, cache in zip(bufs, (k_cache, v_cache), strict=True):
        heads = cache.shape[2]
        if inverse:
            t = buf.view(n, block_size, num_parts, -1).transpose(1, 2)
        else:
            t = buf.view(n, num_parts, block_size, -1).transpose(1, 2)
        out.append(t.contiguous().view(tokens, heads, -1))
    reshape_and_cache(out[0], out[1], k_cache, v_cache, torch.arange(tokens, device=ids.device),
                      blocks, offs, 0)

# SPDX-License-Identifier: Apache-2.0
"""The KV block operations: validate once, then run the chosen implementation.

Tensors are KV-cache *regions*: dim 0 indexes blocks, ``(num_blocks,
*block_shape)``. Examples: vLLM's CPU cache, one tensor a layer,
``(num_blocks, kv_heads, block_size, 2*head_size)`` (heads on axis 0 of the
block shape, tokens on axis 1); the NPU cache, a K and a V tensor a layer,
``(num_blocks, block_size, kv_heads, head_size)`` (tokens on axis 0, heads on
axis 1); MLA, ``(num_blocks, block_size, 1, rank)`` (no heads to split).

Every function takes ``impl`` (see :mod:`.dispatch`): ``None``/``"auto"``
picks the device's fast path, ``"reference"`` the plain one.

Bad input never wraps around or half-applies: block ids and slots are checked
before anything is written (:class:`~.errors.BlockIdError` is an
``IndexError``; shape, dtype and device mismatches raise
:class:`~.errors.KernelShapeError`, a ``ValueError``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType

import torch

from . import impl_reference, impl_torch
from .dispatch import Impl, resolve_impl
from .errors import KernelShapeError
from .heads import head_part_shape
from .validation import (
    BlockIds,
    as_block_ids,
    check_axis,
    check_buffer,
    check_cache,
    check_caches,
    slot_index,
    token_index,
)

logger = logging.getLogger(__name__)


def _module(impl: Impl) -> ModuleType:
    if impl is Impl.REFERENCE:
        return impl_reference
    if impl is Impl.TORCH:
        return impl_torch
    from . import impl_npu

    impl_npu.torch_npu()  # a clear error now rather than an AttributeError later
    return impl_npu


# ---------------------------------------------------------------- whole blocks
def gather_blocks(cache: torch.Tensor, block_ids: BlockIds, out: torch.Tensor | None = None,
                  *, impl: str | Impl | None = None) -> torch.Tensor:
    """Copy blocks ``block_ids`` of one cache region into a contiguous buffer.

    Args:
        cache: ``(num_blocks, *block_shape)``.
        block_ids: Ids in ``[0, num_blocks)``, any order, repeats allowed.
        out: Optional contiguous ``(len(block_ids), *block_shape)`` destination.
        impl: Implementation override.

    Returns:
        ``out`` (or a new tensor) holding block ``block_ids[j]`` at row ``j``.
    """
    op = "gather_blocks"
    cache = check_cache(cache, op=op)
    ids = as_block_ids(block_ids, cache.shape[0], cache.device, op=op)
    shape = (ids.numel(), *cache.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    else:
        check_buffer(out, shape, cache.dtype, cache.device, op=op, name="out", contiguous=True)
    return _module(resolve_impl(cache.device, impl)).gather(cache, ids, out)  # type: ignore[no-any-return]


def scatter_blocks(buffer: torch.Tensor, cache: torch.Tensor, block_ids: BlockIds, *,
                   impl: str | Impl | None = None) -> None:
    """Write row ``j`` of ``buffer`` into block ``block_ids[j]`` of ``cache``.

    Args:
        buffer: ``(len(block_ids), *block_shape)``.
        cache: ``(num_blocks, *block_shape)``, written in place.
        block_ids: Distinct ids in ``[0, num_blocks)``.
        impl: Implementation override.

    Raises:
        DuplicateIdError: An id appears twice (which write wins would be undefined).
    """
    op = "scatter_blocks"
    cache = check_cache(cache, op=op)
    ids = as_block_ids(block_ids, cache.shape[0], cache.device, op=op, unique=True)
    check_buffer(buffer, (ids.numel(), *cache.shape[1:]), cache.dtype, cache.device, op=op,
                 name="buffer")
    _module(resolve_impl(cache.device, impl)).scatter(buffer, cache, ids)


def gather_blocks_all_layers(caches: Sequence[torch.Tensor], block_ids: BlockIds,
                             out: torch.Tensor | None = None, *,
                             impl: str | Impl | None = None) -> torch.Tensor:
    """Gather the same blocks of every layer: ``out[l, j] = caches[l][block_ids[j]]``.

    Args:
        caches: One region a layer (pass K and V regions as separate entries),
            all of one block shape, dtype and device.
        block_ids: Ids valid in every cache.
        out: Optional contiguous ``(len(caches), len(block_ids), *block_shape)``.
        impl: Implementation override.
    """
    op = "gather_blocks_all_layers"
    group = check_caches(caches, op=op)
    ids = as_block_ids(block_ids, group.num_blocks, group.device, op=op)
    shape = (len(caches), ids.numel(), *group.block_shape)
    if out is None:
        out = torch.empty(shape, dtype=group.dtype, device=group.device)
    else:
        check_buffer(out, shape, group.dtype, group.device, op=op, name="out", contiguous=True)
    return _module(resolve_impl(group.device, impl)).gather_layers(caches, ids, out)  # type: ignore[no-any-return]


def scatter_blocks_all_layers(buffer: torch.Tensor, caches: Sequence[torch.Tensor],
                              block_ids: BlockIds, *, impl: str | Impl | None = None) -> None:
    """Write ``buffer[l, j]`` into block ``block_ids[j]`` of ``caches[l]``, every layer."""
    op = "scatter_blocks_all_layers"
    group = check_caches(caches, op=op)
    ids = as_block_ids(block_ids, group.num_blocks, group.device, op=op, unique=True)
    check_buffer(buffer, (len(caches), ids.numel(), *group.block_shape), group.dtype,
                 group.device, op=op, name="buffer")
    _module(resolve_impl(group.device, impl)).scatter_layers(buffer, caches, ids)


def copy_blocks(src: torch.Tensor, src_ids: BlockIds, dst: torch.Tensor, dst_ids: BlockIds, *,
                impl: str | Impl | None = None) -> None:
    """Copy block ``src_ids[i]`` of ``src`` into block ``dst_ids[i]`` of ``dst``.

    Both sides may be scattered (the CPU offload's device cache and host pool).
    Every source block is read before any destination block is written.

    Args:
        src: ``(num_blocks, *block_shape)``.
        src_ids: Ids in ``[0, src.shape[0])``, repeats allowed.
        dst: ``(num_blocks', *block_shape)``, same dtype and device, written in place.
        dst_ids: Distinct ids in ``[0, dst.shape[0])``, as many as ``src_ids``.
        impl: Implementation override.
    """
    copy_blocks_all_layers([src], src_ids, [dst], dst_ids, impl=impl)


def copy_blocks_all_layers(srcs: Sequence[torch.Tensor], src_ids: BlockIds,
                           dsts: Sequence[torch.Tensor], dst_ids: BlockIds, *,
                           impl: str | Impl | None = None) -> None:
    """``dsts[l][dst_ids[i]] = srcs[l][src_ids[i]]`` for every layer ``l``.

    On CPU: one call per run of consecutive ids of one side (all layers in it),
    so blocks move at memcpy speed in few parallel regions; see
    :func:`.impl_torch.copy_layers`.

    Args:
        srcs: One region a layer, all of one block shape, dtype and device.
        src_ids: Ids valid in every source region, repeats allowed.
        dsts: As many regions, of the sources' block shape, dtype and device.
        dst_ids: Distinct ids valid in every destination region, as many as ``src_ids``.
        impl: Implementation override.

    Raises:
        BlockIdError: An id is out of range (nothing is written).
        DuplicateIdError: A destination id appears twice.
        KernelShapeError: Regions that differ, or id lists of different lengths.
    """
    op = "copy_blocks"
    sg = check_caches(srcs, op=op)
    dg = check_caches(dsts, op=op)
    if len(srcs) != len(dsts):
        raise KernelShapeError(f"{op}: {len(srcs)} source regions but {len(dsts)} destinations")
    if (sg.block_shape, sg.dtype, sg.device) != (dg.block_shape, dg.dtype, dg.device):
        raise KernelShapeError(
            f"{op}: source blocks are {sg.block_shape} {sg.dtype} on {sg.device}, destination "
            f"blocks {dg.block_shape} {dg.dtype} on {dg.device}")
    sids = as_block_ids(src_ids, sg.num_blocks, sg.device, op=op, what="source block id")
    dids = as_block_ids(dst_ids, dg.num_blocks, dg.device, op=op, what="destination block id",
                        unique=True)
    if sids.numel() != dids.numel():
        raise KernelShapeError(
            f"{op}: {sids.numel()} source ids but {dids.numel()} destination ids")
    _module(resolve_impl(sg.device, impl)).copy_layers(srcs, sids, dsts, dids)


# ---------------------------------------------------------------- tokens
def _row_shape(cache: torch.Tensor, token_axis: int, op: str) -> tuple[int, int, tuple[int, ...]]:
    if cache.dim() < 2:
        raise KernelShapeError(
            f"{op}: a paged cache needs a block axis and a token axis, got shape "
            f"{tuple(cache.shape)}")
    a = check_axis(token_axis, cache.dim() - 1, op=op, name="token_axis")
    block_shape = tuple(cache.shape[1:])
    return a, block_shape[a], block_shape[:a] + block_shape[a + 1:]


def load_tokens(cache: torch.Tensor, block_table: torch.Tensor | Sequence[Sequence[int]],
                seq_lens: torch.Tensor | Sequence[int],
                seq_starts: torch.Tensor | Sequence[int] | None = None, *,
                token_axis: int = 0, out: torch.Tensor | None = None,
                impl: str | Impl | None = None) -> torch.Tensor:
    """Tokens of sequences, read from their block tables into contiguous rows.

    Sequence ``b`` contributes positions ``seq_starts[b] .. seq_starts[b] +
    seq_lens[b] - 1``; position ``p`` is token ``p % block_size`` of block
    ``block_table[b, p // block_size]``. Rows of all sequences follow each
    other in order.

    Args:
        cache: ``(num_blocks, *block_shape)`` with ``block_shape[token_axis] == block_size``.
        block_table: ``(batch, max_blocks)`` integers (unused entries may be padding).
        seq_lens: ``(batch,)`` token counts.
        seq_starts: ``(batch,)`` first positions (default 0).
        token_axis: Axis of the block shape holding tokens (0 for the NPU
            layout, 1 for vLLM's CPU layout).
        out: Optional ``(sum(seq_lens), *row_shape)`` destination.
        impl: Implementation override (no NPU operator loads one tensor: ``npu``
            runs the torch path here).

    Returns:
        ``(sum(seq_lens), *row_shape)``, ``row_shape`` the block shape without the token axis.
    """
    op = "load_tokens"
    cache = check_cache(cache, op=op)
    a, block_size, row_shape = _row_shape(cache, token_axis, op)
    tix = token_index(block_table, seq_lens, seq_starts, num_blocks=cache.shape[0],
                      block_size=block_size, device=cache.device, op=op)
    shape = (tix.num_tokens, *row_shape)
    if out is None:
        out = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    else:
        check_buffer(out, shape, cache.dtype, cache.device, op=op, name="out")
    chosen = resolve_impl(cache.device, impl)
    mod = impl_reference if chosen is Impl.REFERENCE else impl_torch
    return mod.load_tokens(cache, tix, a, out)  # type: ignore[no-any-return]


def store_tokens(rows: torch.Tensor, cache: torch.Tensor,
                 slot_mapping: torch.Tensor | Sequence[int], *, token_axis: int = 0,
                 impl: str | Impl | None = None) -> None:
    """Write token row ``i`` into slot ``slot_mapping[i]`` (``block * block_size + offset``).

    Negative slots mark padding rows and are skipped, as in vLLM.

    Args:
        rows: ``(num_tokens, *row_shape)``.
        cache: ``(num_blocks, *block_shape)``, written in place.
        slot_mapping: ``(num_tokens,)`` integers, distinct where non-negative.
        token_axis: Axis of the block shape holding tokens.
        impl: Implementation override (``npu`` runs the torch path here).
    """
    op = "store_tokens"
    cache = check_cache(cache, op=op)
    a, block_size, row_shape = _row_shape(cache, token_axis, op)
    if not isinstance(rows, torch.Tensor) or rows.dim() < 1:
        raise KernelShapeError(f"{op}: rows must be a (num_tokens, *row_shape) tensor")
    check_buffer(rows, (rows.shape[0], *row_shape), cache.dtype, cache.device, op=op,
                 name="rows")
    row_idx, block, offset = slot_index(slot_mapping, rows.shape[0],
                                        num_slots=cache.shape[0] * block_size,
                                        block_size=block_size, device=cache.device, op=op)
    chosen = resolve_impl(cache.device, impl)
    mod = impl_reference if chosen is Impl.REFERENCE else impl_torch
    mod.store_tokens(rows, cache, row_idx, block, offset, a)


def _check_kv_pair(key_cache: torch.Tensor, value_cache: torch.Tensor, token_axis: int,
                   op: str) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    key_cache = check_cache(key_cache, op=op, name="key_cache")
    value_cache = check_cache(value_cache, op=op, name="value_cache")
    a, bs, k_rows = _row_shape(key_cache, token_axis, op)
    _, v_bs, v_rows = _row_shape(value_cache, token_axis, op)
    if (key_cache.shape[0] != value_cache.shape[0] or bs != v_bs
            or key_cache.dtype != value_cache.dtype or key_cache.device != value_cache.device):
        raise KernelShapeError(
            f"{op}: key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
            f"{tuple(value_cache.shape)} {value_cache.dtype} need the same blocks, block size, "
            "dtype and device")
    return a, bs, k_rows, v_rows


def paged_cache_load(key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor | Sequence[Sequence[int]],
                     seq_lens: torch.Tensor | Sequence[int],
                     seq_starts: torch.Tensor | Sequence[int] | None = None, *,
                     key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                     token_axis: int = 0,
                     impl: str | Impl | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V tokens of sequences from their block tables (``npu_paged_cache_load``).

    Same addressing as :func:`load_tokens`, for a K and a V cache at once
    (their head sizes may differ, as MLA's latent and rope parts do). On NPU
    it calls ``torch_npu.atb.npu_paged_cache_load`` when the layout allows
    (tokens on axis 0, starts aligned to blocks).

    Returns:
        ``(key, value)``: ``(sum(seq_lens), *row_shape)`` each.
    """
    op = "paged_cache_load"
    a, bs, k_rows, v_rows = _check_kv_pair(key_cache, value_cache, token_axis, op)
    tix = token_index(block_table, seq_lens, seq_starts, num_blocks=key_cache.shape[0],
                      block_size=bs, device=key_cache.device, op=op)
    out = []
    for name, buf, rows in (("key", key, k_rows), ("value", value, v_rows)):
        shape = (tix.num_tokens, *rows)
        if buf is None:
            buf = torch.empty(shape, dtype=key_cache.dtype, device=key_cache.device)
        else:
            check_buffer(buf, shape, key_cache.dtype, key_cache.device, op=op, name=name,
                         contiguous=True)
        out.append(buf)
    chosen = resolve_impl(key_cache.device, impl)
    if chosen is Impl.NPU:
        _module(chosen).paged_cache_load(key_cache, value_cache, tix, a, out[0], out[1])
    else:
        mod = impl_reference if chosen is Impl.REFERENCE else impl_torch
        mod.load_tokens(key_cache, tix, a, out[0])
        mod.load_tokens(value_cache, tix, a, out[1])
    return out[0], out[1]


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor | Sequence[int],
                      *, token_axis: int = 0, impl: str | Impl | None = None) -> None:
    """Write K and V token rows into their slots (``_npu_reshape_and_cache``).

    Args:
        key: ``(num_tokens, *key_row_shape)``.
        value: ``(num_tokens, *value_row_shape)``.
        key_cache: K region, written in place.
        value_cache: V region, written in place.
        slot_mapping: ``(num_tokens,)``; negative entries are padding and skipped.
        token_axis: Axis of the block shape holding tokens.
        impl: Implementation override.
    """
    op = "reshape_and_cache"
    a, bs, k_rows, v_rows = _check_kv_pair(key_cache, value_cache, token_axis, op)
    for name, t, rows in (("key", key, k_rows), ("value", value, v_rows)):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise KernelShapeError(f"{op}: {name} must be a (num_tokens, *row_shape) tensor")
        check_buffer(t, (key.shape[0], *rows), key_cache.dtype, key_cache.device, op=op,
                     name=name)
    row_idx, block, offset = slot_index(slot_mapping, key.shape[0],
                                        num_slots=key_cache.shape[0] * bs, block_size=bs,
                                        device=key_cache.device, op=op)
    chosen = resolve_impl(key_cache.device, impl)
    if chosen is Impl.NPU:
        _module(chosen).reshape_and_cache(key, value, key_cache, value_cache, row_idx, block,
                                          offset, a)
        return
    mod = impl_reference if chosen is Impl.REFERENCE else impl_torch
    mod.store_tokens(key, key_cache, row_idx, block, offset, a)
    mod.store_tokens(value, value_cache, row_idx, block, offset, a)


# ---------------------------------------------------------------- heads
def transpose_kv_by_block(caches: Sequence[torch.Tensor], block_ids: BlockIds, num_parts: int,
                          *, head_axis: int = 1, inverse: bool = False,
                          impl: str | Impl | None = None) -> None:
    """Reorder the heads inside blocks after (or before) a multi-rank transfer, in place.

    What vLLM-Ascend's fused ``transpose_kv_cache_by_block`` does for D when
    P TP = ``num_parts`` x D TP: D pulled the same block from ``num_parts`` P
    ranks into one of its blocks, part after part, so each block holds
    ``num_parts`` consecutive P blocks (heads ``H/num_parts`` each). This
    rewrites every listed block into the merged layout, heads in P-rank order.
    ``inverse=True`` does the opposite (merged -> part-major), which a P rank
    pushing to several D ranks uses to make each D rank's heads contiguous.

    For the NPU layout ``(block_size, kv_heads, head_size)`` (``head_axis=1``)
    a block ``(n, block_size, H/n, head_size)`` becomes ``(block_size, n, H/n,
    head_size)``. With ``head_axis=0`` (vLLM's CPU layout) the part-major and
    merged orders are the same bytes and nothing moves.

    Args:
        caches: Regions to rewrite (every layer's K and V), each
            ``(num_blocks, *block_shape)``; shapes may differ between entries.
        block_ids: Distinct ids valid in every cache.
        num_parts: Number of P ranks merged into each block (1: no-op).
        head_axis: Head axis of the block shapes.
        inverse: Split instead of merge.
        impl: Implementation override.
    """
    op = "transpose_kv_by_block"
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence) or not caches:
        raise KernelShapeError(f"{op}: caches must be a non-empty sequence of tensors")
    for i, c in enumerate(caches):
        check_cache(c, op=op, name=f"caches[{i}]")
        head_part_shape(c.shape[1:], num_parts, head_axis, op=f"{op} (caches[{i}])")
        if c.device != caches[0].device:
            raise KernelShapeError(f"{op}: caches[{i}] is on {c.device}, caches[0] on "
                                   f"{caches[0].device}")
    ids = as_block_ids(block_ids, min(int(c.shape[0]) for c in caches), caches[0].device,
                       op=op, unique=True)
    if num_parts == 1 or not ids.numel():
        return
    chosen = resolve_impl(caches[0].device, impl)
    if chosen is Impl.NPU:
        axes = {check_axis(head_axis, c.dim() - 1, op=op, name="head_axis") for c in caches}
        if len(axes) == 1:
            _module(chosen).transpose_blocks(caches, ids, num_parts, axes.pop(), inverse)
            return
        chosen = Impl.TORCH  # mixed ranks of block shapes: no single NPU call covers them
    mod = impl_reference if chosen is Impl.REFERENCE else impl_torch
    for c in caches:
        a = check_axis(head_axis, c.dim() - 1, op=op, name="head_axis")
        mod.transpose_blocks(c, ids, num_parts, a, inverse)

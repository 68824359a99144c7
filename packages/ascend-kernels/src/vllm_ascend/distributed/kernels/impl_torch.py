# SPDX-License-Identifier: Apache-2.0
"""Vectorised implementations: whole blocks per torch call.

Used on CPU, CUDA and any device without a dedicated path. On CPU a block is
reinterpreted, without copying, as one row of the widest element type that
divides its bytes, its block stride and its offset (16-byte ``complex128``
for most caches): ``index_select`` and ``index_copy_`` then move each block
as one ``memcpy`` instead of element by element, at memcpy speed.
Arguments arrive validated (see :mod:`.validation`).
"""

from __future__ import annotations

import logging

import torch

from .heads import merge_raw_parts, split_raw_parts
from .validation import TokenIndex

logger = logging.getLogger(__name__)

#: Row element types by width, widest first; complex128 is simply 16 opaque bytes here.
_WIDE_TYPES = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16),
               (1, torch.uint8))


def _row_width(t: torch.Tensor) -> int:
    """Widest byte width that views each block of ``t`` as one row; 0 when blocks are not contiguous."""
    if t.device.type != "cpu" or t.dim() < 1 or t.numel() == 0 or not t[0].is_contiguous():
        return 0
    esize = t.element_size()
    row_bytes = t[0].numel() * esize
    for width, _ in _WIDE_TYPES:
        if not (row_bytes % width or (t.stride(0) * esize) % width
                or (t.storage_offset() * esize) % width or t.data_ptr() % width):
            return width
    return 0


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``(num_blocks, row)`` of the ``width``-byte type (a view)."""
    flat = t.as_strided((t.shape[0], t[0].numel()), (t.stride(0), 1))
    return flat.view(torch.uint8).view(dict(_WIDE_TYPES)[width])


def _common_rows(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    wa, wb = _row_width(a), _row_width(b)
    if not wa or not wb:
        return None
    w = min(wa, wb)
    return _rows(a, w), _rows(b, w)


#: ``at::internal::GRAIN_SIZE``. ``index_select`` copies a slice of at least this many
#: elements in a parallel region of its own; one region per block stalls whenever a thread
#: is descheduled (measured: 20x slower than memcpy for 1 MiB blocks on a busy 2-core
#: machine), so big blocks are cut into sub-rows below it and the call is one region.
_GRAIN = 32768


def _sub_rows(src: torch.Tensor, dst: torch.Tensor,
              ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``_GRAIN`` elements or more as ``k`` dense sub-rows each, ids expanded to match."""
    row = src.shape[1]
    if row < _GRAIN or src.stride(0) != row or dst.stride(0) != row:
        return src, dst, ids
    k = next(k for k in range(-(-row // (_GRAIN // 2)), row + 1) if row % k == 0)
    if row // k < 1024:  # an awkward row length: tiny sub-rows would cost more than they save
        return src, dst, ids
    sub_ids = (ids[:, None] * k + torch.arange(k, device=ids.device)).flatten()
    return src.reshape(-1, row // k), dst.reshape(-1, row // k), sub_ids


def gather(cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if ids.numel():
        rows = _common_rows(cache, out)
        if rows is not None:
            src, dst, sub_ids = _sub_rows(rows[0], rows[1], ids)
            torch.index_select(src, 0, sub_ids, out=dst)
        else:
            torch.index_select(cache, 0, ids, out=out)
    return out


def scatter(buf: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor) -> None:
    if not ids.numel():
        return
    rows = _common_rows(cache, buf)
    if rows is not None:
        rows[0].index_copy_(0, ids, rows[1])
    else:
        cache.index_copy_(0, ids, buf)


def _token_rows(cache: torch.Tensor, token_axis: int) -> torch.Tensor | None:
    """``(num_blocks * block_size, *rest)`` view of a cache whose token axis follows the block axis."""
    if token_axis != 0:
        return None
    try:
        return cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    except RuntimeError:
        return None


def _index(block: torch.Tensor, offset: torch.Tensor,
           token_axis: int) -> tuple[torch.Tensor | slice, ...]:
    return (block, *([slice(None)] * token_axis), offset)


def load_tokens(cache: torch.Tensor, tix: TokenIndex, token_axis: int,
                out: torch.Tensor) -> torch.Tensor:
    if not tix.num_tokens:
        return out
    flat = _token_rows(cache, token_axis)
    if flat is not None:
        slots = tix.block * cache.shape[1] + tix.offset
        return gather(flat, slots, out)
    out.copy_(cache[_index(tix.block, tix.offset, token_axis)])
    return out


def store_tokens(rows: torch.Tensor, cache: torch.Tensor, row_idx: torch.Tensor,
                 block: torch.Tensor, offset: torch.Tensor, token_axis: int) -> None:
    if not row_idx.numel():
        return
    src = rows if row_idx.numel() == rows.shape[0] else rows.index_select(0, row_idx)
    flat = _token_rows(cache, token_axis)
    if flat is not None:
        scatter(src, flat, block * cache.shape[1] + offset)
        return
    cache[_index(block, offset, token_axis)] = src


def transpose_blocks(cache: torch.Tensor, ids: torch.Tensor, num_parts: int, head_axis: int,
                     inverse: bool) -> None:
    if not ids.numel():
        return
    fn = split_raw_parts if inverse else merge_raw_parts
    picked = gather(cache, ids, torch.empty((ids.numel(), *cache.shape[1:]), dtype=cache.dtype,
                                            device=cache.device))
    scatter(fn(picked, num_parts, head_axis).contiguous(), cache, ids)

# SPDX-License-Identifier: Apache-2.0
"""Copy whole KV blocks between the device cache and host memory.

Both sides are *block-row* views: 2-D ``uint8`` tensors whose row ``i`` is
block ``i`` (rows may be strided, each row is contiguous). Any KV layout
:class:`~vllm_ascend.distributed.kv_transfer.core.layout.KVCacheLayout`
understands becomes such a view through :func:`block_rows`.

Paths:

* CPU to CPU (vLLM's CPU backend, tests): one ``memmove`` per run of
  consecutive blocks through ``ctypes`` (it releases the GIL and costs well
  under a microsecond a call; a torch ``copy_`` per block costs several, which
  halves the bandwidth of 64 KiB blocks);
* anything else (NPU, CUDA): one ``copy_`` per run of consecutive blocks,
  ``non_blocking`` on the caller's stream.

Block ids are checked before any copy: an id outside a view is an
:class:`IndexError` naming it (a raw ``memmove`` must never see one).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

_memmove = ctypes.memmove


def block_rows(t: torch.Tensor) -> torch.Tensor:
    """A ``(num_blocks, block_bytes)`` ``uint8`` view of a region tensor ``(num_blocks, ...)``.

    Each block must be contiguous; blocks may be spaced further apart (the
    row stride is the block stride).

    Raises:
        ValueError: a block is not contiguous in memory.
    """
    if t.dim() < 1:
        raise ValueError(f"expected a tensor with a block dimension, got shape {tuple(t.shape)}")
    n = t.shape[0]
    if t.dim() == 1:
        inner_ok, block_len = True, t.element_size()
    else:
        inner = t[0] if n else t.new_empty(t.shape[1:])
        inner_ok = inner.is_contiguous()
        block_len = inner.numel() * t.element_size()
    if not inner_ok:
        raise ValueError(f"a block of shape {tuple(t.shape[1:])} with strides {t.stride()[1:]} is "
                         "not contiguous; it cannot be copied as one row")
    stride = t.stride(0) * t.element_size()
    if t.dtype == torch.uint8 and t.dim() == 2 and t.stride(1) == 1:
        return t
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (n, block_len),
             (stride, 1))
    return out


def check_ids(ids: Sequence[int], num_rows: int, what: str) -> None:
    """Raise :class:`IndexError` unless every id is an int in ``[0, num_rows)``."""
    for b in ids:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < num_rows:
            raise IndexError(f"{what}: block id {b!r} is outside [0, {num_rows})")


def runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split paired ids into ``(src_start, dst_start, length)`` runs consecutive on both sides."""
    out: list[tuple[int, int, int]] = []
    if not src_ids:
        return out
    s0, d0, n = src_ids[0], dst_ids[0], 1
    for s, d in zip(src_ids[1:], dst_ids[1:], strict=True):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            out.append((s0, d0, n))
            s0, d0, n = s, d, 1
    out.append((s0, d0, n))
    return out


def copy_blocks(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor,
                dst_ids: Sequence[int], *, non_blocking: bool = False,
                use_memmove: bool | None = None) -> int:
    """Copy rows ``src[src_ids[i]]`` to ``dst[dst_ids[i]]``; returns the bytes copied.

    Args:
        src: block-row view (see :func:`block_rows`).
        src_ids: source block ids.
        dst: block-row view with the same row length.
        dst_ids: destination block ids (same length as ``src_ids``).
        non_blocking: pass-through to ``copy_`` on the device path.
        use_memmove: force (True) or forbid (False) the ``memmove`` path; default: used
            when both views are in CPU memory.

    Raises:
        ValueError: the views are not 2-D ``uint8`` block rows of the same length, or the id
            lists differ in length.
        IndexError: an id is out of range.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids")
    for name, t in (("source", src), ("destination", dst)):
        if t.dtype != torch.uint8 or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name} must be a (blocks, bytes) uint8 view with contiguous rows, "
                             f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if src.shape[1] != dst.shape[1]:
        raise ValueError(f"source blocks hold {src.shape[1]} bytes, destination blocks "
                         f"{dst.shape[1]}")
    if not src_ids:
        return 0
    check_ids(src_ids, src.shape[0], "source")
    check_ids(dst_ids, dst.shape[0], "destination")
    row = src.shape[1]
    on_cpu = src.device.type == "cpu" and dst.device.type == "cpu"
    if use_memmove and not on_cpu:
        raise ValueError("memmove needs both views in CPU memory")
    if on_cpu if use_memmove is None else use_memmove:
        s_base, d_base = src.data_ptr(), dst.data_ptr()
        s_stride, d_stride = src.stride(0), dst.stride(0)
        if s_stride == row and d_stride == row:
            for s, d, n in runs(src_ids, dst_ids):
                _memmove(d_base + d * row, s_base + s * row, n * row)
        else:
            for s, d in zip(src_ids, dst_ids, strict=True):
                _memmove(d_base + d * d_stride, s_base + s * s_stride, row)
    else:
        for s, d, n in runs(src_ids, dst_ids):
            dst[d:d + n].copy_(src[s:s + n], non_blocking=non_blocking)
    return row * len(src_ids)

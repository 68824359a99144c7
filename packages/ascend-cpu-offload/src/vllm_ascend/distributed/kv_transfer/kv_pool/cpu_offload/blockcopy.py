# SPDX-License-Identifier: Apache-2.0
"""Copy whole KV blocks between the device cache and host memory.

Both sides are *block-row* views: 2-D ``uint8`` tensors whose row ``i`` is
block ``i`` (rows may be strided, each row is contiguous). Any KV layout
:class:`~vllm_ascend.distributed.kv_transfer.core.layout.KVCacheLayout`
understands becomes such a view through :func:`block_rows`.

Paths (``path`` argument of :func:`copy_blocks` and :func:`copy_blocks_all`):

* ``kernels`` - CPU to CPU (vLLM's CPU backend, tests), the default on CPU:
  ascend-kernels' ``copy_blocks_all_layers``. Every layer of a batch moves in
  one call per run of consecutive host ids (the host pool keeps layers equally
  spaced, host blocks are allocated lowest id first, so runs are long): one
  TensorIterator kernel reads the scattered device blocks of all layers into
  the run, or writes the run into them, at memcpy speed and in one parallel
  region. No Python per block, none per layer.
* ``memmove`` - CPU to CPU: one ``memmove`` per run of consecutive blocks
  through ``ctypes`` (it releases the GIL), spread over a few threads for
  batches of 4 MiB and more (:func:`copy_threads`). Python per block: 64 KiB
  blocks reached only ~0.7 of memcpy.
* ``staged`` - device and host (NPU, CUDA): the device side's scattered
  blocks are gathered into (or scattered from) a contiguous device buffer by
  one ascend-kernels call, and the buffer moves to or from host memory with
  one ``copy_`` per run of consecutive host blocks (host blocks are allocated
  lowest id first, so runs are long). Few large DMAs instead of one per
  block. The default off CPU.
* ``runs`` - one ``copy_`` per run of blocks consecutive on both sides
  (plain torch; no kernels).

Block ids are checked before any copy: an id outside a view is an
:class:`IndexError` naming it (a raw ``memmove`` must never see one).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

_memmove = ctypes.memmove
#: Environment variable setting the threads of the CPU copy path.
COPY_THREADS_ENV = "VLLM_ASCEND_KV_COPY_THREADS"
#: Batches below this size are copied by the calling thread alone.
PARALLEL_MIN_BYTES = 4 << 20
_PIECE = 4 << 20


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
    if not ids:
        return
    # fast path (C loops): plain ints within range
    if set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < num_rows:
        return
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


def _host_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first id, length)`` of runs of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for pos, b in enumerate(ids):
        if out and b == out[-1][1] + out[-1][2]:
            p, first, n = out[-1]
            out[-1] = (p, first, n + 1)
        else:
            out.append((pos, b, 1))
    return out


def copy_blocks(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor,
                dst_ids: Sequence[int], *, non_blocking: bool = False,
                path: str = "auto") -> int:
    """Copy rows ``src[src_ids[i]]`` to ``dst[dst_ids[i]]``; returns the bytes copied.

    Args:
        src: block-row view (see :func:`block_rows`).
        src_ids: source block ids.
        dst: block-row view with the same row length.
        dst_ids: destination block ids (same length as ``src_ids``).
        non_blocking: pass-through to ``copy_`` off CPU.
        path: ``auto``, ``kernels`` or ``memmove`` (CPU only), ``staged`` or ``runs`` (see the
            module doc).

    Raises:
        ValueError: the views are not 2-D ``uint8`` block rows of the same length, or the id
            lists differ in length.
        IndexError: an id is out of range.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids")
    for name, t in (("source", src), ("destination", dst)):
        _check_rows(name, t)
    if src.shape[1] != dst.shape[1]:
        raise ValueError(f"source blocks hold {src.shape[1]} bytes, destination blocks "
                         f"{dst.shape[1]}")
    if not src_ids:
        return 0
    check_ids(src_ids, src.shape[0], "source")
    check_ids(dst_ids, dst.shape[0], "destination")
    row = src.shape[1]
    on_cpu = src.device.type == "cpu" and dst.device.type == "cpu"
    if path == "auto":
        path = "kernels" if on_cpu else "staged"
    if path == "kernels":
        if not on_cpu:
            raise ValueError("the kernels path needs both views in CPU memory")
        _copy_kernels([src], src_ids, [dst], dst_ids)
    elif path == "memmove":
        if not on_cpu:
            raise ValueError("the memmove path needs both views in CPU memory")
        _copy_memmove(src, src_ids, dst, dst_ids, row)
    elif path == "staged":
        _copy_staged(src, src_ids, dst, dst_ids, row, non_blocking)
    elif path == "runs":
        for s, d, n in runs(src_ids, dst_ids):
            dst[d:d + n].copy_(src[s:s + n], non_blocking=non_blocking)
    else:
        raise ValueError(f"unknown copy path {path!r}; expected auto, kernels, memmove, staged "
                         "or runs")
    return row * len(src_ids)


def copy_blocks_all(srcs: Sequence[torch.Tensor], src_ids: Sequence[int],
                    dsts: Sequence[torch.Tensor], dst_ids: Sequence[int], *,
                    non_blocking: bool = False, path: str = "auto") -> int:
    """:func:`copy_blocks` for pairs of views (one per layer) with the same ids; returns the bytes.

    On the ``kernels`` path (CPU, the default there) views of one row length
    move in one call for all layers; other paths copy pair by pair.

    Raises:
        ValueError: the views are not block rows, a pair differs in row length, the id lists
            differ in length, or a destination id repeats on the kernels path.
        IndexError: an id is out of range.
    """
    if len(srcs) != len(dsts):
        raise ValueError(f"{len(srcs)} source views but {len(dsts)} destination views")
    if not srcs:
        return 0
    on_cpu = all(t.device.type == "cpu" for t in (*srcs, *dsts))
    if path == "auto":
        path = "kernels" if on_cpu else "staged"
    if path != "kernels":
        return sum(copy_blocks(s, src_ids, d, dst_ids, non_blocking=non_blocking, path=path)
                   for s, d in zip(srcs, dsts, strict=True))
    if not on_cpu:
        raise ValueError("the kernels path needs both views in CPU memory")
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids")
    groups: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for s, d in zip(srcs, dsts, strict=True):
        for name, t in (("source", s), ("destination", d)):
            _check_rows(name, t)
        if s.shape[1] != d.shape[1]:
            raise ValueError(f"source blocks hold {s.shape[1]} bytes, destination blocks "
                             f"{d.shape[1]}")
        group = groups.setdefault(s.shape[1], ([], []))
        group[0].append(s)
        group[1].append(d)
    if not src_ids:
        return 0
    check_ids(src_ids, min(t.shape[0] for t in srcs), "source")
    check_ids(dst_ids, min(t.shape[0] for t in dsts), "destination")
    for group_srcs, group_dsts in groups.values():
        _copy_kernels(group_srcs, src_ids, group_dsts, dst_ids)
    return sum(t.shape[1] for t in srcs) * len(src_ids)


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.uint8 or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be a (blocks, bytes) uint8 view with contiguous rows, "
                         f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


def _copy_kernels(srcs: Sequence[torch.Tensor], src_ids: Sequence[int],
                  dsts: Sequence[torch.Tensor], dst_ids: Sequence[int]) -> None:
    from vllm_ascend.distributed.kernels import copy_blocks_all_layers

    # ids arrive checked; the kernels check them again (and that destinations do not repeat)
    copy_blocks_all_layers(srcs, torch.as_tensor(src_ids, dtype=torch.int64), dsts,
                           torch.as_tensor(dst_ids, dtype=torch.int64))


def copy_threads() -> int:
    """Threads of the CPU copy path: ``$VLLM_ASCEND_KV_COPY_THREADS``, else up to 4 (one per CPU)."""
    forced = os.environ.get(COPY_THREADS_ENV, "").strip()
    if forced:
        try:
            return max(1, int(forced))
        except ValueError:
            raise ValueError(f"{COPY_THREADS_ENV}={forced!r}: expected a positive integer") \
                from None
    return max(1, min(4, os.cpu_count() or 1))


@functools.lru_cache(maxsize=8)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="offload-copy")


def _run_moves(moves: list[tuple[int, int, int]]) -> None:
    for dst_addr, src_addr, nbytes in moves:
        _memmove(dst_addr, src_addr, nbytes)


def _copy_memmove(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor,
                  dst_ids: Sequence[int], row: int) -> None:
    s_base, d_base = src.data_ptr(), dst.data_ptr()
    s_stride, d_stride = src.stride(0), dst.stride(0)
    moves: list[tuple[int, int, int]] = []
    if s_stride == row and d_stride == row:
        for s, d, n in runs(src_ids, dst_ids):
            # long runs are cut so that the threads share them
            for off in range(0, n * row, _PIECE):
                moves.append((d_base + d * row + off, s_base + s * row + off,
                              min(_PIECE, n * row - off)))
    else:
        moves = [(d_base + d * d_stride, s_base + s * s_stride, row)
                 for s, d in zip(src_ids, dst_ids, strict=True)]
    threads = copy_threads()
    total = row * len(src_ids)
    if threads == 1 or total < PARALLEL_MIN_BYTES or len(moves) < 2:
        _run_moves(moves)
        return
    # a single memmove stream does not saturate memory bandwidth (no non-temporal
    # stores below glibc's threshold): split the moves across threads; ctypes
    # releases the GIL for the copy itself
    chunks: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]
    for i, move in enumerate(moves):
        chunks[i % threads].append(move)
    list(_pool(threads).map(_run_moves, chunks))


def _copy_staged(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor,
                 dst_ids: Sequence[int], row: int, non_blocking: bool,
                 gather_on_src: bool | None = None) -> None:
    """Gather on the source's device, or scatter on the destination's, through one buffer.

    ``gather_on_src`` says which side is the device (default: the source
    unless it is in CPU memory and the destination is not).
    """
    from vllm_ascend.distributed.kernels import gather_blocks, scatter_blocks

    if gather_on_src is None:
        gather_on_src = src.device.type != "cpu" or dst.device.type == "cpu"
    if gather_on_src:
        # device -> host: gather on the device, then one copy per run of host ids
        buf = gather_blocks(src, list(src_ids))
        for pos, first, n in _host_runs(dst_ids):
            dst[first:first + n].copy_(buf[pos:pos + n], non_blocking=non_blocking)
    else:
        # host -> device: one copy per run of host ids, then scatter on the device
        buf = torch.empty((len(dst_ids), row), dtype=torch.uint8, device=dst.device)
        for pos, first, n in _host_runs(src_ids):
            buf[pos:pos + n].copy_(src[first:first + n], non_blocking=non_blocking)
        scatter_blocks(buf, dst, list(dst_ids))

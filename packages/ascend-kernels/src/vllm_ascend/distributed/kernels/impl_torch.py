# SPDX-License-Identifier: Apache-2.0
"""Vectorised implementations: whole blocks per torch call.

Used on CPU, CUDA and any device without a dedicated path. On CPU a block is
reinterpreted, without copying, as one row of the widest element type that
divides its bytes, its block stride and its offset (16-byte ``complex128``
for most caches): ``index_select`` and ``index_copy_`` then move each block
as one ``memcpy`` instead of element by element, at memcpy speed.

On CPU the blocks of every layer move in *one* call (see :func:`gather_layers`):
the caches, separate allocations, are addressed as rows of one strided view of
the address range that spans them all (:func:`_span`), each row index the
block's address. One call is one OpenMP parallel region; a call per layer
opened one region a layer, and each stalled whenever another process held a
core (the all-layers forms measured 0.5 of memcpy on a busy 2-core machine,
against ~1.0 for the same bytes in one call).

Arguments arrive validated (see :mod:`.validation`).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import sys
from collections.abc import Sequence

import torch

from .heads import merge_raw_parts, split_raw_parts
from .validation import TokenIndex

logger = logging.getLogger(__name__)

#: Row element types by width, widest first; complex128 is simply 16 opaque bytes here.
_WIDE_TYPES = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16),
               (1, torch.uint8))
_WIDE = dict(_WIDE_TYPES)
#: One ctypes array type as large as the address space: :func:`_span` views any range through
#: it (``count`` bounds the tensor). A type per length would be cached by ctypes forever.
_ADDRESS_SPACE = ctypes.c_char * sys.maxsize


def _row_width(t: torch.Tensor) -> int:
    """Widest byte width that views each block of ``t`` as one row; 0 when blocks are not contiguous."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.dim() < 1 or t.numel() == 0:
        return 0
    shape, stride = t.shape, t.stride()
    expected = 1
    for i in range(t.dim() - 1, 0, -1):  # each block contiguous (size-1 dims have any stride)
        if shape[i] != 1 and stride[i] != expected:
            return 0
        expected *= shape[i]
    esize = t.element_size()
    row_bytes, block_stride, ptr = expected * esize, stride[0] * esize, t.data_ptr()
    for width, _ in _WIDE_TYPES:
        if not (row_bytes % width or block_stride % width or ptr % width):
            return width
    return 0


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``(num_blocks, row)`` of the ``width``-byte type (a view)."""
    flat = t.as_strided((t.shape[0], t[0].numel()), (t.stride(0), 1))
    return flat.view(torch.uint8).view(_WIDE[width])


#: ``at::internal::GRAIN_SIZE``. ``index_select`` copies a slice of at least this many
#: elements in a parallel region of its own; one region per block stalls whenever a thread
#: is descheduled (measured: 20x slower than memcpy for 1 MiB blocks on a busy 2-core
#: machine), so big blocks are cut into sub-rows below it and the call is one region.
_GRAIN = 32768


def _sub_row_count(row: int) -> int:
    """Sub-rows a row of ``row`` elements is cut into for ``index_select`` (1: not cut)."""
    if row < _GRAIN:
        return 1
    k = next(k for k in range(-(-row // (_GRAIN // 2)), row + 1) if row % k == 0)
    # an awkward row length: tiny sub-rows would cost more than they save
    return k if row // k >= 1024 else 1


class _Span:
    """Every block of some CPU regions as a row of one view: row ``i`` starts at byte ``base + i * width``.

    ``rows(n)`` is that view with rows of ``n`` elements (rows overlap: the row
    stride is one element); :meth:`index` gives the row of block ``ids[j]`` of
    region ``l`` at ``[l, j]``. The view spans the address range from the
    first region's first block to the last region's last, gaps between
    allocations included; only rows of validated blocks are ever read or
    written.
    """

    def __init__(self, regions: Sequence[torch.Tensor], width: int) -> None:
        esize = regions[0].element_size()
        row_bytes = regions[0][0].numel() * esize
        starts = [t.data_ptr() for t in regions]
        strides = [t.stride(0) * esize for t in regions]
        ends = [s + (t.shape[0] - 1) * b + row_bytes
                for s, b, t in zip(starts, strides, regions, strict=True)]
        self.width = width
        self.base = min(starts)  # a multiple of width (``_row_width`` checked every pointer)
        self.row = row_bytes // width
        self.starts = [(s - self.base) // width for s in starts]
        self.strides = [b // width for b in strides]
        self.extents = list(zip(starts, ends, strict=True))
        self.numel = (max(ends) - self.base) // width

    def flat(self) -> torch.Tensor:
        """The spanned range as one 1-D tensor of the width-byte type."""
        raw = _ADDRESS_SPACE.from_address(self.base)
        return torch.frombuffer(raw, dtype=_WIDE[self.width], count=self.numel)

    def rows(self, row: int) -> torch.Tensor:
        """``(numel - row + 1, row)``: row ``i`` is the ``row`` elements from element ``i`` on."""
        return self.flat().as_strided((self.numel - row + 1, row), (1, 1))

    def index(self, ids: torch.Tensor) -> torch.Tensor:
        """``(regions, len(ids))`` row indices: block ``ids[j]`` of region ``l`` at ``[l, j]``."""
        starts = torch.tensor(self.starts, dtype=torch.int64)
        strides = torch.tensor(self.strides, dtype=torch.int64)
        return starts[:, None] + ids[None, :] * strides[:, None]

    def disjoint(self, index: torch.Tensor) -> bool:
        """No two of the rows ``index`` (from :meth:`index`) share a byte: writes cannot race."""
        ext = sorted(self.extents)
        if (all(stride >= self.row for stride in self.strides)
                and all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(ext))):
            return True  # separate allocations, blocks apart: the usual case, no sort needed
        # interleaved regions (K and V views of one allocation) or aliases: check the rows
        rows, _ = torch.sort(index.reshape(-1))
        return bool(((rows[1:] - rows[:-1]) >= self.row).all())


def _common_width(tensors: Sequence[torch.Tensor]) -> int:
    """Widest row width every tensor's blocks share (0: the span paths do not apply)."""
    width = 16
    for t in tensors:
        w = _row_width(t)
        if not w:
            return 0
        width = min(width, w)
    return width


def _span_width(regions: Sequence[torch.Tensor], other: torch.Tensor | None) -> int:
    """Common row width of the regions and ``other`` (0 if ``other`` is ``None``)."""
    return _common_width([*regions, other]) if other is not None else 0


def _flat_blocks(t: torch.Tensor) -> torch.Tensor | None:
    """``(layers, n, *block)`` as ``(layers * n, *block)`` without copying, or ``None``."""
    try:
        return t.view(t.shape[0] * t.shape[1], *t.shape[2:])
    except RuntimeError:
        return None


def _gather_span(caches: Sequence[torch.Tensor], ids: torch.Tensor, out: torch.Tensor) -> bool:
    """One ``index_select`` over the span of ``caches``; False where that path does not apply."""
    flat = _flat_blocks(out)
    width = _span_width(caches, flat)
    if not width:
        return False
    assert flat is not None
    span = _Span(caches, width)
    k = _sub_row_count(span.row)
    sub = span.row // k
    index = span.index(ids).reshape(-1)
    if k > 1:
        index = (index[:, None] + torch.arange(0, span.row, sub)).reshape(-1)
    torch.index_select(span.rows(sub), 0, index, out=_rows(flat, width).view(-1, sub))
    return True


def gather_layers(caches: Sequence[torch.Tensor], ids: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """``out[l, j] = caches[l][ids[j]]``: on CPU one ``index_select`` for every layer."""
    if ids.numel() and not _gather_span(caches, ids, out):
        for layer, cache in enumerate(caches):
            if len(caches) == 1 or not _gather_span([cache], ids, out[layer:layer + 1]):
                torch.index_select(cache, 0, ids, out=out[layer])
    return out


def scatter_layers(buf: torch.Tensor, caches: Sequence[torch.Tensor], ids: torch.Tensor) -> None:
    """``caches[l][ids[j]] = buf[l, j]``: on CPU one ``index_copy_`` for every layer."""
    if not ids.numel():
        return
    flat = _flat_blocks(buf)
    width = _span_width(caches, flat)
    if width:
        assert flat is not None
        span = _Span(caches, width)
        index = span.index(ids).reshape(-1)
        if span.disjoint(index):
            span.rows(span.row).index_copy_(0, index, _rows(flat, width))
            return
    # blocks that share memory are written layer by layer, in order, like the reference
    for layer, cache in enumerate(caches):
        scatter(buf[layer], cache, ids)


def gather(cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    gather_layers([cache], ids, out.unsqueeze(0))
    return out


def scatter(buf: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor) -> None:
    if not ids.numel():
        return
    width = _span_width([cache], buf)
    if width and (cache.shape[0] == 1 or cache.stride(0) >= cache[0].numel()):
        _rows(cache, width).index_copy_(0, ids, _rows(buf, width))
    else:
        cache.index_copy_(0, ids, buf)


#: A run-by-run copy moves at least this much per call on average, or it goes through a
#: buffer instead (two copies, two calls): a call costs ~10-20 us, 256 KiB ~25-50 us.
_MIN_RUN_BYTES = 256 << 10
#: Copies of fewer elements (in all) go through the buffer, whose two calls run inline.
_SMALL_COPY = _GRAIN


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(position, first id, length)`` of each run of consecutive ids."""
    n = ids.numel()
    cut = (torch.nonzero(ids[1:] - ids[:-1] != 1).flatten() + 1).tolist() if n > 1 else []
    pos = [0, *cut]
    firsts = ids[pos].tolist()
    return [(p, f, e - p) for p, f, e in zip(pos, firsts, [*cut, n], strict=True)]


def _overlap(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> bool:
    """Whether an interval of ``a`` and one of ``b`` (``[start, end)`` byte ranges) intersect."""
    events = sorted([(s, e, 0) for s, e in a] + [(s, e, 1) for s, e in b])
    reach = [-1, -1]  # furthest end seen so far on each side
    for s, e, side in events:
        if s < reach[1 - side]:
            return True
        reach[side] = max(reach[side], e)
    return False


def _run_view(span: _Span, flat: torch.Tensor, first: int, count: int) -> torch.Tensor | None:
    """Blocks ``first .. first + count - 1`` of every region as one ``(regions, count, row)`` view.

    ``None`` unless the regions lie at equal distances with equal block strides
    (layers of one allocation, the offload host pool).
    """
    starts, strides = span.starts, span.strides
    step = starts[1] - starts[0] if len(starts) > 1 else 0
    if step < 0 or any(st != strides[0] for st in strides) or any(
            s - starts[0] != i * step for i, s in enumerate(starts)):
        return None
    return flat.as_strided((len(starts), count, span.row), (step, strides[0], 1),
                           starts[0] + first * strides[0])


def _part_view(span: _Span, flat: torch.Tensor, part: int, first: int,
               count: int) -> torch.Tensor:
    """Blocks ``first .. first + count - 1`` of region ``part`` as a ``(count, row)`` view."""
    stride = span.strides[part]
    return flat.as_strided((count, span.row), (stride, 1), span.starts[part] + first * stride)


def copy_layers(srcs: Sequence[torch.Tensor], src_ids: torch.Tensor,
                dsts: Sequence[torch.Tensor], dst_ids: torch.Tensor) -> None:
    """``dsts[l][dst_ids[i]] = srcs[l][src_ids[i]]``, on CPU in one call per run of ids.

    Both sides are addressed through spans (:class:`_Span`). The side with
    fewer runs of consecutive ids is walked run by run: a run is a plain
    strided view of that side (of every layer at once when the layers are
    equally spaced, as in the offload host pool), the other side an index:
    ``aten.index.Tensor_out`` reads scattered sources into a destination run,
    ``index_put_`` writes a source run into scattered destinations. Both are
    TensorIterator kernels: one parallel region, any strides, no sub-rows.
    Small copies (under ``_SMALL_COPY`` elements in all), ids scattered on both
    sides (runs under ``_MIN_RUN_BYTES`` on average), any memory shared between
    sources and destinations, or blocks that are not rows go through a buffer:
    :func:`gather_layers` then :func:`scatter_layers`.
    """
    n = src_ids.numel()
    if not n:
        return
    width = _common_width([*srcs, *dsts])
    sspan = _Span(srcs, width) if width else None
    dspan = _Span(dsts, width) if width else None
    d_index = dspan.index(dst_ids) if dspan is not None else None
    if (sspan is None or dspan is None or d_index is None or not dspan.disjoint(d_index)
            or _overlap(sspan.extents, dspan.extents)):
        _copy_through_buffer(srcs, src_ids, dsts, dst_ids)
        return
    if n * len(srcs) * sspan.row < _SMALL_COPY:
        # small: the buffer's index_select and index_copy_ run inline below _GRAIN elements,
        # while the index kernels below open a parallel region from 3000 (a stall of a
        # scheduler slice, milliseconds, whenever another process holds a core)
        _copy_through_buffer(srcs, src_ids, dsts, dst_ids)
        return
    d_runs, s_runs = _runs(dst_ids), _runs(src_ids)
    runs = min(len(d_runs), len(s_runs))
    row_bytes = sspan.row * width
    if runs > 8 and n * len(srcs) * row_bytes // runs < _MIN_RUN_BYTES:
        _copy_through_buffer(srcs, src_ids, dsts, dst_ids)
        return
    sflat, dflat = sspan.flat(), dspan.flat()
    if len(d_runs) <= len(s_runs):
        # destination runs (saves to the host pool): read scattered sources into each run
        s_index = sspan.index(src_ids)
        s_rows = sspan.rows(sspan.row)
        for pos, first, count in d_runs:
            out = _run_view(dspan, dflat, first, count)
            if out is not None:
                torch.ops.aten.index.Tensor_out(s_rows, [s_index[:, pos:pos + count]], out=out)
                continue
            for part in range(len(dsts)):
                torch.ops.aten.index.Tensor_out(s_rows, [s_index[part, pos:pos + count]],
                                                out=_part_view(dspan, dflat, part, first, count))
    else:
        # source runs (loads from the host pool): write each run into scattered destinations
        d_rows = dspan.rows(dspan.row)
        for pos, first, count in s_runs:
            src = _run_view(sspan, sflat, first, count)
            if src is not None:
                d_rows.index_put_((d_index[:, pos:pos + count],), src)
                continue
            for part in range(len(srcs)):
                d_rows.index_put_((d_index[part, pos:pos + count],),
                                  _part_view(sspan, sflat, part, first, count))


def _copy_through_buffer(srcs: Sequence[torch.Tensor], src_ids: torch.Tensor,
                         dsts: Sequence[torch.Tensor], dst_ids: torch.Tensor) -> None:
    buf = torch.empty((len(srcs), src_ids.numel(), *srcs[0].shape[1:]), dtype=srcs[0].dtype,
                      device=srcs[0].device)
    gather_layers(srcs, src_ids, buf)
    scatter_layers(buf, dsts, dst_ids)


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

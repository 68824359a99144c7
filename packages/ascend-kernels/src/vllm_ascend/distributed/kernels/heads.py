# SPDX-License-Identifier: Apache-2.0
"""KV heads of blocks, split and merged for P and D instances of different TP sizes.

A block region tensor is ``(num_blocks, *block_shape)``; ``head_axis`` is the
axis of ``block_shape`` that indexes KV heads (``0`` for vLLM's CPU layout
``(kv_heads, block_size, 2*head_size)``, ``1`` for the NPU layout
``(block_size, kv_heads, head_size)``, ``None`` for MLA, whose latent has no
heads and is the same on every TP rank).

* **P TP = n x D TP**: a D rank holds the heads of ``n`` P ranks. It reads one
  part from each and merges them: :func:`merge_head_parts`.
* **D TP = n x P TP**: a P rank holds the heads of ``n`` D ranks; D rank ``r``
  takes part ``r % n``: :func:`select_head_part`.

Parts are equal and contiguous in head order: part ``i`` of ``H`` heads is
heads ``i*H/n .. (i+1)*H/n - 1``.

When D pulls the ``n`` parts straight into one of its blocks, part after part
(what a byte-range transfer of each P block does), the block holds them
*part-major*: ``n`` consecutive chunks, each a whole P block. :func:`merge_raw_parts`
turns that byte order into the merged layout and :func:`split_raw_parts` does
the reverse; :func:`~vllm_ascend.distributed.kernels.transpose_kv_by_block`
applies them in place to blocks of a cache. With ``head_axis == 0`` the two
orders coincide and nothing moves.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import KernelShapeError
from .validation import check_axis

logger = logging.getLogger(__name__)


def head_part_shape(block_shape: Sequence[int], num_parts: int, head_axis: int | None,
                    *, op: str = "head_part_shape") -> tuple[int, ...]:
    """The block shape of one of ``num_parts`` head parts.

    Raises:
        KernelShapeError: ``num_parts`` < 1, an invalid axis, or heads that do
            not divide evenly.
    """
    shape = tuple(int(s) for s in block_shape)
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise KernelShapeError(f"{op}: num_parts must be a positive int, got {num_parts!r}")
    if head_axis is None:
        return shape
    a = check_axis(head_axis, len(shape), op=op, name="head_axis")
    if shape[a] % num_parts:
        raise KernelShapeError(
            f"{op}: {shape[a]} KV heads (axis {a} of block shape {shape}) do not split into "
            f"{num_parts} equal parts")
    return (*shape[:a], shape[a] // num_parts, *shape[a + 1:])


def _blocks(t: object, op: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() < 1:
        raise KernelShapeError(f"{op}: expected a (num_blocks, *block_shape) tensor, got {t!r:.80}")
    return t


def split_head_parts(blocks: torch.Tensor, num_parts: int,
                     head_axis: int | None) -> list[torch.Tensor]:
    """The ``num_parts`` head parts of ``blocks``, each a contiguous tensor.

    With ``head_axis=None`` (MLA) every part is a copy of the whole blocks.
    """
    op = "split_head_parts"
    blocks = _blocks(blocks, op)
    head_part_shape(blocks.shape[1:], num_parts, head_axis, op=op)
    if head_axis is None:
        return [blocks.clone(memory_format=torch.contiguous_format) for _ in range(num_parts)]
    a = check_axis(head_axis, blocks.dim() - 1, op=op, name="head_axis")
    return [p.contiguous() for p in torch.chunk(blocks, num_parts, dim=a + 1)]


def select_head_part(blocks: torch.Tensor, num_parts: int, part: int, head_axis: int | None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Part ``part`` of ``num_parts`` of the heads of ``blocks`` (D TP = n x P TP).

    Args:
        blocks: ``(num_blocks, *block_shape)``.
        num_parts: Into how many equal parts the heads split.
        part: Which part, ``0 <= part < num_parts``.
        head_axis: Head axis of the block shape, ``None`` for MLA (the whole
            latent is every part).
        out: Optional contiguous destination of the part's shape.

    Returns:
        A contiguous ``(num_blocks, *part_shape)`` tensor.
    """
    op = "select_head_part"
    blocks = _blocks(blocks, op)
    shape = head_part_shape(blocks.shape[1:], num_parts, head_axis, op=op)
    if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < num_parts:
        raise KernelShapeError(f"{op}: part must be in [0, {num_parts}), got {part!r}")
    if head_axis is None:
        src = blocks
    else:
        a = check_axis(head_axis, blocks.dim() - 1, op=op, name="head_axis")
        width = shape[a]
        src = blocks.narrow(a + 1, part * width, width)
    if out is None:
        return src.contiguous()
    _check_out(out, (blocks.shape[0], *shape), blocks, op)
    out.copy_(src)
    return out


def merge_head_parts(parts: Sequence[torch.Tensor], head_axis: int | None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate head parts read from ``len(parts)`` P ranks (P TP = n x D TP).

    Args:
        parts: ``(num_blocks, *part_shape)`` tensors in P-rank order.
        head_axis: Head axis of the block shape. ``None`` (MLA) takes exactly
            one part: the latent is replicated, so D reads one P rank.
        out: Optional contiguous destination.

    Returns:
        ``(num_blocks, *block_shape)`` with ``len(parts)`` times the heads.
    """
    op = "merge_head_parts"
    if isinstance(parts, torch.Tensor) or not isinstance(parts, Sequence) or not parts:
        raise KernelShapeError(f"{op}: parts must be a non-empty sequence of tensors")
    first = _blocks(parts[0], op)
    for i, p in enumerate(parts[1:], 1):
        p = _blocks(p, op)
        if p.shape != first.shape or p.dtype != first.dtype or p.device != first.device:
            raise KernelShapeError(
                f"{op}: parts[{i}] is {tuple(p.shape)} {p.dtype}, parts[0] is "
                f"{tuple(first.shape)} {first.dtype}: parts must be equal")
    if head_axis is None:
        if len(parts) != 1:
            raise KernelShapeError(
                f"{op}: head_axis=None (MLA) has no heads to merge; the latent is replicated "
                f"on every TP rank, so read one part, not {len(parts)}")
        merged_shape = tuple(first.shape)
        if out is None:
            return first.contiguous()
        _check_out(out, merged_shape, first, op)
        return out.copy_(first)
    a = check_axis(head_axis, first.dim() - 1, op=op, name="head_axis")
    merged_shape = (*first.shape[:a + 1], first.shape[a + 1] * len(parts), *first.shape[a + 2:])
    if out is None:
        return torch.cat(list(parts), dim=a + 1)
    _check_out(out, merged_shape, first, op)
    torch.cat(list(parts), dim=a + 1, out=out)
    return out


def _check_out(out: object, shape: Sequence[int], like: torch.Tensor, op: str) -> None:
    if not isinstance(out, torch.Tensor):
        raise KernelShapeError(f"{op}: out must be a tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise KernelShapeError(
            f"{op}: out is {tuple(out.shape)} {out.dtype} on {out.device}, expected "
            f"{tuple(shape)} {like.dtype} on {like.device}")
    if not out.is_contiguous():
        raise KernelShapeError(f"{op}: out must be contiguous")


def merge_raw_parts(blocks: torch.Tensor, num_parts: int, head_axis: int) -> torch.Tensor:
    """Part-major block bytes -> merged layout, contiguous (a view of ``blocks`` when nothing moves).

    ``blocks`` is ``(k, *block_shape)``; the bytes of each block are read as
    ``num_parts`` consecutive part blocks of shape ``head_part_shape(...)``.
    """
    k, shape = blocks.shape[0], tuple(blocks.shape[1:])
    part = head_part_shape(shape, num_parts, head_axis, op="merge_raw_parts")
    a = check_axis(head_axis, len(shape), op="merge_raw_parts", name="head_axis")
    raw = blocks.contiguous().reshape(k, num_parts, *part)
    return raw.movedim(1, 1 + a).reshape(k, *shape)


def split_raw_parts(blocks: torch.Tensor, num_parts: int, head_axis: int) -> torch.Tensor:
    """Merged layout -> part-major block bytes (the inverse of :func:`merge_raw_parts`)."""
    k, shape = blocks.shape[0], tuple(blocks.shape[1:])
    part = head_part_shape(shape, num_parts, head_axis, op="split_raw_parts")
    a = check_axis(head_axis, len(shape), op="split_raw_parts", name="head_axis")
    split = blocks.reshape(k, *shape[:a], num_parts, part[a], *shape[a + 1:])
    return split.movedim(1 + a, 1).contiguous().reshape(k, *shape)


# ---------------------------------------------------------------------------- head ownership
# Which TP rank holds which KV heads: the one place for that arithmetic, used by the
# P/D connectors (which P rank a D rank reads or writes, and which heads) and by the
# pool (ranks that hold the same heads share keys).


def kv_heads_of_rank(total_heads: int, tp_size: int, tp_rank: int) -> range:
    """Global KV head indices held by ``tp_rank`` of ``tp_size``.

    With ``H`` KV heads and TP size ``T``, rank ``t`` holds heads
    ``[t*H/T, (t+1)*H/T)`` when ``H >= T``; when ``H < T`` heads are replicated
    and rank ``t`` holds head ``t // (T/H)``.

    Raises:
        KernelShapeError: a rank outside ``[0, tp_size)``, or heads that split
            unevenly over the ranks (neither count a multiple of the other).
    """
    if tp_size < 1 or total_heads < 1:
        raise KernelShapeError(f"kv_heads_of_rank: tp_size {tp_size} and total_heads "
                               f"{total_heads} must be positive")
    if not 0 <= tp_rank < tp_size:
        raise KernelShapeError(f"kv_heads_of_rank: tp_rank {tp_rank} outside [0, {tp_size})")
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise KernelShapeError(
                f"{total_heads} KV heads cannot be split evenly over TP size {tp_size}")
        per = total_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % total_heads:
        raise KernelShapeError(
            f"TP size {tp_size} is not a multiple of the {total_heads} KV heads")
    head = tp_rank // (tp_size // total_heads)
    return range(head, head + 1)


def head_group_of_rank(tp_rank: int, tp_size: int, num_kv_heads: int) -> tuple[int, int]:
    """``(group, ranks_per_group)``: ranks holding the same heads form one group.

    When KV heads < TP size, ``tp_size // num_kv_heads`` consecutive ranks hold the
    same head (the group is ``tp_rank // ranks_per_group``); otherwise every rank is
    its own group. Upstream's pool calls the pair ``(head_or_tp_rank, put_step)``.

    Raises:
        KernelShapeError: a non-positive size.
    """
    if tp_size <= 0 or num_kv_heads <= 0:
        raise KernelShapeError(
            f"tp_size {tp_size} and num_kv_heads {num_kv_heads} must be positive")
    if num_kv_heads < tp_size:
        step = tp_size // num_kv_heads
        return tp_rank // step, step
    return tp_rank, 1


def num_head_groups(tp_size: int, num_kv_heads: int) -> int:
    """Distinct head groups across a TP group (see :func:`head_group_of_rank`)."""
    return min(tp_size, num_kv_heads)


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``[local_offset, local_offset + num_heads)`` of a rank's blocks pair with
    heads ``[remote_offset, ...)`` of the blocks of remote rank ``remote_rank``.

    The same record serves a D rank reading from P ranks (pull) and a P rank's
    heads being written into D ranks (push): "local" is the rank that holds the
    plan, "remote" the other instance's rank.
    """

    remote_rank: int
    local_offset: int
    remote_offset: int
    num_heads: int


def plan_head_slices(total_heads: int, remote_tp: int, local_tp: int, local_rank: int, *,
                     is_mla: bool = False) -> list[HeadSlice]:
    """The head slices local rank ``local_rank`` exchanges, grouped by remote rank.

    Each head the local rank holds comes from (or goes to) one remote rank holding
    it; replicas are spread by ``local_rank``. MLA caches have no head axis: every
    rank holds the same latent, so a rank pairs with one remote rank, whole blocks.
    """
    if is_mla:
        return [HeadSlice(remote_rank=local_rank % remote_tp, local_offset=0, remote_offset=0,
                          num_heads=1)]
    mine = kv_heads_of_rank(total_heads, local_tp, local_rank)
    holders = {r: kv_heads_of_rank(total_heads, remote_tp, r) for r in range(remote_tp)}
    slices: list[HeadSlice] = []
    for h in mine:
        candidates = [r for r, heads in holders.items() if h in heads]
        remote = candidates[local_rank % len(candidates)]
        local_off, remote_off = h - mine.start, h - holders[remote].start
        last = slices[-1] if slices else None
        if (last and last.remote_rank == remote
                and last.local_offset + last.num_heads == local_off
                and last.remote_offset + last.num_heads == remote_off):
            slices[-1] = HeadSlice(remote, last.local_offset, last.remote_offset,
                                   last.num_heads + 1)
        else:
            slices.append(HeadSlice(remote, local_off, remote_off, 1))
    return slices


def partners_per_remote_rank(total_heads: int, remote_tp: int, local_tp: int, *,
                             is_mla: bool = False) -> dict[int, int]:
    """How many local ranks pair with each remote rank (P frees after that many reads)."""
    counts: dict[int, int] = {}
    for rank in range(local_tp):
        for r in {s.remote_rank for s in plan_head_slices(total_heads, remote_tp, local_tp,
                                                          rank, is_mla=is_mla)}:
            counts[r] = counts.get(r, 0) + 1
    return counts


def merge_head_slices(blocks_of: Mapping[int, torch.Tensor], slices: Sequence[HeadSlice],
                      head_axis: int) -> torch.Tensor:
    """Merge the heads a rank's ``slices`` take from remote ranks' whole blocks.

    Args:
        blocks_of: per remote rank, its whole blocks ``(n, *remote block shape)``
            (every slice's ``remote_rank`` must be a key).
        slices: the local rank's head slices (:func:`plan_head_slices`).
        head_axis: the head axis of a block.

    Returns:
        ``(n, *local block shape)``: the local rank's heads in local head order.

    The slices may have unequal sizes and offsets: they are cut into parts of the
    greatest common head count, so every slice is a whole number of equal parts.

    Raises:
        KernelShapeError: a slice names a rank missing from ``blocks_of``, or parts
            whose shapes do not fit together.
    """
    missing = sorted({s.remote_rank for s in slices} - set(blocks_of))
    if missing or not slices:
        raise KernelShapeError(f"merge_head_slices: no blocks of remote ranks {missing}"
                               if missing else "merge_head_slices: no slices")
    heads_of = {r: int(_blocks(b, "merge_head_slices").shape[head_axis + 1])
                for r, b in blocks_of.items()}
    unit = math.gcd(*(s.num_heads for s in slices), *(s.remote_offset for s in slices),
                    *heads_of.values())
    parts = [select_head_part(blocks_of[s.remote_rank], heads_of[s.remote_rank] // unit,
                              s.remote_offset // unit + k, head_axis)
             for s in sorted(slices, key=lambda s: s.local_offset)
             for k in range(s.num_heads // unit)]
    return merge_head_parts(parts, head_axis)

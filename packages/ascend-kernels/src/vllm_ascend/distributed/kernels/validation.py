# SPDX-License-Identifier: Apache-2.0
"""Argument checks shared by every implementation.

The public functions validate once, then hand normalised arguments to the
chosen implementation: block ids become a 1-D ``int64`` tensor on the cache's
device, known to lie in ``[0, num_blocks)``. Python's negative indexing never
applies: ``-1`` is an error, not the last block.

Checking ids held in a device tensor reads their minimum and maximum back to
the host (one synchronisation); ids given as a Python sequence are checked on
the host before they are copied to the device.
"""

from __future__ import annotations

import array
import logging
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import BlockIdError, DuplicateIdError, KernelShapeError

logger = logging.getLogger(__name__)

#: Block ids as callers hold them: a Python sequence of ints or a 1-D integer tensor.
BlockIds = Sequence[int] | torch.Tensor


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _first_duplicate_sorted(values: torch.Tensor) -> int:
    s, _ = torch.sort(values)
    dup = (s[1:] == s[:-1]).nonzero()
    return int(s[int(dup[0])]) if dup.numel() else -1


def _first_repeat(seq: Sequence[int]) -> int:
    seen: set[int] = set()
    for v in seq:
        if v in seen:
            return int(v)
        seen.add(v)
    return -1


def as_block_ids(block_ids: BlockIds, num_blocks: int, device: torch.device, *, op: str,
                 what: str = "block id", unique: bool = False) -> torch.Tensor:
    """Validate ``block_ids`` against a cache of ``num_blocks`` blocks.

    Args:
        block_ids: A sequence of ints or a 1-D integer tensor.
        num_blocks: Blocks in the cache the ids index.
        device: Device the returned tensor lives on.
        op: Name of the calling operation, for messages.
        what: What an id is called in messages.
        unique: Reject ids that appear twice (calls that write blocks).

    Returns:
        A 1-D ``int64`` tensor on ``device``.

    Raises:
        KernelShapeError: Not 1-D, or not integers.
        BlockIdError: An id is negative or ``>= num_blocks``.
        DuplicateIdError: ``unique`` and an id appears twice.
    """
    if isinstance(block_ids, torch.Tensor):
        if not _is_integer_dtype(block_ids.dtype):
            raise KernelShapeError(f"{op}: {what}s must be integers, got a {block_ids.dtype} tensor")
        if block_ids.dim() != 1:
            raise KernelShapeError(
                f"{op}: {what}s must be a 1-D tensor, got shape {tuple(block_ids.shape)}")
        ids = block_ids.to(device=device, dtype=torch.int64)
        if ids.numel():
            lo_t, hi_t = torch.aminmax(ids)
            lo, hi = int(lo_t), int(hi_t)
            _check_range(lo, hi, num_blocks, op=op, what=what)
            if unique and torch.unique(ids).numel() != ids.numel():
                raise DuplicateIdError(
                    f"{op}: {what} {_first_duplicate_sorted(ids)} appears more than once")
        return ids
    fast = _fast_block_ids(block_ids)
    if fast is not None:  # plain ints: checked on the tensor (C loops, no Python per id)
        if fast.numel():
            lo_t, hi_t = torch.aminmax(fast)
            _check_range(int(lo_t), int(hi_t), num_blocks, op=op, what=what)
            if unique and torch.unique(fast).numel() != fast.numel():
                raise DuplicateIdError(
                    f"{op}: {what} {_first_repeat(block_ids)} appears more than once")
        return fast.to(device=device)
    try:
        seq = list(block_ids)
    except TypeError:
        raise KernelShapeError(
            f"{op}: {what}s must be a sequence of ints or a 1-D tensor, "
            f"got {type(block_ids).__name__}") from None
    for v in seq:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise KernelShapeError(f"{op}: {what}s must be integers, got {v!r}")
    if seq:
        _check_range(int(min(seq)), int(max(seq)), num_blocks, op=op, what=what)
        if unique and len(set(seq)) != len(seq):
            raise DuplicateIdError(f"{op}: {what} {_first_repeat(seq)} appears more than once")
    return torch.tensor(seq, dtype=torch.int64, device=device)


def _fast_block_ids(block_ids: Sequence[int]) -> torch.Tensor | None:
    """A list or tuple of plain ``int`` as a CPU ``int64`` tensor, or ``None`` (take the slow path).

    ``torch.tensor`` of a Python list costs ~100 ns an id, more than the copy
    of a 64 KiB block's share of a batch; ``array('q')`` and ``frombuffer``
    cost ~15 ns. Bools, numpy ints and ints beyond int64 go the slow way,
    which checks each one and names a bad one.
    """
    if not isinstance(block_ids, list | tuple) or not set(map(type, block_ids)) <= {int}:
        return None
    try:
        packed = array.array("q", block_ids)
    except OverflowError:
        return None
    if not packed:
        return torch.empty(0, dtype=torch.int64)
    # the tensor holds a reference to the array, which owns the memory
    return torch.frombuffer(packed, dtype=torch.int64)


def _check_range(lo: int, hi: int, num_blocks: int, *, op: str, what: str) -> None:
    if lo < 0:
        raise BlockIdError(f"{op}: negative {what} {lo} (ids index from 0; no wrap-around)")
    if hi >= num_blocks:
        raise BlockIdError(
            f"{op}: {what} {hi} out of range for a cache of {num_blocks} blocks")


def check_cache(cache: object, *, op: str, name: str = "cache") -> torch.Tensor:
    """``cache`` is a tensor with a block axis (dim 0)."""
    if not isinstance(cache, torch.Tensor):
        raise KernelShapeError(f"{op}: {name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() < 1:
        raise KernelShapeError(f"{op}: {name} needs a block axis (dim 0), got a 0-d tensor")
    return cache


@dataclass(frozen=True)
class CacheGroup:
    """What a sequence of per-layer caches has in common."""

    block_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    num_blocks: int  # the smallest cache's


def check_caches(caches: Sequence[torch.Tensor], *, op: str) -> CacheGroup:
    """Per-layer caches share block shape, dtype and device.

    Raises:
        KernelShapeError: No caches, or caches that differ.
    """
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence):
        raise KernelShapeError(
            f"{op}: caches must be a sequence of tensors (one per layer), "
            f"got {type(caches).__name__}")
    if not caches:
        raise KernelShapeError(f"{op}: no caches given")
    first = check_cache(caches[0], op=op, name="caches[0]")
    for i, c in enumerate(caches[1:], 1):
        check_cache(c, op=op, name=f"caches[{i}]")
        if c.shape[1:] != first.shape[1:] or c.dtype != first.dtype or c.device != first.device:
            raise KernelShapeError(
                f"{op}: caches[{i}] is {tuple(c.shape)} {c.dtype} on {c.device}, "
                f"caches[0] is {tuple(first.shape)} {first.dtype} on {first.device}: "
                "every layer needs the same block shape, dtype and device")
    return CacheGroup(tuple(first.shape[1:]), first.dtype, first.device,
                      min(int(c.shape[0]) for c in caches))


def check_buffer(buf: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 *, op: str, name: str, contiguous: bool = False) -> torch.Tensor:
    """``buf`` is a tensor of exactly ``shape``/``dtype``/``device`` (contiguous if asked)."""
    if not isinstance(buf, torch.Tensor):
        raise KernelShapeError(f"{op}: {name} must be a torch.Tensor, got {type(buf).__name__}")
    if tuple(buf.shape) != tuple(shape):
        raise KernelShapeError(f"{op}: {name} has shape {tuple(buf.shape)}, expected {tuple(shape)}")
    if buf.dtype != dtype:
        raise KernelShapeError(f"{op}: {name} is {buf.dtype}, the cache is {dtype}")
    if buf.device != device:
        raise KernelShapeError(f"{op}: {name} is on {buf.device}, the cache on {device}")
    if contiguous and not buf.is_contiguous():
        raise KernelShapeError(f"{op}: {name} must be contiguous")
    return buf


def check_axis(axis: int, ndim: int, *, op: str, name: str) -> int:
    """A non-negative axis of a block shape of ``ndim`` dims."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise KernelShapeError(f"{op}: {name} must be an int, got {axis!r}")
    a = int(axis)
    if not -ndim <= a < ndim:
        raise KernelShapeError(
            f"{op}: {name}={axis} is not an axis of a {ndim}-d block shape")
    return a % ndim


@dataclass(frozen=True)
class TokenIndex:
    """Where each token of a paged-cache load lives: ``cache[block[i]]`` at ``offset[i]``."""

    block: torch.Tensor  # int64 (num_tokens,)
    offset: torch.Tensor  # int64 (num_tokens,)
    block_table: torch.Tensor  # int64 (batch, max_blocks), on the cache device
    seq_lens: torch.Tensor  # int64 (batch,)
    seq_starts: torch.Tensor  # int64 (batch,)

    @property
    def num_tokens(self) -> int:
        return int(self.block.numel())


def _int_tensor(x: object, *, op: str, name: str, dim: int,
                device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        if isinstance(x, Sequence) and not isinstance(x, str) and len(x) == 0:
            return torch.zeros((0,) * dim, dtype=torch.int64, device=device)
        try:
            x = torch.tensor(x, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError):
            raise KernelShapeError(f"{op}: {name} must be integers, got {x!r}") from None
    if not _is_integer_dtype(x.dtype):
        raise KernelShapeError(f"{op}: {name} must be integers, got a {x.dtype} tensor")
    if x.dim() != dim:
        raise KernelShapeError(f"{op}: {name} must be {dim}-D, got shape {tuple(x.shape)}")
    return x.to(device=device, dtype=torch.int64)


def token_index(block_table: object, seq_lens: object, seq_starts: object | None,
                *, num_blocks: int, block_size: int, device: torch.device,
                op: str) -> TokenIndex:
    """Validate a block table and resolve every requested token to (block, offset).

    Sequence ``b`` covers token positions ``seq_starts[b] ..
    seq_starts[b] + seq_lens[b] - 1`` of its request; position ``p`` lives in
    block ``block_table[b, p // block_size]`` at offset ``p % block_size``.
    Only the table entries a sequence uses are checked (the rest may be
    padding such as ``-1``).

    Raises:
        KernelShapeError: Malformed table, lengths or starts.
        BlockIdError: A sequence needs a column past the table, or a used
            entry is not a block of the cache.
    """
    table = _int_tensor(block_table, op=op, name="block_table", dim=2, device=device)
    lens = _int_tensor(seq_lens, op=op, name="seq_lens", dim=1, device=device)
    batch = int(table.shape[0])
    if lens.numel() != batch:
        raise KernelShapeError(
            f"{op}: seq_lens has {lens.numel()} entries for a block table of {batch} rows")
    if seq_starts is None:
        starts = torch.zeros(batch, dtype=torch.int64, device=device)
    else:
        starts = _int_tensor(seq_starts, op=op, name="seq_starts", dim=1, device=device)
        if starts.numel() != batch:
            raise KernelShapeError(
                f"{op}: seq_starts has {starts.numel()} entries for {batch} sequences")
    if batch and int(lens.min()) < 0:
        raise KernelShapeError(f"{op}: negative sequence length {int(lens.min())}")
    if batch and int(starts.min()) < 0:
        raise KernelShapeError(f"{op}: negative sequence start {int(starts.min())}")
    total = int(lens.sum()) if batch else 0
    if total == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return TokenIndex(empty, empty, table, lens, starts)
    seq = torch.repeat_interleave(torch.arange(batch, device=device), lens)
    first_row = torch.cumsum(lens, 0) - lens
    pos = torch.arange(total, device=device) - first_row[seq] + starts[seq]
    col = pos // block_size
    max_col = int(col.max())
    if max_col >= table.shape[1]:
        bad = int(seq[int((col >= table.shape[1]).nonzero()[0])])
        raise BlockIdError(
            f"{op}: sequence {bad} needs block-table column {max_col} but the table has "
            f"{table.shape[1]} columns")
    block = table[seq, col]
    _check_range(int(block.min()), int(block.max()), num_blocks, op=op,
                 what="block id (from block_table)")
    return TokenIndex(block, pos % block_size, table, lens, starts)


def slot_index(slot_mapping: object, num_tokens: int, *, num_slots: int, block_size: int,
               device: torch.device, op: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate a slot mapping (one slot a token; negative = padding, skipped).

    Returns:
        ``(rows, block, offset)``: the token rows that are written and where.

    Raises:
        KernelShapeError: Not 1-D integers of ``num_tokens`` entries.
        BlockIdError: A slot ``>= num_slots``.
        DuplicateIdError: Two tokens for the same slot.
    """
    slots = _int_tensor(slot_mapping, op=op, name="slot_mapping", dim=1, device=device)
    if slots.numel() != num_tokens:
        raise KernelShapeError(
            f"{op}: slot_mapping has {slots.numel()} entries for {num_tokens} token rows")
    rows = (slots >= 0).nonzero().flatten()
    used = slots[rows]
    if used.numel():
        hi = int(used.max())
        if hi >= num_slots:
            raise BlockIdError(
                f"{op}: slot {hi} out of range for a cache of {num_slots} slots "
                f"({num_slots // max(block_size, 1)} blocks of {block_size})")
        if torch.unique(used).numel() != used.numel():
            raise DuplicateIdError(
                f"{op}: slot {_first_duplicate_sorted(used)} is written by more than one token")
    return rows, used // block_size, used % block_size

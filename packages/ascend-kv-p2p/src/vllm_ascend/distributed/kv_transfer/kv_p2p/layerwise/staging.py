# SPDX-License-Identifier: Apache-2.0
"""Where P's pushed bytes land in D: straight in D's blocks, or in a staging buffer.

A P rank writes a slice of heads straight into D's blocks when the slice is one
byte range of both blocks: MLA (no head axis), head-major blocks (``head_axis
== 0``), or a slice that is D's whole block in a P block of the same size. Any
other slice (the NPU layout ``(block_size, kv_heads, head_size)`` under
heterogeneous TP) is not contiguous: P then writes its whole blocks into a
staging buffer D registered for that sender, and D merges the heads of every
sender into its blocks once the request is complete, with ascend-kernels' head
and block ops (:mod:`vllm_ascend.distributed.kernels.heads`, NPU fast paths on
NPU).

The head slices are D's (:func:`~.worker_base.head_slices` of a D rank): "local"
is the D rank, "remote" the P rank.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from vllm_ascend.distributed.kernels import scatter_blocks
from vllm_ascend.distributed.kernels.heads import HeadSlice, merge_head_slices
from vllm_ascend.distributed.kv_transfer.core.layout import KVRegion
from vllm_ascend.distributed.kv_transfer.core.transfer_engine import MooncakeTransferEngine

from ..errors import HandshakeMismatchError
from ..worker_base import heads_in_block

logger = logging.getLogger(__name__)


def writes_directly(region: KVRegion, slices: Sequence[HeadSlice], p_len: int) -> bool:
    """Whether a P rank's ``slices`` of D's ``region`` can be written straight into D's
    blocks (P's block of that region is ``p_len`` bytes).

    True for MLA (no head axis), for head-major blocks (a slice of heads is one byte
    range), and when the slice is D's whole block and P's block is the same size;
    otherwise P writes its whole blocks into a staging buffer and D merges the heads.
    """
    if region.head_axis is None or region.head_axis == 0:
        return True
    return all(s.num_heads == heads_in_block(region) and p_len == region.block_len
               for s in slices)


def allocate_staging(te: MooncakeTransferEngine, regions: Sequence[KVRegion],
                     p_block_lens: Sequence[int], slices: Sequence[HeadSlice],
                     n_blocks: int) -> list[torch.Tensor | None]:
    """Registered staging buffers of one sender: for each region, ``n_blocks`` of P's
    blocks when P cannot write ``slices`` into D's blocks directly, else ``None``."""
    out: list[torch.Tensor | None] = []
    for region, p_len in zip(regions, p_block_lens, strict=True):
        if writes_directly(region, slices, p_len):
            out.append(None)
            continue
        heads_p = p_len // (region.block_len // heads_in_block(region))
        shape = list(region.block_shape)
        shape[region.head_axis or 0] = heads_p
        buf = torch.empty((n_blocks, *shape), dtype=region.tensor.dtype,
                          device=region.tensor.device)
        te.register_memory(buf.data_ptr(), buf.numel() * buf.element_size())
        out.append(buf)
    return out


def release_staging(te: MooncakeTransferEngine, buffers: Sequence[torch.Tensor | None]) -> None:
    """Unregister the staging buffers of one sender."""
    for buf in buffers:
        if buf is not None:
            te.unregister_memory(buf.data_ptr())


def merge_staged_heads(region: KVRegion, staged: Mapping[int, torch.Tensor],
                       slices: Sequence[HeadSlice], block_ids: Sequence[int]) -> None:
    """Merge the heads P ranks staged for ``region`` into D's ``block_ids``.

    Args:
        region: D's region.
        staged: per P rank, its whole blocks, ``(len(block_ids), *P's block shape)``.
        slices: this D rank's head slices (every one of them comes from a rank in
            ``staged``: a region is staged by all its senders or by none).
        block_ids: D's blocks, in the order of the staged blocks.

    Raises:
        HandshakeMismatchError: the slices do not cover D's heads, or name a P rank
            that staged nothing.
    """
    axis = region.head_axis
    assert axis is not None, "an MLA region is always written directly"
    heads_local = heads_in_block(region)
    if sum(s.num_heads for s in slices) != heads_local or any(
            s.remote_rank not in staged for s in slices):
        raise HandshakeMismatchError(
            f"the head plan takes {sum(s.num_heads for s in slices)} heads from P ranks "
            f"{sorted({s.remote_rank for s in slices})}, P ranks {sorted(staged)} staged "
            f"theirs, and this rank's blocks hold {heads_local} KV heads")
    merged = merge_head_slices(staged, slices, axis)
    scatter_blocks(merged, region.tensor, torch.tensor(list(block_ids), dtype=torch.long))

# SPDX-License-Identifier: Apache-2.0
"""P/D helpers that upstream's ``kv_transfer/utils/utils.py`` provides, over our own parts.

* :func:`get_transfer_timeout_value`: the transfer timeout (ms) upstream's P/D
  workers export as ``ASCEND_TRANSFER_TIMEOUT``;
* :class:`parallel_info`, :func:`get_cp_group`,
  :func:`context_parallel_parameters_check`: context-parallel bookkeeping;
* :func:`get_tp_rank_head_mapping`, :func:`get_head_group_mapping`: which KV
  heads each TP rank / head group holds, from ascend-kernels'
  ``kernels.heads`` (the one home of that arithmetic);
* :func:`align_memory`: a view of a tensor starting at an aligned address;
* ``kv_alltoall_and_rearrange``, ``alltoall_and_rearrange``,
  ``rearrange_output``: the P-side head all-to-all, which lives in
  ascend-dist-utils (``vllm_ascend.distributed.utils``) and is re-exported
  here lazily (``pip install 'ascend-kv-p2p[dist-utils]'``).

``get_local_remote_block_port_mappings`` and ``get_transfer_mappings`` plan
upstream's layerwise transfers from its own ``ReqMeta`` with P-side PCP/DCP;
our layerwise connector plans its transfers with ``kv_p2p.worker_base.head_slices`` and does not
use upstream's request metadata, so those two raise ``NotImplementedError``.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kernels.heads import kv_heads_of_rank

if TYPE_CHECKING:
    import torch

    from vllm_ascend.distributed.utils import (
        alltoall_and_rearrange,
        kv_alltoall_and_rearrange,
        rearrange_output,
    )

logger = logging.getLogger(__name__)

__all__ = [
    "align_memory",
    "alltoall_and_rearrange",
    "context_parallel_parameters_check",
    "get_cp_group",
    "get_head_group_mapping",
    "get_local_remote_block_port_mappings",
    "get_tp_rank_head_mapping",
    "get_transfer_mappings",
    "get_transfer_timeout_value",
    "kv_alltoall_and_rearrange",
    "parallel_info",
    "rearrange_output",
]

ASCEND_TRANSFER_TIMEOUT_ENV = "ASCEND_TRANSFER_TIMEOUT"
#: Names served from ascend-dist-utils' ``vllm_ascend.distributed.utils``.
_FROM_DIST_UTILS = ("kv_alltoall_and_rearrange", "alltoall_and_rearrange", "rearrange_output")


class ContextParallelError(ValueError, AssertionError):
    """P and D context-parallel sizes that cannot be paired.

    Also an ``AssertionError``: upstream's check ``assert``s and callers may catch that.
    """


def __getattr__(name: str) -> Any:
    if name in _FROM_DIST_UTILS:
        try:
            module = importlib.import_module("vllm_ascend.distributed.utils")
        except ImportError as exc:
            raise ImportError(
                f"{name} is the P-side head all-to-all of ascend-dist-utils, which is not "
                "installed: pip install 'ascend-kv-p2p[dist-utils]'") from exc
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_transfer_timeout_value() -> int:
    """Transfer timeout in milliseconds.

    ``ASCEND_TRANSFER_TIMEOUT`` when set; otherwise the HCCL RDMA retry budget,
    ``4.096 us * 2**HCCL_RDMA_TIMEOUT * HCCL_RDMA_RETRY_CNT`` plus 3 s
    (defaults 20 and 7: 33,064 ms), as upstream.

    Raises:
        ValueError: one of those variables is not an integer (the message names it).
    """
    def _int(name: str, default: str) -> int:
        raw = os.getenv(name, default).strip() or default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer") from None

    if os.getenv(ASCEND_TRANSFER_TIMEOUT_ENV, "").strip():
        return _int(ASCEND_TRANSFER_TIMEOUT_ENV, "0")
    rdma_timeout = _int("HCCL_RDMA_TIMEOUT", "20")
    retry_cnt = _int("HCCL_RDMA_RETRY_CNT", "7")
    return int((4.096 * (2**rdma_timeout)) * retry_cnt // 1000 + 3000)


def align_memory(tensor: torch.Tensor, alignment: int) -> torch.Tensor:
    """A view of ``tensor`` (1-D) starting at the first ``alignment``-byte aligned element.

    Raises:
        ValueError: ``alignment`` is not positive, or the aligned start is not a
            whole number of elements away.
    """
    if alignment <= 0:
        raise ValueError(f"align_memory: alignment {alignment} must be positive")
    ptr = tensor.data_ptr()
    aligned = (ptr + alignment - 1) // alignment * alignment
    gap = aligned - ptr
    if gap % tensor.element_size():
        raise ValueError(f"align_memory: {alignment}-byte boundary is {gap} bytes from "
                         f"{ptr:#x}, not a multiple of the {tensor.element_size()}-byte element")
    return tensor[gap // tensor.element_size():]


@dataclass
class parallel_info:  # upstream's name
    """Parallel sizes of one side (P or D) of a transfer."""

    tp_size: int
    pcp_size: int
    dcp_size: int
    use_mla: bool
    pd_head_ratio: int


def get_cp_group(tp: int, heads: int, dcp: int) -> list[list[int]]:
    """Head groups of a ``[pcp][head_group][dcp]`` rank layout that together hold every head.

    ``tp=8, heads=4, dcp=2`` gives ``[[0, 1, 2, 3]]``; ``tp=8, heads=4, dcp=1``
    gives ``[[0, 2, 4, 6], [1, 3, 5, 7]]`` (upstream returns sets for the
    second form; these are sorted lists of the same members).

    Raises:
        ValueError: a non-positive size.
    """
    if tp <= 0 or heads <= 0 or dcp <= 0:
        raise ValueError(f"get_cp_group: tp={tp}, heads={heads}, dcp={dcp} must be positive")
    step = tp // heads
    if step == 0:
        return [list(range(tp // dcp))]
    return [sorted({k // dcp for h in range(heads)
                    for k in range(h * step + i * dcp, h * step + (i + 1) * dcp)})
            for i in range(step // dcp)]


def context_parallel_parameters_check(remote_pcp_size: int, remote_dcp_size: int,
                                      p_parallel_info: parallel_info,
                                      d_parallel_info: parallel_info,
                                      total_num_kv_heads: int) -> None:
    """Check that P's context parallelism pairs with the remote side's.

    Raises:
        ContextParallelError: P's ``pcp*dcp`` is not a multiple of the remote
            one, or (non-MLA) D's heads a rank are not a multiple of P's.
    """
    p_cp = p_parallel_info.pcp_size * p_parallel_info.dcp_size
    remote_cp = remote_pcp_size * remote_dcp_size
    if remote_cp <= 0 or p_cp % remote_cp:
        raise ContextParallelError(
            f"P pcp*dcp = {p_cp} is not a multiple of the remote pcp*dcp = {remote_cp}")
    if not p_parallel_info.use_mla:
        p_heads = math.ceil(total_num_kv_heads / p_parallel_info.tp_size)
        d_heads = math.ceil(total_num_kv_heads / d_parallel_info.dcp_size)
        if d_heads % p_heads:
            raise ContextParallelError(
                f"D holds {d_heads} KV heads a rank, not a multiple of P's {p_heads} "
                f"({total_num_kv_heads} heads, P TP {p_parallel_info.tp_size}, "
                f"D DCP {d_parallel_info.dcp_size})")


def get_tp_rank_head_mapping(num_key_value_heads: int, tp_size: int) -> dict[int, list[int]]:
    """``{tp_rank: [kv head indices]}`` (heads replicated when TP > heads).

    Raises:
        ValueError: heads and TP size do not divide one another
            (``KernelShapeError`` from ascend-kernels).
    """
    return {rank: list(kv_heads_of_rank(num_key_value_heads, tp_size, rank))
            for rank in range(tp_size)}


def get_head_group_mapping(num_key_value_heads: int, tp_size: int, num_groups: int,
                           select_cp_group: list[int]) -> dict[int, list[int]]:
    """``{head_group_rank: sorted kv heads}`` for the groups in ``select_cp_group``.

    The ``tp_size`` ranks form ``num_groups`` groups of consecutive ranks.

    Raises:
        ValueError: ``num_groups`` does not divide ``tp_size``.
    """
    if num_groups <= 0 or tp_size % num_groups:
        raise ValueError(f"Total number of devices ({tp_size}) cannot be divided by the "
                         f"number of groups ({num_groups}).")
    per_group = tp_size // num_groups
    tp_mapping = get_tp_rank_head_mapping(num_key_value_heads, tp_size)
    selected = set(select_cp_group)
    return {group: sorted({head for rank in range(group * per_group, (group + 1) * per_group)
                           for head in tp_mapping[rank]})
            for group in range(num_groups) if group in selected}


def get_local_remote_block_port_mappings(*args: Any, **kwargs: Any) -> Any:
    """Not provided: see the module docstring.

    Raises:
        NotImplementedError: always.
    """
    raise NotImplementedError(
        "get_local_remote_block_port_mappings plans upstream's layerwise PCP/DCP transfers "
        "from upstream's ReqMeta; ascend-kv-p2p's MooncakeLayerwiseConnector plans its "
        "transfers with vllm_ascend.distributed.kv_transfer.kv_p2p.worker_base.head_slices instead")


def get_transfer_mappings(*args: Any, **kwargs: Any) -> Any:
    """Not provided: see the module docstring.

    Raises:
        NotImplementedError: always.
    """
    raise NotImplementedError(
        "get_transfer_mappings consumes get_local_remote_block_port_mappings' plan of "
        "upstream's layerwise PCP/DCP transfers; ascend-kv-p2p's MooncakeLayerwiseConnector "
        "plans its transfers with vllm_ascend.distributed.kv_transfer.kv_p2p.worker_base.head_slices "
        "instead")

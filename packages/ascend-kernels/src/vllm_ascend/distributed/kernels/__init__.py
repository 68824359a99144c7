# SPDX-License-Identifier: Apache-2.0
"""KV block kernels for vLLM on Ascend (``ascend-kernels``).

Block operations the KV connectors need, each with a plain-torch reference
implementation and device fast paths (see :mod:`.dispatch`):

* :func:`gather_blocks` / :func:`scatter_blocks` and their
  ``*_all_layers`` forms: blocks to and from a contiguous buffer;
  :func:`copy_blocks` / :func:`copy_blocks_all_layers`: blocks between two
  regions, scattered on both sides (device cache and host pool);
* :func:`paged_cache_load` / :func:`load_tokens`: the tokens of requests
  from their block tables; :func:`reshape_and_cache` / :func:`store_tokens`:
  token rows into their slots;
* :func:`split_head_parts`, :func:`select_head_part`,
  :func:`merge_head_parts`: KV heads for P and D instances of different TP
  sizes; :func:`transpose_kv_by_block`: the in-place head reorder after a
  multi-rank pull (vLLM-Ascend's fused op).

Importing this package needs only torch; ``torch_npu`` is imported by the NPU
implementation when it is used.
"""

from __future__ import annotations

from .__about__ import __version__
from .dispatch import ENV_IMPL, Impl, resolve_impl
from .errors import (
    BlockIdError,
    DuplicateIdError,
    KernelShapeError,
    NpuUnavailableError,
    UnknownImplError,
)
from .heads import (
    HeadSlice,
    head_group_of_rank,
    head_part_shape,
    kv_heads_of_rank,
    merge_head_parts,
    merge_head_slices,
    num_head_groups,
    partners_per_remote_rank,
    plan_head_slices,
    select_head_part,
    split_head_parts,
)
from .ops import (
    copy_blocks,
    copy_blocks_all_layers,
    gather_blocks,
    gather_blocks_all_layers,
    load_tokens,
    paged_cache_load,
    reshape_and_cache,
    scatter_blocks,
    scatter_blocks_all_layers,
    store_tokens,
    transpose_kv_by_block,
)

__all__ = [
    "ENV_IMPL",
    "BlockIdError",
    "DuplicateIdError",
    "HeadSlice",
    "Impl",
    "KernelShapeError",
    "NpuUnavailableError",
    "UnknownImplError",
    "__version__",
    "copy_blocks",
    "copy_blocks_all_layers",
    "gather_blocks",
    "gather_blocks_all_layers",
    "head_group_of_rank",
    "head_part_shape",
    "kv_heads_of_rank",
    "load_tokens",
    "merge_head_parts",
    "merge_head_slices",
    "num_head_groups",
    "paged_cache_load",
    "partners_per_remote_rank",
    "plan_head_slices",
    "reshape_and_cache",
    "resolve_impl",
    "scatter_blocks",
    "scatter_blocks_all_layers",
    "select_head_part",
    "split_head_parts",
    "store_tokens",
    "transpose_kv_by_block",
]

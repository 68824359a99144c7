# SPDX-License-Identifier: Apache-2.0
"""Collectives of vLLM on Ascend: the fc3 all-gather with unpadding, an async all-gather,
the P/D head all-to-all, the decode-context-parallel size and a first-dim split.

``group`` arguments accept a vLLM ``GroupCoordinator`` (what
:mod:`.parallel_state` returns; its ``device_group`` is used) or a plain
``torch.distributed`` process group.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .device_communicators._vllm import vllm_module
from .device_communicators.errors import SplitSizeError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

logger = logging.getLogger(__name__)

__all__ = ["all_gather_async", "alltoall_and_rearrange", "fc3_all_gather_and_maybe_unpad_impl",
           "get_decode_context_model_parallel_rank",
           "get_decode_context_model_parallel_world_size", "kv_alltoall_and_rearrange",
           "rearrange_output", "split_tensor_along_first_dim"]


def _device_group(group: Any) -> ProcessGroup | None:
    return getattr(group, "device_group", group)


def _world_size(group: Any) -> int:
    size = getattr(group, "world_size", None)
    return int(size) if size is not None else dist.get_world_size(group)


@functools.cache
def _ascend_forward_context() -> Any:
    """vLLM-Ascend's ``ascend_forward_context`` module, or ``None`` (looked up once)."""
    try:
        return importlib.import_module("vllm_ascend.ascend_forward_context")
    except ImportError:
        return None


def _extra_context(forward_context: Any) -> Any:
    """Where vLLM-Ascend keeps ``pad_size`` / ``padded_length``: its ``_EXTRA_CTX`` when
    installed, else the forward context (older upstream set them there)."""
    extra = getattr(_ascend_forward_context(), "_EXTRA_CTX", None)
    return extra if extra is not None else forward_context


def _lookup(ctx: Any, forward_context: Any, name: str) -> Any:
    for source in (ctx, forward_context):
        value = getattr(source, name, None)
        if value is not None:
            return value
    kwargs = getattr(forward_context, "additional_kwargs", None) or {}
    return kwargs.get(name)


def fc3_all_gather_and_maybe_unpad_impl(x: torch.Tensor, *, group: Any = None,
                                        pad_size: int | None = None,
                                        padded_length: int | None = None) -> torch.Tensor:
    """All-gather ``x`` on the fc3 quant-x group along dim 0, then drop the padding.

    Upstream semantics: outside a forward pass (no vLLM forward context) ``x``
    is returned unchanged. Without DP metadata, the last ``pad_size`` rows of
    the gathered tensor are padding. With DP metadata, the gathered rows are
    ``dp_size`` chunks of ``padded_length`` rows each, of which DP rank ``i``
    filled ``num_tokens_across_dp_cpu[i]``; the result keeps those, in order.

    ``pad_size`` and ``padded_length`` come from vLLM-Ascend's extra forward
    context when it is installed, else from the forward context (attributes or
    ``additional_kwargs``); the keyword arguments override both.

    Args:
        x: This rank's ``(tokens, ...)`` rows.
        group: Gather group (default: ``get_fc3_quant_x_group()``).
        pad_size: Padding rows at the end (no DP metadata).
        padded_length: Rows per DP rank before unpadding (with DP metadata).
    """
    fc_mod = vllm_module("vllm.forward_context", what="fc3_all_gather_and_maybe_unpad_impl")
    try:
        forward_context = fc_mod.get_forward_context()
    except AssertionError:
        return x
    if group is None:
        from .parallel_state import get_fc3_quant_x_group

        group = get_fc3_quant_x_group()
    if hasattr(group, "all_gather"):
        x = group.all_gather(x, 0)
    else:
        out, _ = all_gather_async(x, group, async_op=False)
        x = out
    ctx = _extra_context(forward_context)
    dp_metadata = getattr(forward_context, "dp_metadata", None)
    if dp_metadata is None:
        pad = int(pad_size if pad_size is not None else _lookup(ctx, forward_context,
                                                                  "pad_size") or 0)
        if pad < 0 or pad > x.shape[0]:
            raise SplitSizeError(f"fc3 unpad: pad_size {pad} for {x.shape[0]} gathered rows")
        return x[:-pad] if pad > 0 else x
    counts = dp_metadata.num_tokens_across_dp_cpu
    dp_size = int(counts.numel())
    length = padded_length if padded_length is not None else _lookup(ctx, forward_context,
                                                                     "padded_length")
    if length is None:
        if x.shape[0] % dp_size:
            raise SplitSizeError(
                f"fc3 unpad: {x.shape[0]} gathered rows do not split into {dp_size} DP chunks "
                "and no padded_length is known")
        length = x.shape[0] // dp_size
    length = int(length)
    if length * dp_size != x.shape[0] or int(counts.max()) > length:
        raise SplitSizeError(
            f"fc3 unpad: {x.shape[0]} gathered rows, {dp_size} DP ranks of padded length "
            f"{length}, tokens per DP rank {counts.tolist()}")
    chunks = x.view(dp_size, length, *x.shape[1:])
    result = torch.empty((int(counts.sum()), *x.shape[1:]), device=x.device, dtype=x.dtype)
    offset = 0
    for idx, n in enumerate(counts.tolist()):
        result[offset:offset + n] = chunks[idx, :n]
        offset += n
    return result


def all_gather_async(input: torch.Tensor, group: Any, output: torch.Tensor | None = None,
                     async_op: bool = True) -> tuple[torch.Tensor, Work | None]:
    """``all_gather_into_tensor`` of ``input`` on ``group`` along dim 0, async by default.

    Args:
        input: This rank's ``(n, ...)`` tensor (the same shape on every rank).
        group: ``GroupCoordinator`` or process group.
        output: Optional ``(n * world_size, ...)`` destination.
        async_op: Return before the gather completes.

    Returns:
        ``(output, work)``: wait on ``work`` before reading ``output``. A group
        of one rank returns ``(input, None)``, as upstream.
    """
    world = _world_size(group)
    if world == 1:
        return input, None
    if output is None:
        output = torch.empty((input.shape[0] * world, *input.shape[1:]), dtype=input.dtype,
                             device=input.device)
    elif output.shape[0] != input.shape[0] * world or output.shape[1:] != input.shape[1:]:
        raise SplitSizeError(
            f"all_gather_async: output {tuple(output.shape)} for input {tuple(input.shape)} "
            f"on {world} ranks")
    work = dist.all_gather_into_tensor(output, input, group=_device_group(group),
                                       async_op=async_op)
    return output, work


def rearrange_output(base_output: torch.Tensor, cut_num: int, num_kv_heads: int) -> torch.Tensor:
    """Undo the all-to-all's chunk order (upstream's ``rearrange_output``).

    ``base_output`` holds ``cut_num`` chunks along dim 0, one from each source
    rank; row ``t`` of every chunk belongs to the same token. The result puts
    the chunks' rows of token ``t`` side by side: ``(size_0, num_kv_heads, -1)``.
    """
    size_0 = base_output.size(0)
    if size_0 % cut_num:
        raise SplitSizeError(
            f"The size of dim 0 [{size_0}] must be divisible by the cut_num [{cut_num}]")
    chunk = size_0 // cut_num
    return base_output.view(cut_num, chunk, -1).transpose(0, 1).contiguous().view(
        size_0, num_kv_heads, -1)


def alltoall_and_rearrange(tp_ratio: int, input_tensor: torch.Tensor,
                           group: Any = None) -> torch.Tensor:
    """All-to-all of ``(tokens, heads, head_size)`` rows on the P-side TP group, rearranged.

    Args:
        tp_ratio: Prefill TP / decode TP (the group size).
        input_tensor: Rows whose dim 0 is ``tp_ratio`` chunks, chunk ``j`` for rank ``j``.
        group: Default ``get_p_tp_group()``.
    """
    if group is None:
        from .parallel_state import get_p_tp_group

        group = get_p_tp_group()
    num_kv_heads = input_tensor.size(1)
    output = torch.empty_like(input_tensor)
    dist.all_to_all_single(output, input_tensor.contiguous(), group=_device_group(group))
    return rearrange_output(output, tp_ratio, num_kv_heads)


def kv_alltoall_and_rearrange(pd_tp_ratio: int, key: torch.Tensor | None,
                              value: torch.Tensor | None,
                              group: Any = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:func:`alltoall_and_rearrange` of K and V; ``(None, None)`` when ``pd_tp_ratio <= 1``.

    Raises:
        ValueError: ``key`` or ``value`` is ``None`` while a reshard is needed.
    """
    if pd_tp_ratio <= 1:
        return None, None
    if key is None or value is None:
        raise ValueError("kv_alltoall_and_rearrange: key or value is None")
    return (alltoall_and_rearrange(pd_tp_ratio, key, group),
            alltoall_and_rearrange(pd_tp_ratio, value, group))


def get_decode_context_model_parallel_world_size() -> int:
    """World size of vLLM's decode context parallel (DCP) group.

    vLLM removed this helper from ``vllm.distributed``; vLLM-Ascend's modules
    import it from here. As vLLM's ``get_dcp_group()``, it raises
    ``AssertionError`` before the group exists.
    """
    ps = vllm_module("vllm.distributed.parallel_state",
                     what="get_decode_context_model_parallel_world_size")
    return int(ps.get_dcp_group().world_size)


def get_decode_context_model_parallel_rank() -> int:
    """This rank's index in vLLM's decode context parallel (DCP) group."""
    ps = vllm_module("vllm.distributed.parallel_state",
                     what="get_decode_context_model_parallel_rank")
    return int(ps.get_dcp_group().rank_in_group)


def split_tensor_along_first_dim(tensor: torch.Tensor, num_partitions: int,
                                 contiguous_split_chunks: bool = False) -> Sequence[torch.Tensor]:
    """Split ``tensor`` into ``num_partitions`` equal parts along dim 0 (views by default).

    The counterpart of vLLM's ``split_tensor_along_last_dim``.

    Args:
        tensor: The tensor to split.
        num_partitions: Number of parts; must divide ``tensor.size(0)``.
        contiguous_split_chunks: Make each part contiguous (a copy) instead of a view.

    Returns:
        The parts, in order.

    Raises:
        SplitSizeError: ``num_partitions`` is not positive or does not divide dim 0.
    """
    size = tensor.size(0)
    if num_partitions <= 0 or size % num_partitions:
        raise SplitSizeError(f"split_tensor_along_first_dim: dim 0 of size {size} does not "
                             f"split into {num_partitions} equal parts")
    parts = torch.split(tensor, size // num_partitions, dim=0)
    if contiguous_split_chunks:
        return tuple(part.contiguous() for part in parts)
    return parts

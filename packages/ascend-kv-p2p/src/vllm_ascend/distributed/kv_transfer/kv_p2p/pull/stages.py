# SPDX-License-Identifier: Apache-2.0
"""Which layers each pipeline stage of a P instance holds: the one home of that mapping.

A pipeline-parallel P (``prefill.pp_size`` > 1) splits the model's layers into
contiguous stages; each stage's workers hold (and register) only their layers' KV.
D (always one stage) reads each layer from the stage that holds it.

* The split is ``prefill.pp_layer_partition`` when given (the layers of each stage, in
  stage order; they must add up to the model's layer count), else vLLM's default
  (:func:`vllm.distributed.utils.get_pp_indices`): an even split, the remainder spread
  one layer each over the stages before the last, from the second-to-last backwards.
  Set the same partition as vLLM's ``VLLM_PP_LAYER_PARTITION`` on P.
* P rank ``(pp_rank, tp_rank)`` is known to D's reader as the *instance rank*
  ``pp_rank * tp_size + tp_rank`` (TP inner, PP outer, as in
  :class:`~vllm_ascend.distributed.kv_transfer.core.ranks.RankInfo`); its side channel
  listens on ``base + pp_rank * tp_size + tp_rank``
  (:func:`~.protocol.worker_port`, upstream's layout), so the port of instance rank ``k``
  is ``base + k``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

from vllm_ascend.distributed.kernels.heads import HeadSlice
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError

__all__ = ["expand_over_stages", "stage_layers", "stage_of_rank"]

logger = logging.getLogger(__name__)


def stage_layers(num_layers: int, pp_size: int, partition: Sequence[int] | None = None, *,
                 source: str = "prefill") -> list[range]:
    """The layers of each pipeline stage, in stage order.

    Args:
        num_layers: the model's layer count (attention layers with a KV cache).
        pp_size: the number of pipeline stages.
        partition: layers per stage (``pp_layer_partition``); ``None``: vLLM's default.
        source: the config section named in errors.

    Raises:
        ConfigError: the partition does not have ``pp_size`` positive entries adding up to
            ``num_layers``, or there are fewer layers than stages.
    """
    key = f"{source}.pp_layer_partition"
    if pp_size < 1:
        raise ConfigError(f"{source}.pp_size must be at least 1, got {pp_size}",
                          key=f"{source}.pp_size", value=pp_size, source=source)
    if partition is None:
        if num_layers < pp_size:
            raise ConfigError(
                f"{source}: {num_layers} layers cannot be split over pp_size={pp_size} "
                "pipeline stages", key=f"{source}.pp_size", value=pp_size, source=source)
        sizes = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):  # vLLM's get_pp_indices
            sizes[-i] += 1
    else:
        sizes = [int(n) for n in partition]
        if len(sizes) != pp_size or any(n <= 0 for n in sizes):
            raise ConfigError(
                f"{source}: pp_layer_partition {sizes} must have pp_size={pp_size} positive "
                "entries", key=key, value=sizes, source=source)
        if sum(sizes) != num_layers:
            raise ConfigError(
                f"{source}: pp_layer_partition {sizes} adds up to {sum(sizes)} layers but the "
                f"model has {num_layers}", key=key, value=sizes, source=source)
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def stage_of_rank(rank: int, tp_size: int) -> int:
    """The pipeline stage of instance rank ``rank`` (``pp_rank * tp_size + tp_rank``)."""
    return rank // tp_size


def expand_over_stages(plan: Sequence[HeadSlice], readers: Mapping[int, int], *, tp_size: int,
                       pp_size: int) -> tuple[tuple[HeadSlice, ...], dict[int, int]]:
    """A D rank's head plan and P's readers over every stage of a pipeline-parallel P.

    ``plan`` and ``readers`` name P's TP ranks (one stage); the result names P's instance
    ranks: each slice of TP rank ``r`` once per stage ``s``, as rank ``s * tp_size + r``
    (the same heads, of that stage's layers), with the same number of readers. With
    ``pp_size`` 1 they are returned as they are.
    """
    if pp_size == 1:
        return tuple(plan), dict(readers)
    out = tuple(dataclasses.replace(sl, remote_rank=s * tp_size + sl.remote_rank)
                for s in range(pp_size) for sl in plan)
    return out, {s * tp_size + r: n for s in range(pp_size) for r, n in readers.items()}

# SPDX-License-Identifier: Apache-2.0
"""Where a worker sits in its instance, read from vLLM: the one home of rank facts.

Every connector needs its worker's TP/PP position (ports, pool keys, which heads
it holds). vLLM knows it once its parallel groups are initialised (worker
processes); the scheduler process has no groups, and there the position is
derived from ``parallel_config.rank`` or taken as rank 0 of a single rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["RankInfo", "rank_info_from_vllm", "workers_on_host"]


@dataclass(frozen=True)
class RankInfo:
    """A worker's position in its instance (TP inner, PP outer)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        for name, rank, size in (("tp", self.tp_rank, self.tp_size),
                                 ("pp", self.pp_rank, self.pp_size)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name}_rank {rank} outside [0, {name}_size={size})")

    @property
    def rank(self) -> int:
        """Rank within the instance (TP inner, PP outer)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        """Ranks of the instance."""
        return self.tp_size * self.pp_size


def _int(obj: Any, name: str, default: int) -> int:
    value = getattr(obj, name, None) if obj is not None else None
    return default if value is None else int(value)


def rank_info_from_vllm(parallel_config: Any = None) -> RankInfo:
    """This worker's position from vLLM's parallel state.

    Args:
        parallel_config: vLLM's ``ParallelConfig`` (sizes, DP rank, and the global
            ``rank`` used where the groups are not initialised). Optional: without
            it, sizes come from the groups alone.

    Returns:
        The position from vLLM's TP/PP groups when they are initialised; otherwise
        derived from ``parallel_config.rank``; otherwise rank 0 of 1.
    """
    tp_size = _int(parallel_config, "tensor_parallel_size", 1)
    pp_size = _int(parallel_config, "pipeline_parallel_size", 1)
    dp_rank = _int(parallel_config, "data_parallel_rank", 0)
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp, pp = get_tp_group(), get_pp_group()
        return RankInfo(tp_rank=int(tp.rank_in_group), tp_size=int(tp.world_size),
                        pp_rank=int(pp.rank_in_group), pp_size=int(pp.world_size),
                        dp_rank=dp_rank)
    except (AssertionError, AttributeError, ImportError, RuntimeError, TypeError):
        # the scheduler process, or vLLM's groups not initialised yet
        logger.debug("vLLM parallel groups not initialised; deriving ranks from the config")
    rank = _int(parallel_config, "rank", 0)
    return RankInfo(tp_rank=rank % tp_size, tp_size=tp_size,
                    pp_rank=(rank // tp_size) % pp_size, pp_size=pp_size, dp_rank=dp_rank)


def workers_on_host(parallel_config: Any = None) -> int:
    """Worker processes on this host of this engine and of its data-parallel siblings here:
    vLLM's ``local_world_size`` (the instance's ranks over the nodes it spans) times
    ``data_parallel_size_local``; without ``local_world_size`` (older vLLM) the instance's
    ranks over ``nnodes``. 1 without a config. Each of them keeps what a worker keeps in
    host memory (a ``local`` pool, say), so a host's share is checked against this count."""
    if parallel_config is None:
        return 1
    try:
        local = int(parallel_config.local_world_size)
    except (AttributeError, TypeError, ValueError):
        world = (_int(parallel_config, "tensor_parallel_size", 1)
                 * _int(parallel_config, "pipeline_parallel_size", 1))
        local = max(1, world // max(1, _int(parallel_config, "nnodes", 1)))
    return max(1, local) * max(1, _int(parallel_config, "data_parallel_size_local", 1))

# SPDX-License-Identifier: Apache-2.0
"""Rank facts read from vLLM: a worker's position, and how many workers share its host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ascend_kv_testing.requires import require
from vllm_ascend.distributed.kv_transfer.core.ranks import (
    RankInfo,
    rank_info_from_vllm,
    workers_on_host,
)


def test_position_derived_from_the_global_rank_without_groups() -> None:
    cfg = SimpleNamespace(tensor_parallel_size=4, pipeline_parallel_size=2, rank=6,
                          data_parallel_rank=1)
    info = rank_info_from_vllm(cfg)
    assert (info.tp_rank, info.pp_rank, info.dp_rank, info.rank, info.world_size) == \
        (2, 1, 1, 6, 8)
    with pytest.raises(ValueError, match="tp_rank 4"):
        RankInfo(tp_rank=4, tp_size=4)


@pytest.mark.vllm
def test_workers_on_host_from_vllms_parallel_config() -> None:
    ParallelConfig = require("vllm.config", why="vLLM's own ParallelConfig").ParallelConfig

    assert workers_on_host(ParallelConfig(tensor_parallel_size=4,
                                          pipeline_parallel_size=2)) == 8
    assert workers_on_host(ParallelConfig()) == 1


def test_workers_on_host_counts_nodes_and_local_dp_replicas() -> None:
    assert workers_on_host(None) == 1
    # vLLM's local_world_size: the instance's ranks on this node
    assert workers_on_host(SimpleNamespace(local_world_size=4,
                                           data_parallel_size_local=2)) == 8
    # an older config without it: the instance's ranks over its nodes
    assert workers_on_host(SimpleNamespace(tensor_parallel_size=8, pipeline_parallel_size=2,
                                           nnodes=2)) == 8
    assert workers_on_host(SimpleNamespace(tensor_parallel_size=2)) == 2

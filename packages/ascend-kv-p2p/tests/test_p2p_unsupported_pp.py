# SPDX-License-Identifier: Apache-2.0
"""Pipeline parallelism the P/D connectors do not serve is refused at start-up with the key
named, never half-served: a pipeline-parallel D (both connectors), and a pipeline-parallel P
under the layerwise connector. (A pipeline-parallel P under MooncakeConnectorV1 is served:
``test_p2p_pipeline_parallel.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import (
    MooncakeLayerwiseConfig,
    MooncakeP2PConfig,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker


def _vllm_config(pp: int, role: str = "kv_consumer") -> SimpleNamespace:
    kvc = SimpleNamespace(kv_port=23456, is_kv_producer=role != "kv_consumer",
                          is_kv_consumer=role != "kv_producer", kv_connector_extra_config={})
    return SimpleNamespace(
        kv_transfer_config=kvc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0,
                                        pipeline_parallel_size=pp),
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(model="/models/tiny", get_total_num_kv_heads=lambda: 2))


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_a_pipeline_parallel_decode_instance_is_refused(role: str) -> None:
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2 is not supported") as info:
        PullWorker(_vllm_config(2, role), MooncakeP2PConfig.from_dict({"prefill": {"pp_size": 2}}),
                   "d", MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    assert info.value.key == "pipeline_parallel_size" and info.value.value == 2


def test_the_layerwise_connector_refuses_prefill_pp_size_above_one() -> None:
    with pytest.raises(ConfigError, match="prefill.pp_size must be 1") as info:
        MooncakeLayerwiseConfig.from_dict({"prefill": {"pp_size": 2, "pp_layer_partition": [4, 4]}})
    assert info.value.key.endswith("prefill.pp_size") and info.value.value == 2
    assert MooncakeLayerwiseConfig.from_dict({"prefill": {"pp_size": 1}}).prefill.pp_size == 1
    assert MooncakeP2PConfig.from_dict({"prefill": {"pp_size": 2}}).prefill.pp_size == 2

# SPDX-License-Identifier: Apache-2.0
"""The connector class: registration, namespace, roles, config errors, stats."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload as pkg
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError

SRC = Path(pkg.__file__).resolve().parents[5]


def test_namespace_levels_have_no_init_py() -> None:
    for level in ("vllm_ascend", "vllm_ascend/distributed", "vllm_ascend/distributed/kv_transfer",
                  "vllm_ascend/distributed/kv_transfer/kv_pool"):
        assert (SRC / level).is_dir()
        assert not (SRC / level / "__init__.py").exists(), level


def test_importing_the_package_stays_light() -> None:
    code = ("import sys; import vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload as p; "
            "print(p.CONNECTOR_NAME, 'vllm' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["CPUOffloadingConnector", "False", "False"]


def test_register_is_lazy_and_idempotent() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    pkg.register()
    assert "CPUOffloadingConnector" in KVConnectorFactory._registry
    assert pkg.register() == []
    cls = KVConnectorFactory._registry["CPUOffloadingConnector"]()
    from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_connector import (
        CPUOffloadingConnector,
    )

    assert cls is CPUOffloadingConnector


def test_the_plugin_entry_point_points_at_register() -> None:
    from importlib import metadata

    eps = {ep.name: ep for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert eps["ascend_cpu_offload"].load() is pkg.register
    config_eps = {ep.name: ep for ep in metadata.entry_points(group="vllm_ascend_kv.config")}
    from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.config import CPUOffloadConfig

    assert config_eps["CPUOffloadingConnector"].load() is CPUOffloadConfig


def test_roles_and_bad_config(make_vllm_config: Callable[..., Any]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_connector import (
        CPUOffloadingConnector,
    )

    sched = CPUOffloadingConnector(make_vllm_config({"rpc_timeout_s": 0.2}),
                                   KVConnectorRole.SCHEDULER, None)
    assert sched.requires_kv_delivery is False
    assert sched.reset_cache() is False, "no server: the reset reports failure, no exception"
    with pytest.raises(AssertionError, match="worker-side method"):
        sched.wait_for_layer_load("x")
    assert sched.get_kv_connector_stats() is not None, "the failed reset was counted"
    sched.shutdown()
    worker = CPUOffloadingConnector(make_vllm_config(), KVConnectorRole.WORKER, None)
    with pytest.raises(AssertionError, match="scheduler-side method"):
        worker.request_finished(object(), [])  # type: ignore[arg-type]
    assert worker.get_kv_connector_stats() is None
    worker.shutdown()
    with pytest.raises(ConfigError, match="swap_in_threshold: must be >= 0"):
        CPUOffloadingConnector(make_vllm_config({"swap_in_threshold": -1}),
                               KVConnectorRole.SCHEDULER, None)
    # the hybrid manager: full-attention and window groups served, a state group refused
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    from ascend_kv_testing.models import hybrid_kv_cache_config

    assert supports_hma(CPUOffloadingConnector)
    two = CPUOffloadingConnector(make_vllm_config(), KVConnectorRole.SCHEDULER,
                                 hybrid_kv_cache_config())
    assert two.connector_scheduler is not None and two.connector_scheduler.groups.hybrid
    two.shutdown()
    state = hybrid_kv_cache_config()
    state.kv_cache_groups[1] = KVCacheGroupSpec(
        ["model.layers.1.mixer"], MambaSpec(block_size=16, shapes=((16,),),
                                            dtypes=(torch.float32,)))
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=r"CPUOffloadingConnector moves the blocks of "
                                              r"full and sliding KV cache groups .*MambaSpec"):
            CPUOffloadingConnector(make_vllm_config(), role, state)
    one = CPUOffloadingConnector(make_vllm_config(), KVConnectorRole.SCHEDULER,
                                 hybrid_kv_cache_config(1))
    one.shutdown()


def test_stats_classmethods_round_trip() -> None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_connector import (
        CPUOffloadingConnector,
    )

    stats = CPUOffloadingConnector.build_kv_connector_stats(
        data={"counters": {"offload_hit_tokens": 32.0}, "gauges": {}, "histograms": {}})
    other = CPUOffloadingConnector.build_kv_connector_stats(
        data={"counters": {"offload_hit_tokens": 10.0}, "gauges": {}, "histograms": {}})
    assert stats.aggregate(other).reduce()["offload_hit_tokens"] == 42.0
    assert CPUOffloadingConnector.build_kv_connector_stats().is_empty()

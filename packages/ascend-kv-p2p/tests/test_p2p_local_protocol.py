# SPDX-License-Identifier: Apache-2.0
"""The P/D workers under transfer protocol ``local`` (no Mooncake engine, no port): a pull
worker with its KV cache in host memory registers it and advertises a ``local`` session with
its host and pid (what a same-host D reads it by); the layerwise connector (P writes into D)
and a KV cache in device memory are refused at start with a config error."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from p2p_worker_harness import numbered_caches, pd_vllm_config

from vllm_ascend.distributed.kv_transfer.core import local_protocol, local_reads, own_sockets
from vllm_ascend.distributed.kv_transfer.core import transfer_engine as te_mod
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p import worker_base
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import (
    MooncakeLayerwiseConfig,
    MooncakeP2PConfig,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.worker import LayerwiseWorker
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker

pytestmark = pytest.mark.skipif(not local_reads.available(),
                                reason="protocol local needs process_vm_readv (Linux)")


@pytest.fixture
def local_engine(monkeypatch: pytest.MonkeyPatch) -> te_mod.MooncakeTransferEngine:
    """This process's engine under protocol local (the real one is per process and may run
    tcp for the other tests): what ``get_transfer_engine`` hands the workers here."""
    engine = te_mod.MooncakeTransferEngine("127.0.0.1", "local")
    asked: list[Any] = []

    def get(host: str, protocol: str | None = None, **kw: Any) -> Any:
        asked.append(protocol)
        return engine

    monkeypatch.setattr(worker_base, "get_transfer_engine", get)
    engine.asked = asked  # type: ignore[attr-defined]
    return engine


def _caches() -> dict[str, Any]:
    return numbered_caches(True, layers=2, blocks=4, heads=2, block_size=16, head_size=8)


def test_the_protocol_option_accepts_local() -> None:
    assert MooncakeP2PConfig.from_dict({"protocol": "local"}).protocol == "local"
    with pytest.raises(ConfigError):
        MooncakeP2PConfig.from_dict({"protocol": "loopback"})


def test_a_pull_worker_advertises_a_local_session_and_opens_no_engine_port(
        local_engine: te_mod.MooncakeTransferEngine) -> None:
    before = own_sockets.listening_ports()
    p = PullWorker(pd_vllm_config("kv_producer", free_port(), block_size=16, heads=2),
                   MooncakeP2PConfig.from_dict({"protocol": "local"}), "P",
                   MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    try:
        p.register_kv_caches(_caches())
        assert local_engine.asked == ["local"]  # type: ignore[attr-defined]
        assert p.meta is not None
        assert local_protocol.is_local_session(p.meta.session)
        assert p.meta.session == local_engine.session_id
        assert (p.meta.local_host, p.meta.pid) == (local_reads.host_identity(), os.getpid())
        assert local_engine.registered_bytes > 0
        # the side channel is the one port this worker opened
        opened = own_sockets.listening_ports() - before
        assert opened == {p.port}, opened
    finally:
        p.shutdown()
    assert local_engine.registered_bytes == 0


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_the_layerwise_connector_is_refused(local_engine: te_mod.MooncakeTransferEngine,
                                            role: str) -> None:
    w = LayerwiseWorker(pd_vllm_config(role, free_port(), block_size=16, heads=2),
                        MooncakeLayerwiseConfig.from_dict({"protocol": "local"}), "L",
                        MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    try:
        with pytest.raises(ConfigError, match="does not\\s+write into them"):
            w.register_kv_caches(_caches())
        assert local_engine.registered_bytes == 0
    finally:
        w.shutdown()


def test_a_kv_cache_in_device_memory_is_refused(
        local_engine: te_mod.MooncakeTransferEngine) -> None:
    caches = _caches()
    # what an NPU cache looks like to the check: a tensor whose device is not the CPU
    fake = type("NpuTensor", (torch.Tensor,), {"device": property(
        lambda self: torch.device("meta"))})
    caches = {k: t.as_subclass(fake) for k, t in caches.items()}
    p = PullWorker(pd_vllm_config("kv_producer", free_port(), block_size=16, heads=2),
                   MooncakeP2PConfig.from_dict({"protocol": "local"}), "P",
                   MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    try:
        with pytest.raises(ConfigError, match="cannot move a KV cache in device memory"):
            p.register_kv_caches(caches)
        assert local_engine.registered_bytes == 0
    finally:
        p.shutdown()

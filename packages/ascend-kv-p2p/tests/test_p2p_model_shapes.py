# SPDX-License-Identifier: Apache-2.0
"""Model shapes at worker level: MLA caches as vLLM CPU hands them to connectors, and the
shapes both P/D connectors must refuse at start-up rather than serve wrong.

The real-engine side of these shapes is ``tests-e2e/test_mla_e2e.py``; the table of what
is tested where is ``docs/model-shapes.md``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ascend_kv_testing.models import hybrid_kv_cache_config
from vllm_ascend.distributed.kernels.heads import HeadSlice
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.core.kv_groups import MOVABLE_KINDS
from vllm_ascend.distributed.kv_transfer.core.layout import KVCacheLayout
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import (
    MooncakeLayerwiseConfig,
    MooncakeP2PConfig,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.errors import HandshakeMismatchError
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.worker import LayerwiseWorker
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import RecvMeta
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.transfer import read_request
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker
from vllm_ascend.distributed.kv_transfer.kv_p2p.worker_base import (
    _latent_view,
    head_slices,
    refuse_unsupported_shapes,
)

BS, NB, LATENT = 16, 8, 576


def vllm_config(*, use_mla: bool = False, heads: int = 4, role: str = "kv_consumer",
                **parallel: Any) -> Any:
    kvc = SimpleNamespace(kv_port=23456, is_kv_producer=role == "kv_producer",
                          is_kv_consumer=role == "kv_consumer", kv_connector_extra_config={})
    par = dict(tensor_parallel_size=1, data_parallel_rank=0, pipeline_parallel_size=1)
    par.update(parallel)
    return SimpleNamespace(
        kv_transfer_config=kvc, parallel_config=SimpleNamespace(**par),
        cache_config=SimpleNamespace(block_size=BS),
        model_config=SimpleNamespace(model="/models/tiny", use_mla=use_mla,
                                     get_total_num_kv_heads=lambda: heads))


def cpu_mla_caches() -> dict[str, torch.Tensor]:
    """What vLLM CPU's MLA backends hand a connector: ``(blocks, 1, block_size, latent)``."""
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(NB, 1, BS, LATENT,
                                                            dtype=torch.bfloat16)
            for i in range(2)}


class RecordingEngine:
    """A transfer engine that records the ranges it is asked to read."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int, int]] = []

    def read(self, peer: str, local: list[int], remote: list[int], lengths: list[int], *,
             merged: bool = False) -> int:
        self.ranges += list(zip(local, remote, lengths, strict=True))
        return sum(lengths)


def remote_like(layout: KVCacheLayout) -> Any:
    """P's AgentMeta for a P with the same layout (at other addresses)."""
    return SimpleNamespace(session="p:1", layout=layout.descriptor(),
                           region_addrs=[r.base_addr + (1 << 40) for r in layout.regions],
                           region_strides=[r.block_stride for r in layout.regions])


def test_an_mla_worker_holds_one_latent_head_whatever_the_model_says() -> None:
    worker = PullWorker(vllm_config(use_mla=True, heads=4), MooncakeP2PConfig(), "d",
                        MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    assert worker.is_mla and worker.total_kv_heads == 1
    plain = PullWorker(vllm_config(heads=4), MooncakeP2PConfig(), "d",
                       MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    assert not plain.is_mla and plain.total_kv_heads == 4


def test_a_cpu_mla_cache_is_described_as_a_latent_and_read_once_per_block() -> None:
    caches = {n: _latent_view(t) for n, t in cpu_mla_caches().items()}
    layout = KVCacheLayout.from_kv_caches(caches, block_size=BS)
    assert layout.is_mla and all(r.head_axis is None for r in layout.regions)
    block_len = BS * LATENT * 2
    assert all(r.block_len == block_len for r in layout.regions)
    te = RecordingEngine()
    # D's blocks in the opposite order of P's, as vLLM's free list hands them out
    meta = RecvMeta("r", local_block_ids=[5, 4, 3], remote=None, remote_block_ids=[1, 2, 3])
    plan = head_slices(1, 1, 1, 0, is_mla=True)
    moved = read_request(te, layout, meta, {0: remote_like(layout)}, plan)  # type: ignore[arg-type]
    assert moved == 3 * 2 * block_len  # one copy of the latent a block and layer
    for region in layout.regions:
        mine = sorted(loc - region.base_addr for loc, _, _ in te.ranges
                      if region.base_addr <= loc < region.base_addr + NB * block_len)
        assert mine == [3 * block_len, 4 * block_len, 5 * block_len]


def test_a_plan_of_more_heads_than_a_block_holds_is_refused_not_read() -> None:
    """The CPU MLA shape described as a one-head cache with the model's 4 heads planned
    (what happened before MLA was recognised): each read would have covered 4 blocks."""
    layout = KVCacheLayout.from_kv_caches(cpu_mla_caches(), block_size=BS)
    assert not layout.is_mla  # shape alone cannot tell: the worker passes the latent view
    te = RecordingEngine()
    meta = RecvMeta("r", local_block_ids=[5, 4], remote=None, remote_block_ids=[1, 2])
    plan = [HeadSlice(remote_rank=0, local_offset=0, remote_offset=0, num_heads=4)]
    with pytest.raises(HandshakeMismatchError, match="more than the 1 KV heads"):
        read_request(te, layout, meta, {0: remote_like(layout)}, plan)  # type: ignore[arg-type]
    assert te.ranges == []


# ---------------------------------------------------------------- refused at start-up
WORKERS = [(PullWorker, MooncakeP2PConfig), (LayerwiseWorker, MooncakeLayerwiseConfig)]


@pytest.mark.parametrize("key", ["decode_context_parallel_size",
                                 "prefill_context_parallel_size"])
@pytest.mark.parametrize(("worker", "cfg"), WORKERS)
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_context_parallelism_is_refused_naming_key_and_value(worker: Any, cfg: Any, key: str,
                                                              role: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}=2 is not supported") as info:
        worker(vllm_config(role=role, **{key: 2}), cfg(), "e", MetricsRecorder(P2P_METRICS),
               tp_rank=0, pp_rank=0)
    assert info.value.key == key and info.value.value == 2


def test_more_than_one_kv_cache_group_is_refused_naming_the_groups() -> None:
    with pytest.raises(ConfigError, match="has 2") as info:
        refuse_unsupported_shapes(vllm_config(), hybrid_kv_cache_config(), "X")
    text = str(info.value)
    assert "FullAttentionSpec [model.layers.0.self_attn.attn, model.layers.2" in text
    assert "SlidingWindowSpec(sliding_window=128) [model.layers.1" in text
    assert "--disable-hybrid-kv-cache-manager" in text
    refuse_unsupported_shapes(vllm_config(), hybrid_kv_cache_config(1), "X")  # one group: ok


def _state_space_kv_cache_config() -> Any:
    """A hybrid state-space model's groups: a Mamba state group beside full attention."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    full = hybrid_kv_cache_config(1).kv_cache_groups[0]
    mamba = MambaSpec(block_size=BS, shapes=((16,),), dtypes=(torch.float32,))
    return KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[
        full, KVCacheGroupSpec(["model.layers.1.self_attn.attn"], mamba)])


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_the_layerwise_connector_refuses_a_state_space_group_at_start_up(role: str) -> None:
    """Full-attention and sliding-window groups are pushed (tests-e2e/test_hybrid_e2e.py); a
    state group (Mamba, linear attention), rewritten as the prompt goes on, is not, and is
    refused naming it. The pull moves it (below)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise import (
        connector as layerwise_connector,
    )

    with pytest.raises(ConfigError, match=r"MambaSpec.*--disable-hybrid-kv-cache-manager"):
        layerwise_connector.MooncakeLayerwiseConnector(
            vllm_config(), getattr(KVConnectorRole, role), _state_space_kv_cache_config())
    refuse_unsupported_shapes(vllm_config(), _state_space_kv_cache_config(), "X",
                              groups_ok=True, kinds=MOVABLE_KINDS)  # the pull's kinds
    with pytest.raises(ConfigError, match="MambaSpec"):
        refuse_unsupported_shapes(vllm_config(), _state_space_kv_cache_config(), "X",
                                  groups_ok=True)  # by default: the token kinds


def test_both_p2p_connectors_serve_the_hybrid_kv_cache_manager() -> None:
    """vLLM keeps its hybrid KV cache manager on only for a connector with ``SupportsHMA``;
    both move every full-attention and sliding-window group."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise import (
        connector as layerwise_connector,
    )
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import connector as pull_connector

    assert issubclass(layerwise_connector.MooncakeLayerwiseConnector, SupportsHMA)
    assert issubclass(pull_connector.MooncakeConnector, SupportsHMA)
    refuse_unsupported_shapes(vllm_config(), hybrid_kv_cache_config(), "X", groups_ok=True)

# SPDX-License-Identifier: Apache-2.0
"""Rank layouts, options and errors of parallel_state, in one process."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vllm_ascend.distributed import parallel_state as ps
from vllm_ascend.distributed.device_communicators import __version__
from vllm_ascend.distributed.device_communicators.errors import (
    DistributedNotInitializedError,
    GroupNotInitializedError,
    ParallelLayoutError,
)


def test_version() -> None:
    assert __version__


@pytest.mark.parametrize("prefill,decode,heads,mla,want", [
    (2, 1, 8, False, (2, 2, 1)),
    (4, 2, 8, False, (2, 2, 1)),
    (8, 2, 4, False, (4, 2, 2)),   # more P ranks than KV heads: heads replicated twice
    (8, 1, 2, False, (8, 2, 4)),
    (4, 4, 8, False, (1, 1, 1)),
    (2, 4, 8, False, (1, 1, 1)),   # D TP > P TP: D selects its heads, no P-side group
    (8, 2, 0, True, (1, 1, 1)),    # MLA: the latent is not split by heads
])
def test_pd_ratios(prefill: int, decode: int, heads: int, mla: bool,
                   want: tuple[int, int, int]) -> None:
    assert ps.pd_ratios(prefill, decode, heads, is_mla=mla) == want


def test_pd_ratio_errors() -> None:
    with pytest.raises(ParallelLayoutError, match="prefill tp_size 3 and decode tp_size 2"):
        ps.pd_ratios(3, 2, 8)
    with pytest.raises(ParallelLayoutError, match="decode tp_size must be a positive int"):
        ps.pd_ratios(2, 0, 8)
    with pytest.raises(ParallelLayoutError, match="KV head count"):
        ps.pd_ratios(4, 2, 0)


def test_rank_layout_checks() -> None:
    with pytest.raises(ParallelLayoutError, match="not a multiple of dp"):
        ps.RankLayout(6, tp=4)
    with pytest.raises(ParallelLayoutError, match="tp must be a positive int"):
        ps.RankLayout(4, tp=0)
    lay = ps.RankLayout.from_parallel_config(
        SimpleNamespace(tensor_parallel_size=2, data_parallel_size=2, pipeline_parallel_size=2),
        world_size=8)
    assert (lay.dp, lay.pp, lay.pcp, lay.tp) == (2, 2, 1, 2)
    assert lay.all_ranks().shape == (1, 2, 2, 1, 2)


def test_p_tp_groups() -> None:
    assert ps.p_tp_group_ranks(ps.RankLayout(4, tp=4), 2) == [[0, 1], [2, 3]]
    assert ps.p_tp_group_ranks(ps.RankLayout(8, dp=2, tp=4), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # TP 8, 4 KV heads (2 replicas each), decode TP 2: ranks 0,2 hold heads 0,1 -> D rank 0
    assert ps.p_tp_group_ranks(ps.RankLayout(8, tp=8), 4, 2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    with pytest.raises(ParallelLayoutError, match="pd_tp_ratio 3"):
        ps.p_tp_group_ranks(ps.RankLayout(4, tp=4), 3)
    with pytest.raises(ParallelLayoutError, match="num_head_replica 3"):
        ps.p_tp_group_ranks(ps.RankLayout(8, tp=8), 2, 3)


def test_mc2_and_fine_grained_groups() -> None:
    lay = ps.RankLayout(8, dp=2, pp=2, tp=2)  # ranks (dp, pp, tp)
    assert ps.mc2_group_ranks(lay) == [[0, 1, 4, 5], [2, 3, 6, 7]]  # one group a PP stage
    assert ps.mc2_group_ranks(ps.RankLayout(4, tp=2)) == [[0, 1], [2, 3]]  # external DP
    lay = ps.RankLayout(8, dp=4, tp=2)
    assert ps.finegrained_tp_group_ranks(lay, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ps.finegrained_tp_group_ranks(lay, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ParallelLayoutError, match="fine-grained TP size 3"):
        ps.finegrained_tp_group_ranks(lay, 3)


def test_flashcomm2_and_shard_weight_groups() -> None:
    lay = ps.RankLayout(8, dp=2, tp=4)
    otp, odp = ps.flashcomm2_group_ranks(lay, 2)
    assert otp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert odp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ParallelLayoutError, match="o_proj TP size 3"):
        ps.flashcomm2_group_ranks(lay, 3)
    # replicated module: one group a PP stage; TP module: the same TP rank across DP
    pp_lay = ps.RankLayout(4, pp=2, tp=2)  # ranks (pp, tp): stage 0 = 0,1; stage 1 = 2,3
    assert ps.shard_weight_group_ranks(pp_lay, None) == [[0, 1], [2, 3]]
    dp_lay = ps.RankLayout(8, dp=2, tp=4)
    assert ps.shard_weight_group_ranks(dp_lay, None) == [list(range(8))]
    assert ps.shard_weight_group_ranks(dp_lay, [[0, 1, 2, 3], [4, 5, 6, 7]]) == [
        [0, 4], [1, 5], [2, 6], [3, 7]]


def test_options_from_vllm_config() -> None:
    model = SimpleNamespace(is_deepseek_mla=False, get_total_num_kv_heads=lambda: 4)
    kv = SimpleNamespace(is_kv_producer=True, kv_connector_extra_config={
        "prefill": {"tp_size": 8}, "decode": {"tp_size": 2}})
    cfg = SimpleNamespace(model_config=model, kv_transfer_config=kv, additional_config={
        "multistream_overlap_gate": True, "eplb_config": {"dynamic_eplb": True},
        "finegrained_tp_config": {"lmhead_tensor_parallel_size": 2},
        "layer_sharding": ["o_proj"], "flashcomm2_oproj_tensor_parallel_size": 2})
    opts = ps.AscendParallelOptions.from_vllm_config(cfg)
    assert (opts.pd_tp_ratio, opts.pd_head_ratio, opts.num_head_replica) == (4, 2, 2)
    assert opts.is_kv_producer and opts.multistream_overlap_gate and opts.dynamic_eplb
    assert opts.lmhead_tensor_parallel_size == 2 and opts.oproj_tensor_parallel_size == 0
    assert opts.layer_sharding and opts.flashcomm2_oproj_tensor_parallel_size == 2
    bare = ps.AscendParallelOptions.from_vllm_config(
        SimpleNamespace(model_config=None, kv_transfer_config=None, additional_config=None))
    assert bare == ps.AscendParallelOptions()
    mla = SimpleNamespace(model_config=SimpleNamespace(is_deepseek_mla=True),
                          kv_transfer_config=kv, additional_config={})
    assert ps.AscendParallelOptions.from_vllm_config(mla).pd_head_ratio == 1


@pytest.mark.parametrize("getter", [
    ps.get_mc2_group, ps.get_mlp_tp_group, ps.get_otp_group, ps.get_lmhead_tp_group,
    ps.get_embed_tp_group, ps.get_flashcomm2_otp_group, ps.get_flashcomm2_odp_group,
    ps.get_shard_weight_group, ps.get_p_tp_group, ps.get_fc3_quant_x_group,
    ps.get_dynamic_eplb_group, ps.get_mlp_tensor_model_parallel_world_size,
])
def test_getters_before_init_raise(getter) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(GroupNotInitializedError, match="not initialized"):
        getter()
    with pytest.raises(AssertionError):  # upstream's getters assert; callers may catch that
        getter()
    assert not ps.model_parallel_initialized()


def test_creating_groups_needs_a_distributed_world() -> None:
    pc = SimpleNamespace(tensor_parallel_size=2)
    with pytest.raises(DistributedNotInitializedError, match="init_process_group"):
        ps.init_ascend_model_parallel(pc)
    with pytest.raises(DistributedNotInitializedError):
        ps.init_p_tp_group(pc, 2)
    ps.destroy_ascend_model_parallel()  # nothing to destroy: a no-op


def test_importing_needs_neither_vllm_nor_torch_npu() -> None:
    code = ("import sys\n"
            "import vllm_ascend.distributed.parallel_state, vllm_ascend.distributed.utils\n"
            "import vllm_ascend.distributed.device_communicators.npu_communicator\n"
            "bad = [m for m in ('vllm', 'torch_npu') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_layout_tensor_is_plain_torch() -> None:
    assert torch.equal(ps.RankLayout(2, tp=2).all_ranks().flatten(), torch.arange(2))

# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``kv_transfer/utils``: ``GlobalTE`` over core's engine and the P/D helpers."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from vllm_ascend.distributed.kv_transfer.core import transfer_engine as core_te
from vllm_ascend.distributed.kv_transfer.utils import mooncake_transfer_engine as mte
from vllm_ascend.distributed.kv_transfer.utils import utils as pd


def test_global_te_is_cores_engine_and_registers_once() -> None:
    te = mte.GlobalTE()
    with pytest.raises(RuntimeError, match="must be initialized"):
        te.register_buffer([1], [1])
    raw = te.get_transfer_engine("127.0.0.1", None)
    assert te.get_transfer_engine("127.0.0.1", "") is raw
    wrapper = core_te.peek_transfer_engine()
    assert wrapper is not None and te.engine is wrapper and raw is wrapper.raw
    assert raw.get_rpc_port() == wrapper.rpc_port  # upstream callers use the raw engine
    # the module singleton shares the same process engine
    assert mte.global_te.get_transfer_engine("127.0.0.1", None) is raw

    buf = torch.zeros(4096, dtype=torch.uint8)
    extra = torch.zeros(1024, dtype=torch.uint8)
    before = wrapper.registrations
    try:
        te.register_buffer([buf.data_ptr()], [buf.numel()])
        te.register_buffer([buf.data_ptr()], [buf.numel()])  # once a process: a no-op
        assert te.is_register_buffer and wrapper.registrations == before + 1
        te.register_additional_buffer([extra.data_ptr()] * 2, [extra.numel()] * 2)
        assert wrapper.registrations == before + 2
        with pytest.raises(ValueError, match="2 pointers but 1 sizes"):
            te.register_additional_buffer([1, 2], [3])
    finally:
        wrapper.unregister_memory(buf.data_ptr(), buf.numel())
        wrapper.unregister_memory(extra.data_ptr(), extra.numel())
    assert wrapper.registrations == before


def test_transfer_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ASCEND_TRANSFER_TIMEOUT", "HCCL_RDMA_TIMEOUT", "HCCL_RDMA_RETRY_CNT"):
        monkeypatch.delenv(name, raising=False)
    assert pd.get_transfer_timeout_value() == int(4.096 * 2**20 * 7 // 1000 + 3000) == 33064
    monkeypatch.setenv("HCCL_RDMA_TIMEOUT", "18")
    monkeypatch.setenv("HCCL_RDMA_RETRY_CNT", "3")
    assert pd.get_transfer_timeout_value() == int(4.096 * 2**18 * 3 // 1000 + 3000)
    monkeypatch.setenv("ASCEND_TRANSFER_TIMEOUT", "1234")
    assert pd.get_transfer_timeout_value() == 1234
    monkeypatch.setenv("ASCEND_TRANSFER_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="ASCEND_TRANSFER_TIMEOUT='soon'"):
        pd.get_transfer_timeout_value()


def test_align_memory() -> None:
    t = torch.zeros(1024, dtype=torch.float32)
    view = pd.align_memory(t[1:], 64)
    assert view.data_ptr() % 64 == 0 and view.data_ptr() >= t[1:].data_ptr()
    assert view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert pd.align_memory(view, 64).data_ptr() == view.data_ptr()
    raw = torch.zeros(64, dtype=torch.uint8)
    odd = raw[1:].view(torch.uint8)
    with pytest.raises(ValueError, match="positive"):
        pd.align_memory(odd, 0)


def test_cp_group_and_check() -> None:
    assert pd.get_cp_group(8, 4, 2) == [[0, 1, 2, 3]]
    assert pd.get_cp_group(8, 4, 1) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert pd.get_cp_group(4, 8, 2) == [[0, 1]]
    p = pd.parallel_info(tp_size=4, pcp_size=2, dcp_size=2, use_mla=False, pd_head_ratio=1)
    d = pd.parallel_info(tp_size=2, pcp_size=1, dcp_size=2, use_mla=False, pd_head_ratio=1)
    pd.context_parallel_parameters_check(1, 2, p, d, total_num_kv_heads=8)
    with pytest.raises(AssertionError, match="not a multiple of the remote pcp\\*dcp = 3"):
        pd.context_parallel_parameters_check(1, 3, p, d, total_num_kv_heads=8)
    d_bad = pd.parallel_info(tp_size=2, pcp_size=1, dcp_size=8, use_mla=False, pd_head_ratio=1)
    with pytest.raises(ValueError, match="D holds 1 KV heads a rank, not a multiple of P's 2"):
        pd.context_parallel_parameters_check(1, 2, p, d_bad, total_num_kv_heads=8)


def test_head_mappings() -> None:
    assert pd.get_tp_rank_head_mapping(8, 4) == {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}
    assert pd.get_tp_rank_head_mapping(2, 4) == {0: [0], 1: [0], 2: [1], 3: [1]}
    with pytest.raises(ValueError, match="3 KV heads|cannot be split"):
        pd.get_tp_rank_head_mapping(3, 2)
    assert pd.get_head_group_mapping(8, 4, 2, [0, 1]) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert pd.get_head_group_mapping(2, 4, 4, [1, 2]) == {1: [0], 2: [1]}
    with pytest.raises(ValueError, match="cannot be divided by the number of groups"):
        pd.get_head_group_mapping(8, 4, 3, [0])


def test_upstream_only_planners_say_why() -> None:
    for fn in (pd.get_local_remote_block_port_mappings, pd.get_transfer_mappings):
        with pytest.raises(NotImplementedError, match="kv_p2p.worker_base.head_slices"):
            fn()


def test_alltoall_reexports(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        dist_utils = importlib.import_module("vllm_ascend.distributed.utils")
    except ImportError:
        dist_utils = None
    if dist_utils is not None:  # present when the [dist-utils] extra is installed
        assert pd.kv_alltoall_and_rearrange is dist_utils.kv_alltoall_and_rearrange
        assert pd.rearrange_output is dist_utils.rearrange_output
    monkeypatch.setitem(sys.modules, "vllm_ascend.distributed.utils", None)
    with pytest.raises(ImportError, match=r"ascend-kv-p2p\[dist-utils\]"):
        pd.kv_alltoall_and_rearrange  # noqa: B018
    with pytest.raises(AttributeError):
        pd.no_such_helper  # noqa: B018

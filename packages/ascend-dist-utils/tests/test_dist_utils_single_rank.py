# SPDX-License-Identifier: Apache-2.0
"""Collectives and the communicator on a one-rank gloo world in the test process."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from vllm_ascend.distributed import utils
from vllm_ascend.distributed.device_communicators import npu_communicator as nc
from vllm_ascend.distributed.device_communicators.errors import SplitSizeError, VllmUnavailableError


def test_all_to_all_single_rank(single_rank_world: None) -> None:
    x = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(nc.all_to_all(x, scatter_dim=0, gather_dim=-1), x)
    assert torch.equal(nc.all_to_all(x, scatter_dim=1, gather_dim=0, scatter_sizes=[4],
                                     gather_sizes=[3]), x)
    with pytest.raises(SplitSizeError, match="sum to 3"):
        nc.all_to_all(x, scatter_dim=1, gather_dim=0, scatter_sizes=[3], gather_sizes=[3])
    with pytest.raises(SplitSizeError, match="non-negative"):
        nc.all_to_all(x, scatter_sizes=[-3], gather_sizes=[3])
    with pytest.raises(SplitSizeError, match="scatter_dim=2"):
        nc.all_to_all(x, scatter_dim=2)


def test_all_gather_async_single_rank(single_rank_world: None) -> None:
    x = torch.ones(2, 3)
    assert utils.all_gather_async(x, None) == (x, None)  # upstream: world 1 returns the input


@pytest.fixture
def npu_comm_cls_then_fake(request: pytest.FixtureRequest) -> Any:
    """Import vLLM (and transformers) and build the class first, then install the fake torch_npu."""
    import vllm.config  # noqa: F401 - the communicator's base imports it lazily

    cls = nc.NPUCommunicator
    request.getfixturevalue("fake_torch_npu")
    return cls


def test_npu_communicator_on_cpu(single_rank_world: None, npu_comm_cls_then_fake: Any) -> None:
    import torch.distributed as dist

    assert sys.modules["torch_npu"].__fake__
    group = dist.new_group([0], backend="gloo")
    comm = nc.NPUCommunicator(cpu_group=group, device=torch.device("cpu"), device_group=group,
                              unique_name="npu_comm_test")
    # torch.npu exists (the fake) but this torch has no NPU device type: the device stays CPU
    assert comm.device == torch.device("cpu") and comm.ca_comm is None
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(comm.all_to_all(x, 0, -1), x)
    assert type(comm).__name__ == "NPUCommunicator"
    assert type(comm).__module__ == nc.__name__


def test_npu_communicator_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(nc.__dict__, "NPUCommunicator", raising=False)
    monkeypatch.setitem(sys.modules,
                        "vllm.distributed.device_communicators.base_device_communicator", None)
    with pytest.raises(VllmUnavailableError, match="NPUCommunicator needs vLLM"):
        nc.NPUCommunicator  # noqa: B018 - the attribute access builds the class
    with pytest.raises(AttributeError):
        nc.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018


def test_rearrange_and_kv_alltoall_checks() -> None:
    base = torch.arange(24.0).reshape(4, 2, 3)
    out = utils.rearrange_output(base, 2, 2)
    assert torch.equal(out[1].flatten(), base[2].flatten())  # token 0 of chunk 1 follows chunk 0's
    with pytest.raises(SplitSizeError, match=r"\[4\] must be divisible by the cut_num \[3\]"):
        utils.rearrange_output(base, 3, 2)
    assert utils.kv_alltoall_and_rearrange(1, None, None) == (None, None)
    with pytest.raises(ValueError, match="key or value is None"):
        utils.kv_alltoall_and_rearrange(2, base, None)


def test_fc3_outside_a_forward_pass_returns_x() -> None:
    x = torch.ones(3, 2)
    assert utils.fc3_all_gather_and_maybe_unpad_impl(x) is x

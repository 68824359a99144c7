# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_ascend.distributed.kv_transfer.core import device as dev
from vllm_ascend.distributed.kv_transfer.core.errors import DependencyError


def test_cpu_device_streams_and_events() -> None:
    d = dev.get_device("cpu")
    s = d.new_stream()
    with d.stream(s):
        x = torch.ones(4) * 2
    e = d.record_event(s)
    e.synchronize()
    assert e.query() and x.sum().item() == 8
    d.synchronize()
    assert d.default_protocol == "tcp" and d.torch_device == torch.device("cpu")
    assert dev.device_of(torch.zeros(1)).kind == "cpu"


def test_detection_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dev.DEVICE_ENV, "cpu")
    assert dev.detect_device_kind() == "cpu"
    monkeypatch.setenv(dev.DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match="tpu"):
        dev.detect_device_kind()


def test_npu_device_without_torch_npu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    with pytest.raises(DependencyError, match=r"ascend-kv-core\[npu\]"):
        dev.NpuDevice(0)


def test_npu_device_with_fake_torch_npu(fake_torch_npu: Any) -> None:
    d = dev.NpuDevice(1)
    d.set_device()
    assert fake_torch_npu.npu.current_device() == 1
    s = d.new_stream()
    with d.stream(s):
        pass
    assert d.record_event(s).query()
    d.synchronize()
    assert d.default_protocol == "ascend"

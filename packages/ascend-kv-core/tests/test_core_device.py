# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import os
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


def test_cuda_device_calls_through_to_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaDevice on a machine without CUDA: torch.cuda is replaced by a recorder."""
    import contextlib

    calls: list[tuple[Any, ...]] = []

    class Event:
        def record(self, stream: Any = None) -> None:
            calls.append(("event.record", stream))

        def query(self) -> bool:
            return True

    class Stream:
        def __init__(self, device: Any = None) -> None:
            calls.append(("Stream", device))
            self.device = device

    @contextlib.contextmanager
    def stream(s: Any) -> Any:
        calls.append(("stream enter", s))
        yield s
        calls.append(("stream exit", s))

    current = Stream(device="current")
    calls.clear()
    fake = {
        "set_device": lambda i: calls.append(("set_device", i)),
        "Stream": Stream,
        "current_stream": lambda i=None: calls.append(("current_stream", i)) or current,
        "stream": stream,
        "Event": lambda: calls.append(("Event",)) or Event(),
        "synchronize": lambda i=None: calls.append(("synchronize", i)),
    }
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value)

    d = dev.CudaDevice(3)
    assert d.kind == "cuda" and d.default_protocol == "rdma"
    assert d.torch_device == torch.device("cuda", 3)
    d.set_device()
    s = d.new_stream()
    assert isinstance(s, Stream) and s.device == 3
    assert d.current_stream() is current
    with d.stream(s) as entered:
        assert entered is s
    e = d.record_event(s)
    assert e.query()
    d.record_event()  # on the current stream
    d.synchronize()
    with dev.maybe_stream(d, None) as on:
        assert on is current
    assert calls == [
        ("set_device", 3), ("Stream", 3), ("current_stream", 3),
        ("stream enter", s), ("stream exit", s),
        ("Event",), ("event.record", s),
        ("Event",), ("current_stream", 3), ("event.record", current),
        ("synchronize", 3), ("current_stream", 3),
    ]
    assert dev._DEVICES["cuda"] is dev.CudaDevice


def test_usable_cpus_follows_this_threads_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert dev.usable_cpus() == 1  # an engine pinned to one core
    monkeypatch.delattr(os, "sched_getaffinity")  # not Linux: the machine's count
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert dev.usable_cpus() == 6


def test_available_host_memory_is_the_lower_of_meminfo_and_the_cgroup_limit(tmp_path: Any) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    2000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert dev.available_host_memory(str(meminfo), str(cg)) == 2000000 * 1024  # no cgroup
    (cg / "memory.max").write_text("max\n")
    assert dev.available_host_memory(str(meminfo), str(cg)) == 2000000 * 1024  # no limit
    (cg / "memory.max").write_text(f"{1 << 30}\n")
    (cg / "memory.current").write_text(f"{768 << 20}\n")
    assert dev.available_host_memory(str(meminfo), str(cg)) == 256 << 20  # the limit's room
    assert dev.available_host_memory(str(tmp_path / "none"), str(cg)) == 256 << 20
    assert dev.available_host_memory(str(tmp_path / "none"), str(tmp_path / "none")) is None
    real = dev.available_host_memory()  # this Linux machine has /proc/meminfo
    assert real is not None and real > 0


def test_total_host_memory_is_the_lower_of_memtotal_and_the_cgroup_limit(tmp_path: Any) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    2000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert dev.total_host_memory(str(meminfo), str(cg)) == 24000000 * 1024  # no cgroup
    (cg / "memory.max").write_text("max\n")
    assert dev.total_host_memory(str(meminfo), str(cg)) == 24000000 * 1024
    (cg / "memory.max").write_text(f"{1 << 30}\n")
    (cg / "memory.current").write_text(f"{768 << 20}\n")  # in use: not subtracted
    assert dev.total_host_memory(str(meminfo), str(cg)) == 1 << 30
    assert dev.total_host_memory(str(tmp_path / "none"), str(tmp_path / "none")) is None
    real = dev.total_host_memory()
    avail = dev.available_host_memory()
    assert real is not None and avail is not None and real >= avail

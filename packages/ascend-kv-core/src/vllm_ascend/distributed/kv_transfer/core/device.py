# SPDX-License-Identifier: Apache-2.0
"""The device layer: one interface over NPU, CUDA and CPU.

Connectors never call ``torch.npu`` or ``torch.cuda`` directly; they ask
:func:`get_device` for a :class:`Device` and use its streams, events and
``synchronize``. ``torch_npu`` is imported only inside :class:`NpuDevice`, so
importing this module needs no hardware. On CPU, streams and events exist
with the same methods but work is synchronous: an event is complete as soon
as it is recorded.

The NPU implementation is checked by reading and against the fake
``torch_npu`` of the test-support package; no CI machine has an NPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from .errors import DependencyError

logger = logging.getLogger(__name__)

DEVICE_ENV = "VLLM_ASCEND_KV_DEVICE"


class CpuEvent:
    """Event with the torch event interface; CPU work is synchronous, so always complete."""

    def record(self, stream: Any = None) -> None:
        """Record (no-op on CPU)."""

    def synchronize(self) -> None:
        """Wait (nothing to wait for on CPU)."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` wait (no-op on CPU)."""


class CpuStream:
    """Stream with the torch stream interface; runs work in order, synchronously."""

    def synchronize(self) -> None:
        """Wait for queued work (none on CPU)."""

    def wait_event(self, event: Any) -> None:
        """Order after ``event`` (already complete on CPU)."""

    def wait_stream(self, stream: Any) -> None:
        """Order after ``stream`` (already done on CPU)."""

    def query(self) -> bool:
        """Always idle."""
        return True

    def record_event(self, event: Any = None) -> CpuEvent:
        """Record an event on this stream."""
        return event if event is not None else CpuEvent()


class Device(ABC):
    """Streams, events and synchronisation of one accelerator (or the CPU)."""

    kind: ClassVar[str]
    #: Mooncake transfer-engine protocol used by default on this device.
    default_protocol: ClassVar[str]

    def __init__(self, index: int = 0) -> None:
        self.index = index

    @property
    def torch_device(self) -> torch.device:
        """The ``torch.device`` of this device."""
        return torch.device(self.kind, self.index) if self.kind != "cpu" else torch.device("cpu")

    @abstractmethod
    def set_device(self) -> None:
        """Make this device current for the calling thread."""

    @abstractmethod
    def new_stream(self) -> Any:
        """A new stream (for loads or saves that overlap the forward pass)."""

    @abstractmethod
    def current_stream(self) -> Any:
        """The stream work is currently queued on."""

    @abstractmethod
    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context manager that queues work on ``stream``."""

    @abstractmethod
    def new_event(self) -> Any:
        """A new, unrecorded event."""

    def record_event(self, stream: Any = None) -> Any:
        """Record a new event on ``stream`` (default: the current stream) and return it."""
        event = self.new_event()
        event.record(stream if stream is not None else self.current_stream())
        return event

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until all queued work on the device is done."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind}:{self.index})"


class CpuDevice(Device):
    """The CPU: synchronous streams, always-complete events."""

    kind = "cpu"
    default_protocol = "tcp"

    def set_device(self) -> None:
        """Nothing to select on CPU."""

    def new_stream(self) -> CpuStream:
        return CpuStream()

    def current_stream(self) -> CpuStream:
        return CpuStream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)

    def new_event(self) -> CpuEvent:
        return CpuEvent()

    def synchronize(self) -> None:
        """Nothing is queued on CPU."""


class CudaDevice(Device):
    """A CUDA GPU through ``torch.cuda``."""

    kind = "cuda"
    default_protocol = "rdma"

    def set_device(self) -> None:
        torch.cuda.set_device(self.index)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.index)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.index)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)


class NpuDevice(Device):
    """An Ascend NPU through ``torch_npu`` (imported here and nowhere else in core)."""

    kind = "npu"
    default_protocol = "ascend"

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self._npu = _import_torch_npu()

    def set_device(self) -> None:
        self._npu.set_device(f"npu:{self.index}")

    def new_stream(self) -> Any:
        return self._npu.Stream()

    def current_stream(self) -> Any:
        return self._npu.current_stream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._npu.stream(stream)

    def new_event(self) -> Any:
        return self._npu.Event()

    def synchronize(self) -> None:
        self._npu.synchronize()


def _import_torch_npu() -> Any:
    """Import ``torch_npu`` and return ``torch.npu``; a clear error without CANN."""
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        raise DependencyError(
            f"the NPU device layer needs torch_npu and the CANN toolkit ({exc}); install "
            "\"pip install 'ascend-kv-core[npu]'\" on an Ascend machine") from exc
    return torch.npu  # type: ignore[attr-defined]


_DEVICES: dict[str, type[Device]] = {"cpu": CpuDevice, "cuda": CudaDevice, "npu": NpuDevice}


def usable_cpus() -> int:
    """Host CPUs this process (its calling thread) may run on: an engine pinned to a core
    gets 1. Sizes the helper threads connectors start beside the engine."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _meminfo_bytes(field: str, meminfo: str) -> int | None:
    """``field`` of ``/proc/meminfo`` in bytes (``None``: unreadable)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limit(cgroup: str) -> int | None:
    """The cgroup's ``memory.max`` (cgroup v2) in bytes; ``None``: none or unreadable."""
    try:
        with open(os.path.join(cgroup, "memory.max")) as f:
            limit = f.read().strip()
        return None if limit == "max" else int(limit)
    except (OSError, ValueError):
        return None


def available_host_memory(meminfo: str = "/proc/meminfo",
                          cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of host memory this process could still make resident: the kernel's
    ``MemAvailable``, lowered to what the cgroup's ``memory.max`` leaves (a container's
    limit, cgroup v2); ``None`` where neither can be read (not Linux)."""
    avail = _meminfo_bytes("MemAvailable", meminfo)
    found = [] if avail is None else [avail]
    limit = _cgroup_limit(cgroup)
    if limit is not None:
        try:
            with open(os.path.join(cgroup, "memory.current")) as f:
                found.append(max(0, limit - int(f.read().strip())))
        except (OSError, ValueError):
            pass
    return min(found) if found else None


def total_host_memory(meminfo: str = "/proc/meminfo",
                      cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of host memory in all: ``MemTotal``, lowered to the cgroup's ``memory.max``
    (cgroup v2); ``None`` where neither can be read (not Linux). Unlike
    :func:`available_host_memory` it does not change as processes take memory, so
    processes starting side by side can each check a share of it."""
    found = [v for v in (_meminfo_bytes("MemTotal", meminfo), _cgroup_limit(cgroup))
             if v is not None]
    return min(found) if found else None


def detect_device_kind() -> str:
    """``npu``, ``cuda`` or ``cpu``: the env override, else vLLM's platform, else torch."""
    forced = os.environ.get(DEVICE_ENV, "").strip().lower()
    if forced:
        if forced not in _DEVICES:
            raise ValueError(f"{DEVICE_ENV}={forced!r}: expected one of {sorted(_DEVICES)}")
        return forced
    try:
        from vllm.platforms import current_platform

        kind = str(getattr(current_platform, "device_type", "") or "")
        if kind in _DEVICES:
            return kind
    except Exception:  # vLLM missing or its platform probe failing is not fatal here
        logger.debug("vLLM platform probe failed; falling back to torch", exc_info=True)
    if hasattr(torch, "npu") and getattr(torch.npu, "is_available", lambda: False)():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


@functools.cache
def get_device(kind: str | None = None, index: int = 0) -> Device:
    """The :class:`Device` of ``kind`` (default: detected) and ``index``."""
    kind = kind or detect_device_kind()
    if kind not in _DEVICES:
        raise ValueError(f"unknown device kind {kind!r}; expected one of {sorted(_DEVICES)}")
    return _DEVICES[kind](index)


def device_of(tensor: torch.Tensor) -> Device:
    """The :class:`Device` a tensor lives on."""
    dev = tensor.device
    return get_device(dev.type, dev.index or 0)


@contextlib.contextmanager
def maybe_stream(device: Device, stream: Any) -> Iterator[Any]:
    """Queue work on ``stream`` when it is not ``None``; otherwise on the current stream."""
    if stream is None:
        yield device.current_stream()
        return
    with device.stream(stream):
        yield stream

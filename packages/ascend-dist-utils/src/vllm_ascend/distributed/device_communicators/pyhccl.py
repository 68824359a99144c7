# SPDX-License-Identifier: Apache-2.0
"""``PyHcclCommunicator``: an HCCL communicator driven through ctypes (upstream's ``pyhccl``).

For groups that are not HCCL groups themselves (a gloo ``ProcessGroup`` or
vLLM's ``StatelessProcessGroup``): rank 0 creates the HCCL root info, the
group broadcasts its bytes, every rank creates its communicator on its device,
and a one-element all-reduce warms it up. ``all_reduce`` and ``broadcast`` then
run HCCL directly on device tensors.

As upstream, a group of one rank, or a machine without ``libhccl.so``, gives a
*disabled* communicator (``disabled`` is true, the collectives return
``None``): callers keep their fallback path. The reason is logged; creating
:class:`~.pyhccl_wrapper.HCCLLibrary` directly raises it instead.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from .errors import HcclLibraryError
from .pyhccl_wrapper import (
    HCCLLibrary,
    aclrtStream_t,
    buffer_type,
    hcclComm_t,
    hcclDataTypeEnum,
    hcclRedOpTypeEnum,
    hcclUniqueId,
)

logger = logging.getLogger(__name__)

__all__ = ["PyHcclCommunicator"]


def _as_device(device: int | str | torch.device) -> torch.device:
    if isinstance(device, int):
        return torch.device(f"npu:{device}")
    if isinstance(device, str):
        return torch.device(device)
    if not isinstance(device, torch.device):
        raise TypeError(f"PyHcclCommunicator: device {device!r} is not an int, str or "
                        "torch.device")
    return device


def _device_context(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.npu.device(device)`` on an NPU (set by ``torch_npu``), else nothing."""
    if device.type == "npu":
        return torch.npu.device(device)  # type: ignore[attr-defined]
    return contextlib.nullcontext()


def _stream_handle(stream: Any, device: torch.device) -> int | None:
    """The ``aclrtStream`` of ``stream`` (default: the device's current stream).

    A stream object gives its ``npu_stream``; an int is taken as the handle;
    a non-NPU device without a stream gives the NULL stream.
    """
    if stream is None:
        if device.type != "npu":
            return None
        stream = torch.npu.current_stream(device)  # type: ignore[attr-defined]
    if isinstance(stream, int):
        return stream
    return int(stream.npu_stream)


class PyHcclCommunicator:
    """An HCCL communicator over the ranks of ``group``.

    Args:
        group: A non-HCCL ``torch.distributed`` process group, or vLLM's
            ``StatelessProcessGroup`` (anything with ``rank``, ``world_size``
            and ``broadcast_obj``).
        device: The device this rank's communicator works on: an int is
            ``npu:<int>``. Each communicator must have its own device.
        library_path: ``libhccl.so``; default ``$HCCL_SO_PATH`` or ``libhccl.so``.

    Attributes:
        rank: This process's rank in ``group``.
        world_size: Ranks in ``group``.
        available: A communicator exists and is open.
        disabled: The collectives are no-ops returning ``None``.

    Raises:
        ValueError: ``group`` is an HCCL group (use its own collectives).
        RuntimeError: ``group`` is a process group but ``torch.distributed``
            is not initialised.
    """

    def __init__(self, group: Any, device: int | str | torch.device,
                 library_path: str | None = None) -> None:
        if isinstance(group, ProcessGroup):
            if not dist.is_initialized():
                raise RuntimeError("PyHcclCommunicator: torch.distributed is not initialised")
            backend = str(dist.get_backend(group)).lower()
            if backend == "hccl":
                raise ValueError("PyHcclCommunicator should be attached to a non-HCCL group "
                                 f"(got backend {backend!r})")
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        else:
            self.rank = int(group.rank)
            self.world_size = int(group.world_size)
        self.group = group
        self.device = _as_device(device)
        self.comm: hcclComm_t | None = None
        self.available = False
        self.disabled = True
        if self.world_size == 1:
            return
        try:
            self.hccl = HCCLLibrary(library_path)
        except HcclLibraryError as exc:
            logger.warning("PyHcclCommunicator disabled: %s", exc)
            return
        self.available = True
        self.disabled = False
        logger.info("vLLM is using pyhccl (rank %d of %d on %s)", self.rank, self.world_size,
                    self.device)
        if self.rank == 0:
            with _device_context(self.device):
                self.unique_id = self.hccl.hcclGetUniqueId()
        else:
            self.unique_id = hcclUniqueId()
        self._share_unique_id()
        with _device_context(self.device):
            self.comm = self.hccl.hcclCommInitRank(self.world_size, self.unique_id, self.rank)
            data = torch.zeros(1, device=self.device)
            self.all_reduce(data)
            self._synchronize(None)
            del data

    def _share_unique_id(self) -> None:
        """Rank 0's root info bytes to every rank of the group."""
        if isinstance(self.group, ProcessGroup):
            tensor = torch.tensor(list(bytes(self.unique_id.internal)), dtype=torch.uint8)
            ranks = dist.get_process_group_ranks(self.group)
            # ``src`` is a global rank
            dist.broadcast(tensor, src=ranks[0], group=self.group)
            raw = bytes(tensor.tolist())
        else:
            # plain bytes, not the ctypes structure: nothing richer needs to travel
            raw = bytes(self.group.broadcast_obj(
                bytes(self.unique_id.internal) if self.rank == 0 else None, src=0))
        if len(raw) != len(self.unique_id.internal):
            raise RuntimeError(f"PyHcclCommunicator: root info of {len(raw)} bytes received, "
                               f"{len(self.unique_id.internal)} expected")
        ctypes_buf = (type(self.unique_id.internal)).from_buffer_copy(raw)
        self.unique_id.internal = ctypes_buf

    def _synchronize(self, stream: Any) -> None:
        if self.device.type != "npu":
            return
        if stream is None:
            stream = torch.npu.current_stream(self.device)  # type: ignore[attr-defined]
        stream.synchronize()

    def _check(self, tensor: torch.Tensor) -> None:
        if not self.available:
            raise RuntimeError("HCCL communicator is closed")
        # a communicator only works on tensors of its own device
        if tensor.device != self.device:
            raise ValueError(f"this hccl communicator is created to work on {self.device}, "
                             f"but the input tensor is on {tensor.device}")

    def all_reduce(self, in_tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                   stream: Any = None) -> torch.Tensor | None:
        """All-reduce ``in_tensor`` into a new tensor (``None`` when disabled).

        Args:
            in_tensor: This rank's tensor, on :attr:`device`.
            op: ``ReduceOp.SUM`` / ``PRODUCT`` / ``MAX`` / ``MIN``.
            stream: NPU stream (default: the current one).
        """
        if self.disabled:
            return None
        self._check(in_tensor)
        out_tensor = torch.empty_like(in_tensor)
        self.hccl.hcclAllReduce(buffer_type(in_tensor.data_ptr()),
                                buffer_type(out_tensor.data_ptr()), in_tensor.numel(),
                                hcclDataTypeEnum.from_torch(in_tensor.dtype),
                                hcclRedOpTypeEnum.from_torch(op), self.comm,
                                aclrtStream_t(_stream_handle(stream, self.device)))
        return out_tensor

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        """Broadcast ``tensor`` in place from group rank ``src`` (a no-op when disabled)."""
        if self.disabled:
            return
        self._check(tensor)
        self.hccl.hcclBroadcast(buffer_type(tensor.data_ptr()), tensor.numel(),
                                hcclDataTypeEnum.from_torch(tensor.dtype), src, self.comm,
                                aclrtStream_t(_stream_handle(stream, self.device)))

    def close(self) -> None:
        """Destroy the HCCL communicator, at most once."""
        if not self.available:
            return
        self.available = False
        with _device_context(self.device):
            if self.device.type == "npu":
                torch.npu.synchronize(self.device)  # type: ignore[attr-defined]
            self.hccl.hcclCommDestroy(self.comm)

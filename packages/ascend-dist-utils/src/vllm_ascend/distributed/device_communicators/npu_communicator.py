# SPDX-License-Identifier: Apache-2.0
"""``NPUCommunicator``: vLLM's device communicator for Ascend, with ``all_to_all``.

vLLM-Ascend's platform names
``vllm_ascend.distributed.device_communicators.npu_communicator.NPUCommunicator``
as its device communicator class. It is vLLM's ``DeviceCommunicatorBase``
(all-reduce, all-gather, ... on the group's device group) plus
``all_to_all`` with even or uneven split sizes.

The collective itself is :func:`all_to_all`, a plain function of a
``torch.distributed`` process group, so it runs the same on HCCL, NCCL and
gloo (where the tests run it). The class is built on first access, so that
importing this module needs neither vLLM nor ``torch_npu``.
"""

from __future__ import annotations

import inspect
import logging
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ._vllm import vllm_module
from .errors import SplitSizeError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)

# NPUCommunicator is built by the module __getattr__ below, on first access.
__all__ = ["NPUCommunicator", "all_to_all"]  # noqa: F822


def _sizes(sizes: Sequence[int], world: int, name: str) -> list[int]:
    out = list(sizes)
    if len(out) != world:
        raise SplitSizeError(f"all_to_all: {name} has {len(out)} entries for a group of {world}")
    for s in out:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
            raise SplitSizeError(f"all_to_all: {name} must be non-negative ints, got {s!r}")
    return [int(s) for s in out]


def _dim(dim: int, ndim: int, name: str) -> int:
    if not -ndim <= dim < ndim:
        raise SplitSizeError(f"all_to_all: {name}={dim} is not a dim of a {ndim}-d tensor")
    return dim % ndim


def all_to_all(input_: torch.Tensor, group: ProcessGroup | None = None, *, scatter_dim: int = 0,
               gather_dim: int = -1, scatter_sizes: Sequence[int] | None = None,
               gather_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Split ``input_`` along ``scatter_dim``, send part ``j`` to rank ``j``, concatenate what
    arrives along ``gather_dim`` in rank order.

    Even mode (no sizes): ``input_.shape[scatter_dim]`` must divide by the
    group size; every rank sends and receives equal parts.

    Uneven mode: ``scatter_sizes[j]`` is how much of ``scatter_dim`` goes to
    rank ``j`` and ``gather_sizes[i]`` how much of ``gather_dim`` arrives from
    rank ``i``. As upstream, the part from rank ``i`` is shaped like this
    rank's own part except along ``gather_dim``, so ``scatter_sizes`` must be
    the same on every rank when ``scatter_dim != gather_dim``.

    Args:
        input_: The local tensor.
        group: Process group (default: the world).
        scatter_dim: Dim split between the ranks.
        gather_dim: Dim the received parts are concatenated along.
        scatter_sizes: Uneven split sizes, one a rank; with ``gather_sizes``.
        gather_sizes: Sizes received from each rank; with ``scatter_sizes``.

    Returns:
        A new contiguous tensor.

    Raises:
        SplitSizeError: One of the size lists without the other, sizes that
            do not fit the tensor or the group, or an uneven even split.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    scatter_dim = _dim(scatter_dim, input_.dim(), "scatter_dim")
    gather_dim = _dim(gather_dim, input_.dim(), "gather_dim")
    if (scatter_sizes is None) != (gather_sizes is None):
        raise SplitSizeError("all_to_all: give both scatter_sizes and gather_sizes, or neither")
    if scatter_sizes is not None and gather_sizes is not None:
        sizes = _sizes(scatter_sizes, world, "scatter_sizes")
        recv = _sizes(gather_sizes, world, "gather_sizes")
        if sum(sizes) != input_.shape[scatter_dim]:
            raise SplitSizeError(
                f"all_to_all: scatter_sizes {sizes} sum to {sum(sizes)}, the tensor has "
                f"{input_.shape[scatter_dim]} along dim {scatter_dim}")
        inputs = [t.contiguous() for t in torch.split(input_, sizes, scatter_dim)]
        base = list(inputs[rank].shape)
        outputs = []
        for i in range(world):
            shape = list(base)
            shape[gather_dim] = recv[i]
            outputs.append(torch.empty(shape, dtype=input_.dtype, device=input_.device))
    else:
        if input_.shape[scatter_dim] % world:
            raise SplitSizeError(
                f"all_to_all: dim {scatter_dim} of size {input_.shape[scatter_dim]} does not split "
                f"evenly between {world} ranks; pass scatter_sizes and gather_sizes")
        inputs = [t.contiguous() for t in torch.tensor_split(input_, world, scatter_dim)]
        outputs = [torch.empty_like(t) for t in inputs]
    _exchange(outputs, inputs, group)
    return torch.cat(outputs, dim=gather_dim).contiguous()


def _exchange(outputs: list[torch.Tensor], inputs: list[torch.Tensor],
              group: ProcessGroup | None) -> None:
    """``dist.all_to_all``; on gloo with parts of different shapes, one flat ``all_to_all_single``.

    Gloo's list all-to-all only moves equal-sized parts; its single-tensor form
    takes split sizes, so uneven parts travel flattened and are unpacked after.
    """
    uniform = all(t.shape == inputs[0].shape for t in (*inputs, *outputs))
    if uniform or dist.get_backend(group) != "gloo":
        dist.all_to_all(outputs, inputs, group=group)
        return
    flat_in = torch.cat([t.reshape(-1) for t in inputs])
    flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=flat_in.dtype,
                           device=flat_in.device)
    dist.all_to_all_single(flat_out, flat_in, output_split_sizes=[t.numel() for t in outputs],
                           input_split_sizes=[t.numel() for t in inputs], group=group)
    for t, part in zip(outputs, torch.split(flat_out, [o.numel() for o in outputs]), strict=True):
        t.copy_(part.view(t.shape))


def _npu_device(fallback: torch.device | None) -> torch.device | None:
    """The current NPU when ``torch_npu`` is loaded, else the device vLLM gave."""
    npu = getattr(torch, "npu", None)
    if npu is None or not hasattr(npu, "current_device"):
        return fallback
    try:
        return torch.device("npu", int(npu.current_device()))
    except (RuntimeError, TypeError, ValueError):  # no NPU backend registered in this torch
        return fallback


def _build_class() -> type:
    base_mod = vllm_module("vllm.distributed.device_communicators.base_device_communicator",
                           what="NPUCommunicator")
    base: type = base_mod.DeviceCommunicatorBase
    takes_all2all = "use_all2all" in inspect.signature(base.__init__).parameters  # type: ignore[misc]

    class NPUCommunicator(base):  # type: ignore[valid-type, misc]
        """vLLM device communicator for Ascend NPUs (HCCL); any torch backend works.

        Args:
            cpu_group: The group's gloo process group.
            device: Device vLLM assigned; replaced by the current NPU when
                ``torch_npu`` is loaded.
            device_group: The group's device process group (HCCL on NPU).
            unique_name: Group name, e.g. ``"tp:0"``.
            use_all2all: Passed to vLLM's base where it takes it (vLLM >= 0.27).
        """

        def __init__(self, cpu_group: ProcessGroup, device: torch.device | None = None,
                     device_group: ProcessGroup | None = None, unique_name: str = "",
                     use_all2all: bool = False, **kwargs: Any) -> None:
            if takes_all2all:
                kwargs["use_all2all"] = use_all2all
            super().__init__(cpu_group, device, device_group, unique_name, **kwargs)
            self.device = _npu_device(self.device)  # type: ignore[has-type]
            # As CudaCommunicator: vLLM's graph-capture code reads it.
            self.ca_comm = None

        def all_to_all(self, input_: torch.Tensor, scatter_dim: int = 0, gather_dim: int = -1,
                       scatter_sizes: list[int] | None = None,
                       gather_sizes: list[int] | None = None) -> torch.Tensor:
            """:func:`all_to_all` on the device group."""
            return all_to_all(input_, self.device_group, scatter_dim=scatter_dim,
                              gather_dim=gather_dim, scatter_sizes=scatter_sizes,
                              gather_sizes=gather_sizes)

    NPUCommunicator.__module__ = __name__
    return NPUCommunicator


def __getattr__(name: str) -> Any:
    if name == "NPUCommunicator":
        cls = _build_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

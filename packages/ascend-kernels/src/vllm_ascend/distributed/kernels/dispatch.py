# SPDX-License-Identifier: Apache-2.0
"""Choose the implementation of a kernel call.

Every kernel has three implementations:

* ``reference``: plain torch, one block (or one token) at a time; obviously
  correct on any device, and the oracle the others are tested against;
* ``torch``: whole blocks moved by single vectorised torch calls
  (``index_select`` / ``index_copy_`` / advanced indexing). On CPU each block
  is reinterpreted as one row of the widest integer-like type that divides it,
  so the copy runs as ``memcpy`` of whole blocks. Used on CPU, CUDA and any
  device without a dedicated path;
* ``npu``: the ``torch_npu`` operators (``npu_paged_cache_load``,
  ``_npu_reshape_and_cache``, ``npu_scatter_pa_kv_cache``, the fused
  ``transpose_kv_cache_by_block`` when vLLM-Ascend's custom ops are loaded),
  imported on first use.

The choice, strongest first: the ``impl`` argument of the call, then the
environment variable ``VLLM_ASCEND_KERNELS_IMPL``, then the device of the
tensors (``npu`` -> ``npu``, anything else -> ``torch``). ``auto`` anywhere
means "decide by device".
"""

from __future__ import annotations

import enum
import logging
import os

import torch

from .errors import UnknownImplError

logger = logging.getLogger(__name__)

#: Environment variable forcing an implementation (``reference`` to debug a fast path).
ENV_IMPL = "VLLM_ASCEND_KERNELS_IMPL"


class Impl(enum.StrEnum):
    """Implementations of the kernels."""

    AUTO = "auto"
    REFERENCE = "reference"
    TORCH = "torch"
    NPU = "npu"


def parse_impl(value: str | Impl | None, *, source: str = "impl argument") -> Impl:
    """``value`` as an :class:`Impl` (``None`` and ``""`` are ``auto``).

    Raises:
        UnknownImplError: ``value`` names no implementation.
    """
    if value is None or value == "":
        return Impl.AUTO
    if isinstance(value, Impl):
        return value
    try:
        return Impl(str(value).strip().lower())
    except ValueError:
        choices = ", ".join(i.value for i in Impl)
        raise UnknownImplError(
            f"{source}: unknown kernel implementation {value!r} (choose one of {choices})"
        ) from None


def device_impl(device: torch.device) -> Impl:
    """The fast path of a device: ``npu`` on Ascend, ``torch`` anywhere else."""
    return Impl.NPU if device.type == "npu" else Impl.TORCH


def resolve_impl(device: torch.device, impl: str | Impl | None = None) -> Impl:
    """The implementation a call on tensors of ``device`` runs with.

    Args:
        device: Device of the tensors of the call.
        impl: The caller's choice, or ``None``/``"auto"``.

    Returns:
        ``REFERENCE``, ``TORCH`` or ``NPU`` (never ``AUTO``).
    """
    chosen = parse_impl(impl)
    if chosen is Impl.AUTO:
        env = os.environ.get(ENV_IMPL)
        if env:
            chosen = parse_impl(env, source=f"${ENV_IMPL}")
    if chosen is Impl.AUTO:
        chosen = device_impl(device)
    return chosen

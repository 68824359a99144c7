# SPDX-License-Identifier: Apache-2.0
"""Exceptions of ascend-cpu-offload.

Each subclasses a builtin (and core's :class:`KVTransferError`), so callers
catching ``ValueError`` or ``RuntimeError`` keep working; every message names
the bad value and where it came from.
"""

from __future__ import annotations

from vllm_ascend.distributed.kv_transfer.core.errors import KVTransferError


class OffloadError(KVTransferError):
    """Base class of the errors of this package."""


class HostPoolError(OffloadError, RuntimeError):
    """The host-memory pool could not be created, sized or mapped."""


class HostCapacityError(OffloadError, ValueError):
    """The configured host capacity cannot hold even one block, or does not fit the machine."""


class OffloadProtocolError(OffloadError, ValueError):
    """A well-formed message asked for something impossible (unknown rank, wrong sizes ...)."""


class PoolNotReadyError(OffloadError, TimeoutError):
    """The ranks of the instance did not all register with the metadata server in time."""

# SPDX-License-Identifier: Apache-2.0
"""Exceptions of the KV pool.

Each subclasses a builtin (through core's :class:`KVTransferError`) so callers
that catch ``RuntimeError`` or ``ValueError`` keep working, and each message
names the value, the backend and the operation that failed.
"""

from __future__ import annotations

from vllm_ascend.distributed.kv_transfer.core.errors import KVTransferError


class BackendError(KVTransferError, RuntimeError):
    """A pool backend refused an operation.

    Attributes:
        backend: backend name (``local``, ``mooncake``, ``memcache``).
        op: the operation (``setup``, ``put``, ``get``, ``exists``, ``register``).
        rc: the store's return code, when it gave one.
    """

    def __init__(self, message: str, *, backend: str = "", op: str = "", rc: int | None = None
                 ) -> None:
        super().__init__(message)
        self.backend = backend
        self.op = op
        self.rc = rc


class BackendUnavailableError(BackendError):
    """The store cannot be reached (master down, RPC failure): the pool degrades to misses."""


class PoolKeyError(KVTransferError, ValueError):
    """A string is not a pool key of the upstream format."""


class LookupFailedError(KVTransferError, RuntimeError):
    """The scheduler's lookup could not be answered (the worker side is gone or too slow)."""

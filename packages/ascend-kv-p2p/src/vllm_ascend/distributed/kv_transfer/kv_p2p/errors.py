# SPDX-License-Identifier: Apache-2.0
"""Errors of the P/D connectors."""

from __future__ import annotations

from vllm_ascend.distributed.kv_transfer.core.errors import (
    HandshakeMismatchError,
    KVTransferError,
    RemoteError,
)

__all__ = ["HandshakeMismatchError", "KVParamsError", "RemoteKVUnavailable", "unknown_request"]


class KVParamsError(KVTransferError, ValueError):
    """``kv_transfer_params`` of a request are malformed; the message names key and value."""


class RemoteKVUnavailable(KVTransferError, RuntimeError):
    """The prefill instance cannot serve a request's KV (unknown request, freed, wrong blocks)."""

    def __init__(self, message: str, *, code: str = "unavailable") -> None:
        super().__init__(message)
        self.code = code


def unknown_request(exc: Exception) -> bool:
    """A peer answered "unknown request": it has not heard of the request yet (D's ``Claim``
    before P's metadata, P's ``PushBegin`` before D's worker saw it), which is retried."""
    return isinstance(exc, RemoteError) and exc.code == "unknown_request"

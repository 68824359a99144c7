# SPDX-License-Identifier: Apache-2.0
"""Exceptions shared by every connector package.

Each subclasses a builtin so that callers catching ``ValueError`` or
``RuntimeError`` keep working, and every message names the bad value and
where it came from.
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base class of every error raised by the vllm-ascend-distributed packages."""


class ConfigError(KVTransferError, ValueError):
    """A configuration value is missing, of the wrong type or out of range.

    Attributes:
        key: dotted path of the offending key, e.g. ``prefill.tp_size``.
        value: the value that was given.
        source: where the value came from (``kv_connector_extra_config``, a file, ...).
    """

    def __init__(self, message: str, *, key: str | None = None, value: object = None,
                 source: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.value = value
        self.source = source


class DependencyError(KVTransferError, ImportError):
    """An optional or peer dependency is missing or too old; the message says what to install."""


class WireFormatError(KVTransferError, ValueError):
    """Bytes received on a socket are not a valid message of the expected protocol."""


class RemoteError(KVTransferError, RuntimeError):
    """The peer answered a request with an error reply."""

    def __init__(self, message: str, *, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


class PeerTimeoutError(KVTransferError, TimeoutError):
    """A peer did not answer within the allowed time."""


class TransferError(KVTransferError, RuntimeError):
    """The transfer engine reported a failure (return code < 0).

    Attributes:
        op: the operation (``read``, ``write``, ``register`` ...).
        peer: the remote session (``host:port``) if any.
        rc: the engine's return code.
    """

    def __init__(self, message: str, *, op: str = "", peer: str = "", rc: int = -1) -> None:
        super().__init__(message)
        self.op = op
        self.peer = peer
        self.rc = rc


class EndpointInUseError(KVTransferError, OSError):
    """A live server already listens on the ``ipc://`` path this one was to bind (another
    engine with the same ``engine_id`` on this host): binding would take its socket over."""


class HandshakeMismatchError(KVTransferError, ValueError):
    """Two instances that are to exchange KV caches disagree on the cache shape or parallelism."""


class LayoutError(KVTransferError, ValueError):
    """The KV cache tensors handed over by vLLM are not in a layout this package understands."""

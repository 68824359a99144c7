# SPDX-License-Identifier: Apache-2.0
"""Exceptions of ascend-dist-utils (``parallel_state``, ``utils``, ``device_communicators``).

Each subclasses the builtin a caller would expect, and its message names the
bad value and where it came from.
"""

from __future__ import annotations


class GroupNotInitializedError(RuntimeError, AssertionError):
    """A process-group getter was called before the group was created.

    Also an ``AssertionError``: upstream's getters ``assert`` and callers may
    catch that.
    """


class GroupAlreadyInitializedError(RuntimeError):
    """A group was created twice without being destroyed in between."""


class ParallelLayoutError(ValueError):
    """Parallel sizes that do not describe a valid rank layout (e.g. TP not a multiple)."""


class SplitSizeError(ValueError):
    """all_to_all split sizes that do not match the tensor or the group."""


class DistributedNotInitializedError(RuntimeError):
    """torch.distributed (or vLLM's world group) is not initialised."""


class VllmUnavailableError(ImportError):
    """vLLM (a peer dependency) is missing or cannot be imported."""


class HcclLibraryError(OSError):
    """``libhccl.so`` could not be loaded, or lacks a symbol (the message names ``HCCL_SO_PATH``)."""


class HcclError(RuntimeError):
    """An HCCL call returned a non-zero ``HcclResult``.

    Attributes:
        code: The ``HcclResult`` code.
        call: The C function that returned it.
    """

    def __init__(self, message: str, *, code: int, call: str) -> None:
        super().__init__(message)
        self.code = code
        self.call = call

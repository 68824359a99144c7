# SPDX-License-Identifier: Apache-2.0
"""Exceptions of ascend-kernels.

Each subclasses the builtin a caller would expect (``IndexError`` for a block
id out of range, ``ValueError`` for a wrong shape), so ``except IndexError``
keeps working; messages name the bad value and the operation that got it.
"""

from __future__ import annotations


class BlockIdError(IndexError):
    """A block id (or slot) is negative or beyond the cache it indexes."""


class KernelShapeError(ValueError):
    """Tensors whose shapes, dtypes or devices do not fit together, or malformed ids."""


class DuplicateIdError(ValueError):
    """The same block or slot is written twice in one call (the result would be undefined)."""


class UnknownImplError(ValueError):
    """An implementation name that is not ``auto``, ``reference``, ``torch`` or ``npu``."""


class NpuUnavailableError(ImportError):
    """The NPU implementation was asked for but ``torch_npu`` cannot be imported."""

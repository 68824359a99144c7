# SPDX-License-Identifier: Apache-2.0
"""Block-hash keys that are equal across processes and machines.

Python's ``hash()`` is salted per process unless ``PYTHONHASHSEED`` is set,
and vLLM's non-cryptographic prefix hashes inherit that. These helpers chain
SHA-256 over the little-endian int64 token ids of each full block (plus
optional extra keys such as a LoRA name or cache salt), so the same prefix
gives the same key on every instance with no environment setting.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

#: Parent of the first block of every sequence.
ROOT_HASH = hashlib.sha256(b"vllm-ascend-distributed/root/v1").digest()

_encoder = msgspec.msgpack.Encoder()


def hash_block(parent: bytes, token_ids: Sequence[int] | np.ndarray, extra: Any = None) -> bytes:
    """Hash one block given its parent's hash.

    Args:
        parent: the previous block's hash (:data:`ROOT_HASH` for the first block).
        token_ids: the block's token ids.
        extra: msgspec-encodable extra key material (LoRA name, cache salt, ...).
    """
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    if extra is not None:
        h.update(_encoder.encode(extra))
    return h.digest()


def chained_block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int, *,
                         extra: Any = None, parent: bytes = ROOT_HASH,
                         start_block: int = 0, previous: Sequence[bytes] = ()) -> list[bytes]:
    """Hashes of every *full* block of ``token_ids``.

    Args:
        token_ids: the sequence.
        block_size: tokens per block.
        extra: extra key material mixed into every block.
        parent: hash preceding the first block.
        start_block: skip recomputing the first blocks when ``previous`` holds them.
        previous: hashes already computed for blocks ``[0, start_block)``.

    Returns:
        ``len(token_ids) // block_size`` hashes; a trailing partial block has none.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    arr = np.asarray(token_ids, dtype="<i8")
    n_full = len(arr) // block_size
    out = list(previous[:start_block])
    if len(out) != start_block:
        raise ValueError(f"previous holds {len(previous)} hashes, start_block is {start_block}")
    prev = out[-1] if out else parent
    for b in range(start_block, n_full):
        prev = hash_block(prev, arr[b * block_size:(b + 1) * block_size], extra)
        out.append(prev)
    return out


def to_hex(block_hash: bytes) -> str:
    """Hex form used in pool keys."""
    return bytes(block_hash).hex()

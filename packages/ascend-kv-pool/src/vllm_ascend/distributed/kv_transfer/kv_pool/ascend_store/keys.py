# SPDX-License-Identifier: Apache-2.0
"""Pool keys and block hashes (no vLLM needed).

Key format (upstream)::

    {model}@pcp{p}@dcp{d}@head_or_tp_rank:{h}@pp_rank:{pp}@{block_hash_hex}
    {model}@pcp{p}@dcp{d}@head_or_tp_rank:{h}@pp_rank:{pp}@group:{g}@{block_hash_hex}   (HMA)
    {model}@pcp{p}@dcp{d}@head_or_tp_rank:{h}@{block_hash_hex}@{layer_id}   (layerwise)

With vLLM's hybrid KV cache manager on (several KV cache groups: full attention and a
sliding window), a block of each group is an object of its own, and its key names the group
(``@group:{g}``, vLLM's group index): the same tokens have one block in each group, with
different bytes. Instances whose groups differ never share keys either: the group layout is
mixed into the cache fingerprint (:func:`~.context.context_from_vllm`).

Block hashes chain SHA-256 over the token ids of each pool block
(:func:`~vllm_ascend.distributed.kv_transfer.core.hashing.chained_block_hashes`)
with the LoRA name, the cache salt and a cache fingerprint (dtype, block size,
TP size) mixed in, so two instances of the same model and layout compute the
same keys with no ``PYTHONHASHSEED`` setting, and instances whose blocks differ
in shape never read each other's objects. With ``discard_partial_chunks``
off, the prompt's trailing partial block gets a hash of its own (over its
tokens only), so an identical prompt hits it and a longer one does not.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.hashing import (
    ROOT_HASH,
    chained_block_hashes,
    hash_block,
    to_hex,
)

from .errors import PoolKeyError

_KEY_RE = re.compile(
    r"^(?P<model>.+)@pcp(?P<pcp>\d+)@dcp(?P<dcp>\d+)@head_or_tp_rank:(?P<head>\d+)"
    r"(?:@pp_rank:(?P<pp>\d+)(?:@group:(?P<group>\d+))?@(?P<hash>[0-9a-f]+)"
    r"|@(?P<lhash>[0-9a-f]+)@(?P<layer>\d+))$")


@dataclass(frozen=True)
class KeyMetadata:
    """What identifies a rank's share of a block besides its hash."""

    model_name: str
    head_or_tp_rank: int
    pcp_rank: int = 0
    dcp_rank: int = 0
    pp_rank: int = 0

    def with_head(self, head: int) -> KeyMetadata:
        """The same metadata for another head group (lookups on rank 0 check every group)."""
        return replace(self, head_or_tp_rank=head)

    def with_pp(self, pp_rank: int) -> KeyMetadata:
        """The same metadata for another pipeline stage."""
        return replace(self, pp_rank=pp_rank)


@dataclass(frozen=True)
class PoolKey:
    """The key of one block (all layers of this rank; of one KV cache group with HMA)."""

    meta: KeyMetadata
    chunk_hash: str
    #: vLLM's KV cache group of the block (``None``: one group, the hybrid manager off)
    group: int | None = None

    def to_string(self) -> str:
        m = self.meta
        group = f"@group:{self.group}" if self.group is not None else ""
        return (f"{m.model_name}@pcp{m.pcp_rank}@dcp{m.dcp_rank}"
                f"@head_or_tp_rank:{m.head_or_tp_rank}@pp_rank:{m.pp_rank}{group}"
                f"@{self.chunk_hash}")

    def __str__(self) -> str:
        return self.to_string()


@dataclass(frozen=True)
class LayerPoolKey:
    """The key of one layer of one block (``use_layerwise``)."""

    meta: KeyMetadata
    chunk_hash: str
    layer_id: int

    def to_string(self) -> str:
        m = self.meta
        return (f"{m.model_name}@pcp{m.pcp_rank}@dcp{m.dcp_rank}"
                f"@head_or_tp_rank:{m.head_or_tp_rank}@{self.chunk_hash}@{self.layer_id}")

    def __str__(self) -> str:
        return self.to_string()


def parse_key(text: str) -> PoolKey | LayerPoolKey:
    """Parse a key string back (``vllm-ascend-kv`` tools, tests).

    Raises:
        PoolKeyError: ``text`` is not a key of either format.
    """
    match = _KEY_RE.match(text)
    if match is None:
        raise PoolKeyError(f"not a pool key: {text!r}")
    g = match.groupdict()
    if g["hash"] is not None:
        meta = KeyMetadata(g["model"], int(g["head"]), int(g["pcp"]), int(g["dcp"]), int(g["pp"]))
        return PoolKey(meta, g["hash"], int(g["group"]) if g["group"] is not None else None)
    meta = KeyMetadata(g["model"], int(g["head"]), int(g["pcp"]), int(g["dcp"]), 0)
    return LayerPoolKey(meta, g["lhash"], int(g["layer"]))


def model_key_name(model: str) -> str:
    """``/models/Qwen3-8B/`` -> ``Qwen3-8B`` (upstream: the last path component)."""
    return model.rstrip("/").split("/")[-1]


class BlockHasher:
    """Chained block hashes of a token sequence, in pool blocks.

    Args:
        block_size: tokens per pool block.
        salt: fingerprint mixed into every block (layout, dtype ...).
    """

    def __init__(self, block_size: int, salt: str = "") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.salt = salt

    def extra(self, lora_name: str | None = None, cache_salt: str | None = None) -> Any:
        """The extra key material of a request."""
        return [self.salt, lora_name, cache_salt]

    def full_block_hashes(self, token_ids: Sequence[int], *, extra: Any = None,
                          previous: Sequence[bytes] = ()) -> list[bytes]:
        """Hashes of every full block (reusing ``previous`` for the first ones)."""
        n_prev = min(len(previous), len(token_ids) // self.block_size)
        return chained_block_hashes(token_ids, self.block_size, extra=extra,
                                    start_block=n_prev, previous=previous[:n_prev])

    def partial_tail_hash(self, token_ids: Sequence[int], full: Sequence[bytes], *,
                          extra: Any = None) -> bytes | None:
        """Hash of the trailing partial block (``None`` when the length is block-aligned)."""
        n_full = len(token_ids) // self.block_size
        tail = token_ids[n_full * self.block_size:]
        if not len(tail):
            return None
        parent = full[n_full - 1] if n_full else ROOT_HASH
        return hash_block(parent, tail, [extra, "partial"])

    def hashes(self, token_ids: Sequence[int], *, extra: Any = None,
               include_partial: bool = False, previous: Sequence[bytes] = ()) -> list[str]:
        """Hex hashes of the blocks of ``token_ids`` (plus the partial tail if asked)."""
        full = self.full_block_hashes(token_ids, extra=extra, previous=previous)
        out = [to_hex(h) for h in full]
        if include_partial:
            tail = self.partial_tail_hash(token_ids, full, extra=extra)
            if tail is not None:
                out.append(to_hex(tail))
        return out


def block_spans(first_block: int, count: int, token_end: int,
                block_size: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` token span of pool blocks ``first_block ..`` (the last may be partial)."""
    for i in range(first_block, first_block + count):
        start = i * block_size
        yield start, min(start + block_size, token_end)

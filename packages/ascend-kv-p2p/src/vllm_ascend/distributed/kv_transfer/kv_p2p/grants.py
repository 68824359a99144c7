# SPDX-License-Identifier: Apache-2.0
"""The addresses a keyed grant names: those of one request's blocks, and nothing else.

With a deployment key neither side hands out where its KV cache lives (the base address and
block stride of each registered region): P's :class:`~.protocol.ClaimGrant` and a keyed D's
:class:`~.protocol.PushBlocksGrant` name, for every region, the address of each block of the
claim (or push) they answer, so a peer learns the memory of the request whose capability it
presented, not the map of the whole cache.

On the wire the addresses are one ``bytes`` field of little-endian unsigned 64-bit integers,
region-major: region 0's address of each block, in the order the claim (push) named the
blocks, then region 1's, and so on (``num_regions`` rows of ``len(block_ids)``). P builds them
with numpy (:class:`BlockAddresser`, one multiply-add over the claim's blocks); the receiver
reads them back with :func:`granted_table`, which refuses a grant whose size is not the one
asked for (code ``bad_grant``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import RemoteKVUnavailable

__all__ = ["ADDRESS", "BlockAddresser", "granted_table"]

#: one address on the wire
ADDRESS = np.dtype("<u8")


class BlockAddresser:
    """The addresses of blocks in a registered KV cache, for the grants of its owner.

    Args:
        bases: each region's base address.
        strides: each region's block stride (bytes from one block to the next).
    """

    __slots__ = ("bases", "strides")

    def __init__(self, bases: Sequence[int], strides: Sequence[int]) -> None:
        if len(bases) != len(strides):
            raise ValueError(f"{len(bases)} base addresses for {len(strides)} strides")
        self.bases = np.asarray(bases, dtype=np.int64)[:, None]
        self.strides = np.asarray(strides, dtype=np.int64)[:, None]

    @property
    def num_regions(self) -> int:
        """How many regions (rows) a grant names."""
        return int(self.bases.shape[0])

    def of(self, block_ids: Sequence[int], *, skip: Sequence[bool] | None = None) -> bytes:
        """The wire addresses of ``block_ids`` in every region (region-major, see the module).

        Args:
            block_ids: the blocks, in the order the claim (push) named them.
            skip: regions whose addresses are left 0 (the peer writes them elsewhere: a
                D's staging buffers).
        """
        ids = np.asarray(block_ids, dtype=np.int64)[None, :]
        table = self.bases + self.strides * ids
        if skip is not None and any(skip):
            table[np.asarray(skip, dtype=bool)] = 0
        return table.astype(ADDRESS).tobytes()


def granted_table(data: bytes, num_regions: int, *, regions: int, blocks: int,
                  who: str) -> np.ndarray:
    """A grant's addresses as an int64 array of ``regions`` rows of ``blocks``.

    Args:
        data: the grant's ``block_addrs``.
        num_regions: the grant's ``num_regions``.
        regions: the regions the receiver expects (the granting side's, from its metadata).
        blocks: the blocks the claim (push) named.
        who: the granting side, for the message.

    Raises:
        RemoteKVUnavailable: (``bad_grant``) the grant names another count of regions, or
            another count of addresses than ``regions * blocks``.
    """
    if num_regions != regions or len(data) != ADDRESS.itemsize * regions * blocks:
        raise RemoteKVUnavailable(
            f"{who}'s grant names {len(data) // ADDRESS.itemsize} block addresses of "
            f"{num_regions} regions; the claim asked for {blocks} blocks of {regions} regions",
            code="bad_grant")
    return np.frombuffer(data, dtype=ADDRESS).astype(np.int64).reshape(regions, blocks)

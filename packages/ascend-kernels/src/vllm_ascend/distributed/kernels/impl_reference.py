# SPDX-License-Identifier: Apache-2.0
"""Reference implementations: plain torch, one block or one token at a time.

Correct on any device and deliberately simple: the other implementations are
tested against these. Arguments arrive validated (see :mod:`.validation`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .heads import merge_raw_parts, split_raw_parts
from .validation import TokenIndex

logger = logging.getLogger(__name__)


def gather(cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    for j, b in enumerate(ids.tolist()):
        out[j].copy_(cache[b])
    return out


def scatter(buf: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor) -> None:
    for j, b in enumerate(ids.tolist()):
        cache[b].copy_(buf[j])


def gather_layers(caches: Sequence[torch.Tensor], ids: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    for layer, cache in enumerate(caches):
        gather(cache, ids, out[layer])
    return out


def scatter_layers(buf: torch.Tensor, caches: Sequence[torch.Tensor], ids: torch.Tensor) -> None:
    for layer, cache in enumerate(caches):
        scatter(buf[layer], cache, ids)


def copy_layers(srcs: Sequence[torch.Tensor], src_ids: torch.Tensor,
                dsts: Sequence[torch.Tensor], dst_ids: torch.Tensor) -> None:
    # every source block read before any destination block is written
    picked = [[src[b].clone() for b in src_ids.tolist()] for src in srcs]
    for blocks, dst in zip(picked, dsts, strict=True):
        for block, b in zip(blocks, dst_ids.tolist(), strict=True):
            dst[b].copy_(block)


def load_tokens(cache: torch.Tensor, tix: TokenIndex, token_axis: int,
                out: torch.Tensor) -> torch.Tensor:
    for row, (b, o) in enumerate(zip(tix.block.tolist(), tix.offset.tolist(), strict=True)):
        out[row].copy_(cache[b].select(token_axis, o))
    return out


def store_tokens(rows: torch.Tensor, cache: torch.Tensor, row_idx: torch.Tensor,
                 block: torch.Tensor, offset: torch.Tensor, token_axis: int) -> None:
    for r, b, o in zip(row_idx.tolist(), block.tolist(), offset.tolist(), strict=True):
        cache[b].select(token_axis, o).copy_(rows[r])


def transpose_blocks(cache: torch.Tensor, ids: torch.Tensor, num_parts: int, head_axis: int,
                     inverse: bool) -> None:
    fn = split_raw_parts if inverse else merge_raw_parts
    for b in ids.tolist():
        block = cache[b].clone().unsqueeze(0)
        cache[b].copy_(fn(block, num_parts, head_axis)[0])

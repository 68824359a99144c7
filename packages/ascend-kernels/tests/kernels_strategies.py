# SPDX-License-Identifier: Apache-2.0
"""Hypothesis strategies shared by the kernel tests (imported by the test modules)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64)
IMPLS = ("reference", "torch")


def fill(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Distinct-ish deterministic values of any dtype."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


@st.composite
def block_shapes(draw: st.DrawFn, min_dims: int = 0, max_dims: int = 3) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(1, 5), min_size=min_dims, max_size=max_dims)))


@st.composite
def caches(draw: st.DrawFn, min_blocks: int = 0, block_shape: tuple[int, ...] | None = None,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """A cache region in one of the layouts the connectors meet.

    ``contiguous``: one tensor; ``kv_view``: K or V of a ``(num_blocks, 2,
    *block_shape)`` allocation (block stride twice the block); ``offset``: a
    view starting one block into a bigger allocation; ``inner_strided``:
    blocks that are not contiguous (the fast path must fall back).
    """
    nb = draw(st.integers(min_blocks, 12))
    shape = block_shape if block_shape is not None else draw(block_shapes())
    dt = dtype if dtype is not None else draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    kind = draw(st.sampled_from(["contiguous", "kv_view", "offset", "inner_strided"]))
    if kind == "kv_view":
        return fill((nb, 2, *shape), dt, seed)[:, draw(st.integers(0, 1))]
    if kind == "offset":
        return fill((nb + 2, *shape), dt, seed)[1:-1]
    if kind == "inner_strided" and len(shape) >= 2:
        return fill((nb, *shape[::-1]), dt, seed).permute(0, *range(len(shape), 0, -1))
    return fill((nb, *shape), dt, seed)

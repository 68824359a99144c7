# SPDX-License-Identifier: Apache-2.0
"""Where every KV block lives in memory.

vLLM hands a connector ``kv_caches: dict[layer name, tensor or tuple]`` in
``register_kv_caches``. The layout differs per platform:

* vLLM's CPU backend: one tensor a layer, ``(num_blocks, num_kv_heads,
  block_size, 2 * head_size)`` with K and V interleaved inside a block;
* CUDA flash-attention style: one tensor ``(2, num_blocks, block_size,
  num_kv_heads, head_size)`` (K and V stacked in front) or ``(num_blocks, 2,
  ...)`` (stacked inside a block);
* Ascend NPU: a tuple ``(k_cache, v_cache)`` of separate tensors
  ``(num_blocks, block_size, num_kv_heads, head_size)``;
* MLA: a tuple whose parts have different last dimensions (``k_nope``,
  ``k_rope``), or a single tensor ``(num_blocks, block_size, head_size)``;
  sparse MLA adds a third (index) tensor.

:class:`KVCacheLayout` turns any of these into *regions*: memory ranges in
which block ``i`` occupies ``[base + i * block_stride, + block_len)``. That is
all the transfer engine, the pool and the offload path need; the head axis is
recorded too, for splitting heads between instances of different TP sizes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from .errors import ConfigError, LayoutError

if TYPE_CHECKING:  # imported where used: the wire-safe descriptor needs no torch (the
    import torch  # P/D proxy imports it through the handshake messages)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """Index of a layer from its vLLM name (``model.layers.12.self_attn.attn`` -> 12)."""
    match = _LAYER_INDEX.search(f".{name}.")
    return int(match.group(1)) if match else -1


@dataclass(frozen=True)
class KVRegion:
    """One memory range holding one part (K, V, K+V, nope, rope ...) of every block of a layer."""

    layer: str
    role: str
    tensor: torch.Tensor = field(repr=False, compare=False)
    base_addr: int
    num_blocks: int
    block_len: int
    block_stride: int
    #: shape of one block of this region (without the block dimension)
    block_shape: tuple[int, ...]
    #: axis of ``block_shape`` that indexes KV heads, or ``None`` (MLA: no head split)
    head_axis: int | None

    def block_addr(self, block_id: int) -> int:
        """Address of block ``block_id`` in this region."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks}) "
                             f"for {self.layer}/{self.role}")
        return self.base_addr + block_id * self.block_stride

    def blocks(self) -> torch.Tensor:
        """View of the region as ``(num_blocks, *block_shape)``."""
        return self.tensor

    @property
    def nbytes(self) -> int:
        """Bytes spanned by the region."""
        return (self.num_blocks - 1) * self.block_stride + self.block_len


@dataclass(frozen=True)
class LayerLayout:
    """The regions of one attention layer."""

    name: str
    index: int
    regions: tuple[KVRegion, ...]
    is_mla: bool


class LayoutDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """What two instances compare before exchanging KV (wire-safe, no tensors)."""

    kind: str
    num_layers: int
    num_blocks: int
    block_size: int
    dtype: str
    is_mla: bool
    num_kv_heads: int
    head_size: int
    #: bytes of one block per region, layer by layer, region by region
    block_lens: list[int]


@dataclass
class KVCacheLayout:
    """Regions of every layer of a KV cache, in layer order."""

    layers: list[LayerLayout]
    kind: str
    num_blocks: int
    block_size: int
    dtype: torch.dtype
    is_mla: bool
    num_kv_heads: int
    head_size: int
    #: a layer whose tensor is an earlier layer's (vLLM's hybrid KV cache manager gives a
    #: layer of each KV cache group one tensor) -> that layer: its bytes are moved with it
    aliases: dict[str, str] = field(default_factory=dict)

    # ------------------------------------------------------------ building
    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        *,
        block_size: int,
        num_blocks: int | None = None,
        num_kv_heads: int | None = None,
        head_size: int | None = None,
    ) -> KVCacheLayout:
        """Describe the ``kv_caches`` dict vLLM registers.

        Args:
            kv_caches: layer name -> tensor or tuple of tensors.
            block_size: tokens per block (``cache_config.block_size``).
            num_blocks: number of blocks, when known (removes any ambiguity).
            num_kv_heads: KV heads on this rank, when known.
            head_size: head dimension, when known.

        A layer whose tensor is an earlier layer's (the same memory, blocks and strides: vLLM's
        hybrid KV cache manager shares one tensor between a layer of each KV cache group) is
        not a layer of its own: it is in :attr:`aliases`, and its bytes go with the layer that
        owns the memory, block id by block id (a block id belongs to one group at a time). So
        is a layer in no attention layout whose tensors lie within the blocks of another's
        (a state-space layer's state: its conv and SSM tensors in an attention layer's pages).

        Raises:
            LayoutError: an empty dict, a layer in an unknown layout, or layers that disagree.
        """
        if not kv_caches:
            raise LayoutError("kv_caches is empty: nothing to register")
        layers: list[LayerLayout] = []
        kinds: set[str] = set()
        owners: dict[tuple[tuple[int, int, int, int], ...], str] = {}
        aliases: dict[str, str] = {}
        undescribed: list[tuple[str, Any, LayoutError]] = []
        for name, value in sorted(kv_caches.items(), key=lambda kv: (layer_index(kv[0]), kv[0])):
            try:
                kind, regions, mla, heads, hsize = _describe_layer(
                    name, value, block_size=block_size, num_blocks=num_blocks,
                    num_kv_heads=num_kv_heads, head_size=head_size)
            except LayoutError as exc:
                undescribed.append((name, value, exc))
                continue
            kinds.add(kind)
            memory = tuple((r.base_addr, r.num_blocks, r.block_len, r.block_stride)
                           for r in regions)
            if memory in owners:
                aliases[name] = owners[memory]
                continue
            owners[memory] = name
            layers.append(LayerLayout(name, layer_index(name), tuple(regions), mla))
            num_blocks = regions[0].num_blocks if num_blocks is None else num_blocks
            num_kv_heads = heads if num_kv_heads is None else num_kv_heads
            head_size = hsize if head_size is None else head_size
        for name, value, why in undescribed:
            owner = _page_owner(value, layers)
            if owner is None:
                raise why
            aliases[name] = owner
        if not layers:
            raise LayoutError("no layer of kv_caches is in a layout this package understands")
        if len(kinds) != 1:
            raise LayoutError(f"layers use different KV layouts: {sorted(kinds)}")
        counts = {r.num_blocks for layer in layers for r in layer.regions}
        if len(counts) != 1:
            raise LayoutError(f"layers disagree on the number of blocks: {sorted(counts)}")
        import torch

        dtypes = {r.tensor.dtype for layer in layers for r in layer.regions}
        first = layers[0].regions[0]
        assert num_blocks is not None
        return cls(layers=layers, kind=kinds.pop(), num_blocks=num_blocks, block_size=block_size,
                   dtype=first.tensor.dtype if len(dtypes) == 1 else torch.uint8,
                   is_mla=layers[0].is_mla, num_kv_heads=int(num_kv_heads or 1),
                   head_size=int(head_size or 0), aliases=aliases)

    # ------------------------------------------------------------ queries
    @property
    def regions(self) -> list[KVRegion]:
        """Every region, layer by layer."""
        return [r for layer in self.layers for r in layer.regions]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers and regions."""
        return sum(r.block_len for r in self.regions)

    @property
    def num_layers(self) -> int:
        """Number of attention layers."""
        return len(self.layers)

    def base_addrs(self) -> list[int]:
        """Base address of every region (the order of :attr:`regions`)."""
        return [r.base_addr for r in self.regions]

    def memory_ranges(self) -> list[tuple[int, int]]:
        """``(address, length)`` ranges to register with a transfer engine, merged when adjacent."""
        spans = sorted((r.base_addr, r.nbytes) for r in self.regions)
        merged: list[tuple[int, int]] = []
        for addr, length in spans:
            if merged and addr <= merged[-1][0] + merged[-1][1]:
                start, prev_len = merged[-1]
                merged[-1] = (start, max(prev_len, addr + length - start))
            else:
                merged.append((addr, length))
        return merged

    def descriptor(self) -> LayoutDescriptor:
        """A wire-safe summary for handshakes."""
        return LayoutDescriptor(
            kind=self.kind, num_layers=self.num_layers, num_blocks=self.num_blocks,
            block_size=self.block_size, dtype=str(self.dtype).replace("torch.", ""),
            is_mla=self.is_mla, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            block_lens=[r.block_len for r in self.regions])

    def check_block_ids(self, block_ids: Sequence[int], *, what: str = "block ids") -> None:
        """Raise :class:`IndexError` if any id is outside ``[0, num_blocks)``."""
        for b in block_ids:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < self.num_blocks:
                raise IndexError(f"{what}: {b!r} is outside [0, {self.num_blocks})")


# ---------------------------------------------------------------------- helpers
def _page_owner(value: Any, layers: Sequence[LayerLayout]) -> str | None:
    """The layer whose blocks hold every tensor of ``value`` within them (same block count
    and stride, each block's bytes inside the owner's block), or None."""
    import torch

    tensors = list(value) if isinstance(value, (list, tuple)) else [value]
    owner: str | None = None
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or not t[0].is_contiguous():
            return None
        elem = t.element_size()
        addr, span, stride = t.data_ptr(), t[0].numel() * elem, t.stride(0) * elem
        found = next((layer.name for layer in layers for r in layer.regions
                      if r.num_blocks == t.shape[0] and r.block_stride == stride
                      and r.base_addr <= addr and addr + span <= r.base_addr + r.block_len),
                     None)
        if found is None or owner not in (None, found):
            return None
        owner = found
    return owner


def _region(name: str, role: str, t: torch.Tensor, head_axis: int | None) -> KVRegion:
    if t.dim() < 2:
        raise LayoutError(f"{name}/{role}: expected a tensor with a block dimension, "
                          f"got shape {tuple(t.shape)}")
    inner = t[0]
    if not inner.is_contiguous():
        raise LayoutError(f"{name}/{role}: one block is not contiguous in memory "
                          f"(shape {tuple(t.shape)}, stride {t.stride()}); this layout cannot be "
                          "transferred block by block")
    elem = t.element_size()
    block_len = inner.numel() * elem
    block_stride = t.stride(0) * elem
    if block_stride < block_len:
        raise LayoutError(f"{name}/{role}: blocks overlap (stride {block_stride} < {block_len})")
    return KVRegion(layer=name, role=role, tensor=t, base_addr=t.data_ptr(),
                    num_blocks=t.shape[0], block_len=block_len, block_stride=block_stride,
                    block_shape=tuple(t.shape[1:]), head_axis=head_axis)


def _describe_layer(
    name: str,
    value: torch.Tensor | Sequence[torch.Tensor],
    *,
    block_size: int,
    num_blocks: int | None,
    num_kv_heads: int | None,
    head_size: int | None,
) -> tuple[str, list[KVRegion], bool, int, int]:
    """Return ``(kind, regions, is_mla, num_kv_heads, head_size)`` of one layer."""
    import torch

    if isinstance(value, (tuple, list)):
        parts = list(value)
        if not parts or not all(isinstance(p, torch.Tensor) for p in parts):
            raise LayoutError(f"{name}: expected a tuple of tensors, got {type(value).__name__}")
        if len(parts) == 2 and parts[0].shape[-1] == parts[1].shape[-1] \
                and parts[0].shape == parts[1].shape:
            # NPU: separate K and V, (num_blocks, block_size, heads, head_size)
            k, v = parts
            heads, hsize = _heads_nbhd(name, k, block_size)
            return ("kv_split", [_region(name, "k", k, _head_axis_nbhd(k)),
                                 _region(name, "v", v, _head_axis_nbhd(v))], False, heads, hsize)
        # MLA (k_nope, k_rope) or sparse MLA (k_nope, k_rope, index): no head split, each
        # part a token's values by block, (num_blocks, block_size, ...)
        if not all(p.dim() >= 3 and p.shape[1] == block_size for p in parts):
            raise LayoutError(f"{name}: a tuple of tensors of shapes "
                              f"{[tuple(p.shape) for p in parts]} is no KV layout this package "
                              f"understands (block size {block_size})")
        roles = ["nope", "rope", "index"][: len(parts)] + [f"part{i}" for i in range(3, len(parts))]
        regions = [_region(name, role, p, None) for role, p in zip(roles, parts, strict=False)]
        hsize = sum(int(p.shape[-1]) for p in parts[:2])
        return "mla_split", regions, True, 1, hsize
    if not isinstance(value, torch.Tensor):
        raise LayoutError(f"{name}: expected a tensor or tuple of tensors, "
                          f"got {type(value).__name__}")
    t = value
    shape = tuple(t.shape)
    if t.dim() == 5 and shape[0] == 2 and (num_blocks is None or shape[1] == num_blocks):
        # (2, num_blocks, block_size, heads, head_size): K and V stacked in front
        k, v = t[0], t[1]
        heads, hsize = _heads_nbhd(name, k, block_size)
        return ("kv_stacked", [_region(name, "k", k, _head_axis_nbhd(k)),
                               _region(name, "v", v, _head_axis_nbhd(v))], False, heads, hsize)
    if t.dim() == 5 and shape[1] == 2:
        # (num_blocks, 2, block_size, heads, head_size): K and V inside each block
        heads, hsize = int(shape[3]), int(shape[4])
        return "kv_blocked", [_region(name, "kv", t, 2)], False, heads, hsize
    if t.dim() == 4:
        # vLLM CPU backend: (num_blocks, heads, block_size, 2 * head_size)
        if shape[2] == block_size and (num_kv_heads is None or shape[1] == num_kv_heads):
            heads, hsize = int(shape[1]), int(shape[3]) // 2
            return "cpu_interleaved", [_region(name, "kv", t, 0)], False, heads, hsize
        # (num_blocks, block_size, heads, head_size) single K-only cache
        if shape[1] == block_size:
            return "k_only", [_region(name, "k", t, 1)], False, int(shape[2]), int(shape[3])
    if t.dim() == 3 and shape[1] == block_size:
        # MLA in one tensor: (num_blocks, block_size, head_size)
        return "mla", [_region(name, "kv", t, None)], True, 1, int(shape[2])
    raise LayoutError(f"{name}: KV cache of shape {shape} (block_size {block_size}) is not a "
                      "layout this package understands")


def _heads_nbhd(name: str, t: torch.Tensor, block_size: int) -> tuple[int, int]:
    if t.dim() != 4:
        raise LayoutError(f"{name}: expected (num_blocks, block_size, heads, head_size), "
                          f"got {tuple(t.shape)}")
    if t.shape[1] != block_size:
        raise LayoutError(f"{name}: dimension 1 of {tuple(t.shape)} should be the block size "
                          f"{block_size}")
    return int(t.shape[2]), int(t.shape[3])


def _head_axis_nbhd(t: torch.Tensor) -> int:
    # block shape (block_size, heads, head_size): heads at axis 1
    return 1


# ---------------------------------------------------------------------- KV cache groups
def refuse_kv_cache_groups(kv_cache_config: object, who: str) -> None:
    """Refuse at start-up a model with more than one KV cache group.

    A hybrid model (e.g. sliding window and full attention) under vLLM's hybrid KV cache
    manager has one group of blocks per attention kind; every connector of this project
    moves one group's blocks, so it would move a part of each request's KV as if it were
    all of it. None declares vLLM's ``SupportsHMA``, so vLLM turns the hybrid manager off
    for them (one group for every layer) unless it is forced on.

    Args:
        kv_cache_config: the engine's ``KVCacheConfig`` (``None`` where not known yet).
        who: the connector or worker, named in the error.

    Raises:
        ConfigError: naming the model's groups and the way out.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) > 1:
        names = "; ".join(_group_name(g) for g in groups)
        raise ConfigError(
            f"{who} moves the blocks of one KV cache group, but this model has {len(groups)}: "
            f"{names}. Serve it with the hybrid KV cache manager off "
            "(--disable-hybrid-kv-cache-manager), which gives every layer one group",
            key="kv_cache_groups", value=len(groups), source="kv_cache_config")


def _group_name(group: object) -> str:
    spec = getattr(group, "kv_cache_spec", None)
    kind = type(spec).__name__ if spec is not None else "?"
    window = getattr(spec, "sliding_window", None)
    layers = list(getattr(group, "layer_names", []) or [])
    shown = ", ".join(layers[:4]) + (f", ... ({len(layers)} layers)" if len(layers) > 4 else "")
    return f"{kind}{f'(sliding_window={window})' if window else ''} [{shown}]"

# SPDX-License-Identifier: Apache-2.0
"""The KV cache groups of a model under vLLM's hybrid KV cache manager, as connectors need them.

With the hybrid manager (HMA) on, a model whose layers keep their KV differently (full
attention and sliding window) has one *group* of layers per kind. Every group takes its blocks
from one shared pool, so a block id belongs to one group at a time, and a layer of each group
shares one tensor with a layer of every other group (vLLM's ``KVCacheTensor`` lists them): the
bytes of block ``b`` of that tensor are the KV of whichever group owns ``b``. A request has one
list of block ids per group, position ``i`` of each holding tokens ``[i*B, (i+1)*B)``; a
sliding-window group frees the blocks its window has left and puts vLLM's null block (id 0) in
their place.

A state-space model (Mamba, Gated DeltaNet) has a *state group* besides: a fixed-size state
per request, kept in the block at the group's last position (earlier ones are null, or
checkpoints vLLM's prefix cache keeps), in pages of the same tensors.

This module reads those facts from vLLM's ``KVCacheConfig`` (:class:`KVGroups`), says which
shapes a connector can move (:meth:`KVGroups.refuse_unsupported`), which positions of a
sliding-window or state group vLLM keeps (:meth:`KVGroup.first_kept`), and what two instances
must agree on before they exchange KV (:meth:`KVGroups.signature`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

#: vLLM's null block: a sliding-window group's place holder for a block it freed
NULL_BLOCK = 0

#: group kinds a P/D connector moves block by block: full attention, a sliding window, and a
#: state-space (Mamba, GDN) group's state, one block a request at its last position
MOVABLE_KINDS = ("full", "sliding", "mamba")
#: the kinds a layerwise push moves (a state is rewritten as the prompt goes on)
TOKEN_KINDS = ("full", "sliding")


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its kind, block size, window and layers."""

    index: int
    #: ``full``, ``sliding``, ``mla`` or vLLM's spec class name for any other kind
    kind: str
    block_size: int
    #: tokens of the window (``sliding`` only; 0 otherwise)
    window: int
    layers: tuple[str, ...]
    #: vLLM's spec class name (``FullAttentionSpec``, ``SlidingWindowSpec`` ...)
    spec: str

    def first_kept(self, num_computed_tokens: int) -> int:
        """The first block position vLLM keeps for a request with ``num_computed_tokens``
        computed: 0 except for a sliding window, which frees (puts the null block in place of)
        every block wholly before its window (vLLM's ``SlidingWindowManager``), and a state
        group, whose state is its last block (vLLM's ``MambaManager``)."""
        if self.kind == "mamba":
            return max(0, -(-num_computed_tokens // (self.block_size or 1)) - 1)
        if self.kind != "sliding" or self.window <= 0:
            return 0
        skipped = max(0, num_computed_tokens - self.window + 1)
        return skipped // self.block_size

    def describe(self) -> str:
        """``full/32`` or ``sliding/32/w64``: kind, block size and window."""
        return f"{self.kind}/{self.block_size}" + (f"/w{self.window}" if self.window else "")


@dataclass(frozen=True)
class KVGroups:
    """The KV cache groups of one engine (one group: a model without several kinds)."""

    groups: tuple[KVGroup, ...]

    # ------------------------------------------------------------ building
    @classmethod
    def from_config(cls, kv_cache_config: Any) -> KVGroups:
        """Read vLLM's ``KVCacheConfig`` (``None`` or no groups: one unnamed full group)."""
        raw = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        groups = tuple(_group(i, g) for i, g in enumerate(raw))
        return cls(groups or (KVGroup(0, "full", 0, 0, (), "FullAttentionSpec"),))

    # ------------------------------------------------------------ queries
    @property
    def hybrid(self) -> bool:
        """More than one group: the hybrid KV cache manager is on for a hybrid model."""
        return len(self.groups) > 1

    @property
    def has_window(self) -> bool:
        """A sliding-window group is among them."""
        return any(g.kind == "sliding" for g in self.groups)

    @property
    def has_state(self) -> bool:
        """A state-space group (Mamba, GDN) is among them."""
        return any(g.kind == "mamba" for g in self.groups)

    @property
    def leaves_last_token(self) -> bool:
        """Whether a P/D pair must leave the prompt's last token to D: a window or a state
        moves on with every token computed, and D's first computed token needs them as they
        were before it (vLLM recomputes the last token after a whole-prompt load)."""
        return self.hybrid and (self.has_window or self.has_state)

    def group_of(self) -> dict[str, int]:
        """Layer name -> index of its group."""
        return {layer: g.index for g in self.groups for layer in g.layers}

    def signature(self) -> list[str]:
        """What P and D compare before KV moves: every group's kind, block size and window,
        and its layers (empty for one group, which the layout check already covers)."""
        if not self.hybrid:
            return []
        return [f"{g.describe()}:{','.join(g.layers)}" for g in self.groups]

    def runs(self, block_ids: Sequence[Sequence[int]], num_tokens: int
             ) -> tuple[list[int], list[tuple[int, int]]]:
        """A request's blocks of every group for its first ``num_tokens`` tokens, from the
        first one vLLM still keeps (a window's or a state's earlier ones are the null block),
        one group's run after another; and each run's ``(first position, count)``.

        Args:
            block_ids: the request's block ids, one list per group, by position.
            num_tokens: tokens whose blocks count (positions past them are left out).

        Raises:
            ValueError: not a list per group, or a null block after a kept one (a shape a
                run cannot describe).
        """
        if len(block_ids) != len(self.groups):
            raise ValueError(f"{len(block_ids)} lists of block ids for {len(self.groups)} "
                             "KV cache groups")
        blocks: list[int] = []
        runs: list[tuple[int, int]] = []
        for group, ids in zip(self.groups, block_ids, strict=True):
            bs = group.block_size or 1
            head = list(ids[: -(-num_tokens // bs)])
            first = next((i for i, b in enumerate(head) if b != NULL_BLOCK), len(head))
            run = head[first:]
            if NULL_BLOCK in run:
                raise ValueError(f"group {group.index} ({group.describe()}) has a freed block "
                                 f"after position {first}: {head}")
            blocks.extend(run)
            runs.append((first, len(run)))
        return blocks, runs

    def describe(self) -> str:
        """One line naming every group, for errors and ``doctor``."""
        return "; ".join(_shown(g) for g in self.groups)

    def refuse_unsupported(self, who: str, *, kinds: Sequence[str] = TOKEN_KINDS) -> None:
        """Refuse at start-up the group shapes ``who`` cannot move.

        ``kinds`` are those ``who`` moves (of :data:`MOVABLE_KINDS`; by default the token
        kinds, :data:`TOKEN_KINDS`: a connector moves a state only where it says so); the
        token groups among them (all but ``mamba``) must share one block size. Other kinds (chunked local
        attention, cross-attention, MLA with a window ...) stay refused.

        Raises:
            ConfigError: naming the groups and the way out.
        """
        if not self.hybrid:
            return
        odd = [g for g in self.groups if g.kind not in kinds]
        sizes = {g.block_size for g in self.groups if g.kind != "mamba"}
        if odd or len(sizes) > 1:
            why = (f"groups of kind {sorted({g.spec for g in odd})}" if odd
                   else f"groups of different block sizes {sorted(sizes)}")
            raise ConfigError(
                f"{who} moves the blocks of {' and '.join(kinds)} KV cache groups of one block "
                f"size; this model has {why}: {self.describe()}. Serve it with the hybrid KV "
                "cache manager off (--disable-hybrid-kv-cache-manager) where the model allows, "
                "or without this connector",
                key="kv_cache_groups", value=len(self.groups), source="kv_cache_config")


def _group(index: int, group: Any) -> KVGroup:
    spec = getattr(group, "kv_cache_spec", None)
    name = type(spec).__name__ if spec is not None else "?"
    window = int(getattr(spec, "sliding_window", 0) or 0)
    if name == "SlidingWindowSpec":
        kind = "sliding"
    elif name in ("FullAttentionSpec",):
        kind = "full"
    elif name == "MLAAttentionSpec":
        kind = "mla"
    elif name == "MambaSpec":
        kind = "mamba"
    else:
        kind = name
    return KVGroup(index=index, kind=kind, block_size=int(getattr(spec, "block_size", 0) or 0),
                   window=window if kind == "sliding" else 0,
                   layers=tuple(getattr(group, "layer_names", ()) or ()), spec=name)


def _shown(group: KVGroup) -> str:
    layers = list(group.layers)
    shown = ", ".join(layers[:4]) + (f", ... ({len(layers)} layers)" if len(layers) > 4 else "")
    window = f"(sliding_window={group.window})" if group.window else ""
    return f"{group.spec}{window} [{shown}]"

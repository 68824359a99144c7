# SPDX-License-Identifier: Apache-2.0
"""D side of ``MooncakeConnectorV1``: the bytes of one request, from P's blocks into D's.

What D holds of each block is given by its head plan
(:func:`~.worker_base.head_slices`): which heads of which P rank go where. A region
whose heads are contiguous in a block (vLLM's CPU layout, MLA, or a whole block)
is read straight into the local blocks, one batched transfer-engine read per P
rank. Its address arithmetic is done once per P rank's metadata and head plan
(:class:`DirectPlan`, kept by :class:`AddressPlans`): a load only multiplies each segment
by its runs of blocks (:class:`LoadBlocks`: blocks consecutive on both sides make one
range where a segment is a whole block), with numpy from :data:`VECTOR_MIN_RANGES` ranges
on, so no per-block Python loop and no sort of the ranges. A keyed P's blocks are where its
claim's grant says (:mod:`..grants`: an address a block and region, no region base): the
same plan takes each P address from the grant's table instead (:meth:`DirectPlan.granted_ranges`).
Heads that are not contiguous in a block (the NPU layout under
heterogeneous TP) are staged: P's whole blocks are read into a buffer, then
:mod:`ascend-kernels' head ops <vllm_ascend.distributed.kernels.heads>` select
each P rank's part, merge the parts in head order, and the merged blocks are
scattered into the local cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from vllm_ascend.distributed.kernels import scatter_blocks
from vllm_ascend.distributed.kernels.heads import HeadSlice, merge_head_slices
from vllm_ascend.distributed.kv_transfer.core.layout import KVCacheLayout, KVRegion
from vllm_ascend.distributed.kv_transfer.core.transfer_engine import MooncakeTransferEngine

from ..errors import HandshakeMismatchError, RemoteKVUnavailable
from ..protocol import AgentMeta
from ..worker_base import heads_in_block
from .contract import RecvMeta

logger = logging.getLogger(__name__)


#: One contiguous piece of every block of a region pair that D reads straight from P:
#: ``(local base, local block stride, local offset, P base, P block stride, P offset,
#: length)``.
Segment = tuple[int, int, int, int, int, int, int]
#: From this many ranges (segments times runs of blocks) a load's ranges are computed with
#: numpy; below, numpy's fixed cost is more than the Python loop's
VECTOR_MIN_RANGES = 128


class LoadBlocks:
    """A load's blocks as the address arithmetic wants them: ``(local, P)`` id pairs sorted
    by local id, and their runs of blocks consecutive on both sides (``(local, P, count)``).

    Args:
        local_ids: the local block ids.
        remote_ids: P's block ids, one for each local id.
    """

    __slots__ = ("pairs", "runs", "_arrays", "_ids")

    def __init__(self, local_ids: Sequence[int], remote_ids: Sequence[int]) -> None:
        self._ids = (local_ids, remote_ids)
        if len(local_ids) == 1:  # the common small load: no sort
            self.pairs = [(local_ids[0], remote_ids[0])]
            self.runs = [(local_ids[0], remote_ids[0], 1)]
        else:
            self.pairs = sorted(zip(local_ids, remote_ids, strict=True))
            runs: list[tuple[int, int, int]] = []
            for lb, rb in self.pairs:
                if runs:
                    l0, r0, c = runs[-1]
                    if lb == l0 + c and rb == r0 + c:
                        runs[-1] = (l0, r0, c + 1)
                        continue
                runs.append((lb, rb, 1))
            self.runs = runs
        self._arrays: tuple[np.ndarray, ...] | None = None

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The runs and the pairs as int64 arrays: run local ids, run P ids, run counts,
        pair local ids, pair P ids."""
        if self._arrays is None:
            runs = np.asarray(self.runs, dtype=np.int64).reshape(-1, 3)
            pairs = np.asarray(self.pairs, dtype=np.int64).reshape(-1, 2)
            self._arrays = (runs[:, 0], runs[:, 1], runs[:, 2], pairs[:, 0], pairs[:, 1])
        return self._arrays

    def positions(self) -> np.ndarray:
        """Where each pair of :attr:`pairs` stands in the load's lists: its column in a
        grant's table, which follows the claim's (the load's) order."""
        if len(self.pairs) == 1:
            return np.zeros(1, dtype=np.int64)
        local, remote = (np.asarray(ids, dtype=np.int64) for ids in self._ids)
        return np.lexsort((remote, local))  # the order of sorted(zip(local, remote))


class DirectPlan:
    """A P rank's direct segments, ready to be multiplied by a load's blocks: each segment's
    first byte on both sides, its strides and length (computed once per P rank's metadata
    and head plan, kept by :class:`AddressPlans`).

    A segment that is a whole block on both sides (its length both strides) reads a run of
    blocks consecutive on both sides as one range; any other reads a range per block.
    Ranges of different segments are not merged (regions are separate tensors: adjacent only
    by chance of the allocator, when merging would save a range, not bytes).

    Args:
        segments: the segments.
        p_regions: P's region of each segment (its row in a grant's table); ``None``: the
            plan is not read under a grant.

    Attributes:
        segments: the segments it was made of.
        whole_blocks: every segment is a whole block on both sides.
    """

    def __init__(self, segments: Sequence[Segment],
                 p_regions: Sequence[int] | None = None) -> None:
        self.segments = tuple(segments)
        self._p_regions = (None if p_regions is None
                           else np.asarray(p_regions, dtype=np.int64).reshape(-1))
        rows = [(lb + ol, ls, rb + orr, rs, n, n == ls == rs)
                for lb, ls, ol, rb, rs, orr, n in self.segments]
        self._rows = rows
        self.whole_blocks = all(row[5] for row in rows)
        cols = np.asarray([row[:5] for row in rows], dtype=np.int64).reshape(-1, 5)
        whole = np.asarray([row[5] for row in rows], dtype=bool)
        # (local first, local stride, P first, P stride, length) of the whole-block segments
        # and of the others, as columns
        self._whole = tuple(cols[whole].T.copy())
        self._part = tuple(cols[~whole].T.copy())
        self._n_whole = int(whole.sum())
        # (local first, local stride, P offset in the block, length) of every segment, as
        # columns of one row each: what a read under a grant needs
        self._granted = (cols[:, 0:1], cols[:, 1:2],
                         np.asarray([seg[5] for seg in self.segments], dtype=np.int64)[:, None],
                         cols[:, 4:5])

    def count(self, blocks: LoadBlocks) -> int:
        """How many ranges :meth:`ranges` makes of ``blocks``."""
        return (self._n_whole * len(blocks.runs)
                + (len(self._rows) - self._n_whole) * len(blocks.pairs))

    def ranges(self, blocks: LoadBlocks) -> tuple[list[int], list[int], list[int]]:
        """The load's byte ranges (local addresses, P addresses, lengths), none adjacent to
        another of the same segment on both sides."""
        if self.count(blocks) >= VECTOR_MIN_RANGES:
            return self._vector(blocks)
        loc: list[int] = []
        rem: list[int] = []
        lens: list[int] = []
        runs = blocks.runs
        singles = [(lb, rb, 1) for lb, rb in blocks.pairs] if not self.whole_blocks else runs
        for lf, ls, rf, rs, n, whole in self._rows:
            for lb, rb, c in (runs if whole else singles):
                loc.append(lf + ls * lb)
                rem.append(rf + rs * rb)
                lens.append(n * c)
        return loc, rem, lens

    def _vector(self, blocks: LoadBlocks) -> tuple[list[int], list[int], list[int]]:
        run_l, run_r, run_c, pair_l, pair_r = blocks.arrays()
        parts = []
        for (lf, ls, rf, rs, n), (bl, br, bc) in (
                (self._whole, (run_l, run_r, run_c)),
                (self._part, (pair_l, pair_r, None))):
            if not lf.size:
                continue
            parts.append(((lf[:, None] + ls[:, None] * bl).ravel(),
                          (rf[:, None] + rs[:, None] * br).ravel(),
                          (n[:, None] * (bc if bc is not None else 1)
                           + np.zeros((1, bl.size), dtype=np.int64)).ravel()))
        if len(parts) == 1:
            loc, rem, lens = parts[0]
        else:
            loc, rem, lens = (np.concatenate(col) for col in zip(*parts, strict=True))
        return loc.tolist(), rem.tolist(), lens.tolist()

    def granted_ranges(self, blocks: LoadBlocks, table: np.ndarray
                       ) -> tuple[list[int], list[int], list[int]]:
        """The load's byte ranges under a keyed P's grant: P's address of each block is the
        grant's (``table``: a row per P region, a column per block of the claim, which is
        the load's order), plus the segment's offset in the block. Ranges of a segment
        adjacent on both sides are merged, as :meth:`ranges` merges runs."""
        assert self._p_regions is not None, "a plan made without P's regions"
        if not self.segments:
            return [], [], []
        if len(blocks.pairs) == 1:  # the common small load: no numpy beyond the table
            (lb, _rb), = blocks.pairs
            col = table[:, 0].tolist()
            return ([lf + ls * lb for lf, ls, *_ in self._rows],
                    [col[j] + seg[5] for j, seg in zip(self._p_regions.tolist(), self.segments,
                                                       strict=True)],
                    [row[4] for row in self._rows])
        lf, ls, off, n = self._granted
        loc = lf + ls * blocks.arrays()[3][None, :]
        rem = table[self._p_regions][:, blocks.positions()] + off
        lens = np.broadcast_to(n, loc.shape)
        start = np.ones(loc.shape, dtype=bool)  # a range starts here (not merged backwards)
        start[:, 1:] = ((loc[:, 1:] != loc[:, :-1] + lens[:, :-1])
                        | (rem[:, 1:] != rem[:, :-1] + lens[:, :-1]))
        first = np.flatnonzero(start.ravel())
        merged = np.add.reduceat(lens.ravel(), first)
        return loc.ravel()[first].tolist(), rem.ravel()[first].tolist(), merged.tolist()


class RankPlan:
    """What D reads of one P rank, computed once per P rank's metadata and head plan
    (:class:`AddressPlans`).

    Attributes:
        direct: its direct segments (read straight into the local blocks).
        staged: the staged regions (local region -> (P's region index, slices)).
    """

    __slots__ = ("direct", "staged")

    def __init__(self, segments: Sequence[Segment],
                 staged: dict[int, tuple[int, list[HeadSlice]]],
                 p_regions: Sequence[int] | None = None) -> None:
        self.direct = DirectPlan(segments, p_regions)
        self.staged = staged


class AddressPlans:
    """Where each P rank's slices go, per P rank's metadata and head plan: what a read
    needs besides the block ids, so a request only multiplies it by its blocks. An entry
    keeps the objects it was made from and is used only while the read passes the same
    ones (a P rank's new metadata or grant, or another plan, makes a new entry).

    Args:
        max_entries: entries kept (the oldest goes first).
    """

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._lock = threading.Lock()
        # ids of (layout, P meta, plan, stages) and the P rank -> those objects (kept, so that
        # no id is reused while its entry lives) and the plan
        self._plans: dict[tuple[int, ...], tuple[tuple[object, ...], RankPlan]] = {}

    def get(self, layout: KVCacheLayout, remote: AgentMeta, p_rank: int,
            plan: Sequence[HeadSlice], stages: Sequence[range] | None) -> RankPlan:
        """The P rank's read plan (computed on the first read with these objects).

        Raises:
            HandshakeMismatchError: see :func:`_rank_plan`.
        """
        made_of = (layout, remote, plan, stages)
        key = (*map(id, made_of), p_rank)
        hit = self._plans.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], made_of, strict=True)):
            return hit[1]
        rank_plan = _rank_plan(layout, remote, p_rank, plan, stages)
        with self._lock:  # pull threads fill it side by side (a hit needs no lock)
            while len(self._plans) >= self.max_entries:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = (made_of, rank_plan)
        return rank_plan


def read_request(te: MooncakeTransferEngine, layout: KVCacheLayout, meta: RecvMeta,
                 remotes: Mapping[int, AgentMeta], plan: Sequence[HeadSlice], *,
                 stages: Sequence[range] | None = None,
                 plans: AddressPlans | None = None,
                 grants: Mapping[int, np.ndarray] | None = None) -> int:
    """Read every P rank's slices of the request into the local blocks; returns bytes.

    Args:
        te: the transfer engine (the local cache is registered with it).
        layout: the local KV cache.
        meta: the request: local and remote block ids.
        remotes: the metadata of every P rank to read from, by P rank (the instance rank
            ``pp_rank * tp_size + tp_rank`` of a pipeline-parallel P).
        plan: this rank's head slices (``remote_rank`` is the P rank).
        stages: the layers of each of P's pipeline stages (:func:`~.contract.stage_layers`);
            ``None``: P is one stage. Each P rank is read for its stage's layers only.
        plans: where the P ranks' read plans are kept between requests (``None``: computed
            for this read only).
        grants: the block addresses of keyed P ranks, by P rank (:func:`~..grants.
            granted_table` of each claim's grant: a row per P region, a column per block
            of ``meta.remote_block_ids``); a rank in it is read at those addresses only.

    Raises:
        RemoteKVUnavailable: (``no_regions``) a P rank's metadata has no region addresses
            and no grant names its blocks.
    """
    layout.check_block_ids(meta.local_block_ids, what="local block ids")
    grants = grants or {}
    staged: dict[int, tuple[int, list[HeadSlice]]] = {}
    moved = 0
    blocks = LoadBlocks(meta.local_block_ids, meta.remote_block_ids)
    for p_rank, remote in remotes.items():
        if p_rank not in grants and not remote.region_addrs:
            raise RemoteKVUnavailable(f"P rank {p_rank} told D neither its regions nor where "
                                      "the request's blocks are", code="no_regions")
        rank_plan = (plans.get(layout, remote, p_rank, plan, stages) if plans is not None
                     else _rank_plan(layout, remote, p_rank, plan, stages))
        check_remote_blocks(meta, remote)
        if rank_plan.direct.segments:
            table = grants.get(p_rank)
            ranges = (rank_plan.direct.ranges(blocks) if table is None
                      else rank_plan.direct.granted_ranges(blocks, table))
            moved += te.read(remote.session, *ranges, merged=True)
        for i, (j, slices) in rank_plan.staged.items():
            staged.setdefault(i, (j, []))[1].extend(slices)
    for i, (j, slices) in staged.items():
        moved += _read_staged(te, layout.regions[i], j, meta, remotes, slices, grants)
    return moved


def p_region_count(remote: AgentMeta) -> int:
    """How many KV regions P rank ``remote`` registered (its layout's, so also known from a
    keyed P whose metadata leaves the addresses out).

    Raises:
        HandshakeMismatchError: an unkeyed P's addresses do not match its layout.
    """
    n = len(remote.layout.block_lens)
    if remote.region_addrs and (len(remote.region_addrs) != n
                                or len(remote.region_strides) != n):
        raise HandshakeMismatchError(
            f"P describes {n} KV regions but gives {len(remote.region_addrs)} addresses")
    return n


def _region_pairs(layout: KVCacheLayout, remote: AgentMeta, p_rank: int,
                  stages: Sequence[range] | None) -> list[tuple[int, int]]:
    """``(local region, P region)`` index pairs of the regions P rank ``p_rank`` holds: all
    of them, or those of its pipeline stage's layers.

    Raises:
        HandshakeMismatchError: P's stages, or the layers of this rank's stage, are not
            those D was configured with (``prefill.pp_size``, ``prefill.pp_layer_partition``).
    """
    n_local = len(layout.regions)
    if not stages:
        if getattr(remote, "pp_size", 1) != 1:
            raise HandshakeMismatchError(
                f"P runs {remote.pp_size} pipeline stages, but D was configured with "
                "prefill.pp_size=1: set prefill.pp_size (and prefill.pp_layer_partition) on D "
                "as P runs")
        if p_region_count(remote) != n_local:
            raise HandshakeMismatchError(
                f"P has {p_region_count(remote)} KV regions, D has {n_local}")
        return [(i, i) for i in range(n_local)]
    s = p_rank // remote.tp_size
    stage = stages[s]
    held = range(remote.first_layer, remote.first_layer + remote.layout.num_layers)
    if (remote.pp_size, remote.pp_rank, held) != (len(stages), s, stage):
        raise HandshakeMismatchError(
            f"P rank {remote.tp_rank} of pipeline stage {remote.pp_rank} holds layers "
            f"[{held.start}, {held.stop}) of a P with pp_size={remote.pp_size}; D expected "
            f"stage {s} with layers [{stage.start}, {stage.stop}) of pp_size={len(stages)}: "
            "set prefill.pp_size and prefill.pp_layer_partition on D as P runs")
    per_layer = n_local // layout.num_layers
    if p_region_count(remote) != len(stage) * per_layer:
        raise HandshakeMismatchError(
            f"P has {p_region_count(remote)} KV regions, D has {len(stage) * per_layer} "
            f"for layers [{stage.start}, {stage.stop})")
    first = stage.start * per_layer
    return [(first + j, j) for j in range(len(stage) * per_layer)]


def _rank_plan(layout: KVCacheLayout, remote: AgentMeta, p_rank: int,
               plan: Sequence[HeadSlice], stages: Sequence[range] | None) -> RankPlan:
    """What D reads of P rank ``p_rank`` (``remote``): the contiguous slices of its regions
    as segments, and the regions whose heads must be staged.

    Raises:
        HandshakeMismatchError: P's regions or stages do not match this cache
            (:func:`_region_pairs`), or the head plan names more heads than a block holds.
    """
    slices = [s for s in plan if s.remote_rank == p_rank]
    local_regions = layout.regions
    segments: list[Segment] = []
    p_regions: list[int] = []
    staged: dict[int, tuple[int, list[HeadSlice]]] = {}
    for i, j in _region_pairs(layout, remote, p_rank, stages):
        region = local_regions[i]
        r_len = remote.layout.block_lens[j]
        # a keyed P: no base, no stride (each block's address comes with the claim's grant)
        r_base, r_stride = ((remote.region_addrs[j], remote.region_strides[j])
                            if remote.region_addrs else (0, 0))
        if region.head_axis is not None and any(
                s.local_offset + s.num_heads > heads_in_block(region) for s in slices):
            # a plan of more heads than the block holds would read into the next blocks
            raise HandshakeMismatchError(
                f"the head plan {slices} names more than the {heads_in_block(region)} KV "
                f"heads a block of region {i} holds")
        for sl in slices:
            if region.head_axis is None or (sl.num_heads == heads_in_block(region)
                                            and r_len == region.block_len):
                off_l = off_r = 0
                length = region.block_len
            elif region.head_axis == 0:
                per_head = region.block_len // heads_in_block(region)
                off_l, off_r = sl.local_offset * per_head, sl.remote_offset * per_head
                length = sl.num_heads * per_head
            else:
                staged.setdefault(i, (j, []))[1].append(sl)
                continue
            segments.append((region.base_addr, region.block_stride, off_l, r_base, r_stride,
                             off_r, length))
            p_regions.append(j)
    return RankPlan(segments, staged, p_regions)


def check_remote_blocks(meta: RecvMeta, remote: AgentMeta) -> None:
    """Raise :class:`RemoteKVUnavailable` (``bad_blocks``) for a remote block id outside P
    rank ``remote``'s cache."""
    ids = meta.remote_block_ids
    p_blocks = remote.layout.num_blocks
    if ids and not (min(ids) >= 0 and max(ids) < p_blocks):
        bad = next(b for b in ids if not 0 <= b < p_blocks)
        raise RemoteKVUnavailable(f"remote block id {bad} is outside P's cache "
                                  f"[0, {p_blocks})", code="bad_blocks")


def direct_ranges(meta: RecvMeta, segments: Sequence[Segment]
                  ) -> tuple[list[int], list[int], list[int]]:
    """The byte ranges (local addresses, remote addresses, lengths) of the request's blocks
    in a P rank's direct ``segments`` (:meth:`DirectPlan.ranges`, for a caller without a
    kept plan)."""
    return DirectPlan(segments).ranges(LoadBlocks(meta.local_block_ids, meta.remote_block_ids))


def _read_staged(te: MooncakeTransferEngine, region: KVRegion, index: int, meta: RecvMeta,
                 remotes: Mapping[int, AgentMeta], slices: list[HeadSlice],
                 grants: Mapping[int, np.ndarray]) -> int:
    """A region's heads that are not contiguous in a block (NPU layout; ``index``: the
    region's index in P's ranks, those of one pipeline stage): read the
    whole P blocks into staging buffers, select each slice's heads, merge them in local
    head order and scatter the merged blocks into the local cache."""
    axis = region.head_axis
    assert axis is not None
    heads_local = heads_in_block(region)
    if sum(s.num_heads for s in slices) != heads_local:
        raise HandshakeMismatchError(
            f"the head plan covers {sum(s.num_heads for s in slices)} of the {heads_local} "
            f"KV heads of region {index}")
    per_head = region.block_len // heads_local
    n = len(meta.local_block_ids)
    moved = 0
    buffers: dict[int, torch.Tensor] = {}
    for p_rank in sorted({s.remote_rank for s in slices}):
        remote = remotes[p_rank]
        table = grants.get(p_rank)
        p_addrs = (table[index].tolist() if table is not None else
                   [remote.region_addrs[index] + rb * remote.region_strides[index]
                    for rb in meta.remote_block_ids])
        shape = list(region.block_shape)
        shape[axis] = remote.layout.block_lens[index] // per_head
        buf = torch.empty((n, *shape), dtype=region.tensor.dtype, device=region.tensor.device)
        nbytes = buf[0].numel() * buf.element_size()
        te.register_memory(buf.data_ptr(), buf.numel() * buf.element_size())
        try:
            moved += te.read(remote.session, [buf.data_ptr() + k * nbytes for k in range(n)],
                             p_addrs, [nbytes] * n)
        finally:
            te.unregister_memory(buf.data_ptr())
        buffers[p_rank] = buf
    # head resharding with ascend-kernels' head and block ops (NPU fast paths on NPU)
    merged = merge_head_slices(buffers, slices, axis)
    scatter_blocks(merged, region.tensor, torch.tensor(meta.local_block_ids, dtype=torch.long))
    return moved

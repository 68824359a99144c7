# SPDX-License-Identifier: Apache-2.0
"""Extra process groups of vLLM on Ascend: the P-side TP group for P/D head resharding,
MC2, fine-grained TP, flashcomm2, shard-weight, fc3 and dynamic-EPLB groups.

**Groups are vLLM ``GroupCoordinator`` objects**, made with vLLM's
``init_model_parallel_group``, as upstream does: callers use the same
``.device_group`` / ``.cpu_group`` / ``.rank_in_group`` / ``.all_gather``
as on vLLM's own TP and DP groups, each group gets its device communicator
(``NPUCommunicator`` on Ascend, ``CpuCommunicator`` on CPU), and vLLM's
``destroy_model_parallel`` bookkeeping sees them. vLLM is a peer dependency,
imported when a group is created; the rank arithmetic (``*_group_ranks``)
is plain torch and needs no process group. Any ``torch.distributed``
backend works: HCCL on NPU, NCCL on CUDA, gloo on CPU.

Group layouts follow upstream (``vllm_ascend/distributed/parallel_state.py``):
ranks are laid out ``(external_dp, dp, pp, pcp, tp)``, TP fastest. Where
upstream reads ``get_ascend_config()``, this module takes an
:class:`AscendParallelOptions` (built from a ``VllmConfig`` with
:meth:`AscendParallelOptions.from_vllm_config`, or by hand).

Differences from upstream, on purpose:

* getters raise :class:`GroupNotInitializedError` (also an ``AssertionError``)
  naming the group and how it gets created;
* the P-side TP group can be created on its own with :func:`init_p_tp_group`
  (idempotent), which is what the P/D connectors call: they run without
  vLLM-Ascend's worker, which is where upstream creates it;
* a group is named after the index of the group holding this process's
  *global* rank (upstream compared the local rank, wrong on multi-node);
* only groups this module created are destroyed (the flashcomm2 ODP group
  may be vLLM's TP group).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .device_communicators._vllm import vllm_module
from .device_communicators.errors import (
    DistributedNotInitializedError,
    GroupAlreadyInitializedError,
    GroupNotInitializedError,
    ParallelLayoutError,
)

if TYPE_CHECKING:
    from vllm.distributed.parallel_state import GroupCoordinator

logger = logging.getLogger(__name__)

# Currently, mc2 ops need their own group coordinator.
_MC2: GroupCoordinator | None = None
# Module-specific tensor parallel groups.
_MLP_TP: GroupCoordinator | None = None
_OTP: GroupCoordinator | None = None
_LMTP: GroupCoordinator | None = None
_EMBED_TP: GroupCoordinator | None = None
# flashcomm specific groups.
_FLASHCOMM2_OTP: GroupCoordinator | None = None
_FLASHCOMM2_ODP: GroupCoordinator | None = None
_FLASHCOMM2_ENABLED = False
_FC3_QUANT_X: GroupCoordinator | None = None
# shard_weight across rank groups.
_SHARD_WEIGHT: GroupCoordinator | None = None
# P-side TP group: the all-to-all group of P/D head resharding.
_P_TP: GroupCoordinator | None = None
_DYNAMIC_EPLB: GroupCoordinator | None = None

#: ids of the coordinators this module created (and so destroys).
_OWNED: dict[int, GroupCoordinator] = {}


# ---------------------------------------------------------------- options
def pd_ratios(prefill_tp: int, decode_tp: int, num_kv_heads: int, *,
              is_mla: bool = False) -> tuple[int, int, int]:
    """``(pd_tp_ratio, pd_head_ratio, num_head_replica)`` of a P/D pair, as upstream derives them.

    MLA caches are not split by heads: all three are 1. A decode TP larger
    than the prefill TP needs no P-side group either (D selects its head part
    itself): also all 1.

    Raises:
        ParallelLayoutError: Non-positive sizes, or TP sizes neither of which
            divides the other.
    """
    for name, v in (("prefill tp_size", prefill_tp), ("decode tp_size", decode_tp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ParallelLayoutError(f"{name} must be a positive int, got {v!r}")
    if is_mla:
        return 1, 1, 1
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        raise ParallelLayoutError(
            f"prefill tp_size {prefill_tp} and decode tp_size {decode_tp}: one must be a "
            "multiple of the other")
    pd_tp_ratio = prefill_tp // decode_tp
    if pd_tp_ratio <= 1:
        return 1, 1, 1
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ParallelLayoutError(
            f"a positive total KV head count is needed for P/D with pd_tp_ratio {pd_tp_ratio}, "
            f"got {num_kv_heads!r}")
    num_head_replica = prefill_tp // num_kv_heads if prefill_tp >= num_kv_heads else 1
    pd_head_ratio = min(prefill_tp, num_kv_heads) // min(decode_tp, num_kv_heads)
    return pd_tp_ratio, pd_head_ratio, num_head_replica


@dataclass(frozen=True)
class AscendParallelOptions:
    """What decides which extra groups exist (upstream reads these from its ascend config).

    Attributes:
        pd_tp_ratio: Prefill TP / decode TP (see :func:`pd_ratios`).
        pd_head_ratio: Ratio of KV heads per rank between P and D.
        num_head_replica: P ranks holding each KV head.
        is_kv_producer: This instance is a P (prefill) instance.
        dynamic_eplb: Create the ``dynamic_eplb`` group.
        multistream_overlap_gate: Create the ``fc3_quant_x`` group.
        oproj_tensor_parallel_size: Fine-grained TP size of o_proj (0: off).
        lmhead_tensor_parallel_size: Fine-grained TP size of the LM head (0: off).
        embedding_tensor_parallel_size: Fine-grained TP size of the embedding (0: off).
        mlp_tensor_parallel_size: Fine-grained TP size of the MLP (0: off).
        flashcomm2_oproj_tensor_parallel_size: flashcomm2 o_proj TP size (0: flashcomm2 off).
        layer_sharding: Create the ``shard_weight`` group.
        dsa_cp: DSA context parallel with layer sharding (shard layers replicated).
    """

    pd_tp_ratio: int = 1
    pd_head_ratio: int = 1
    num_head_replica: int = 1
    is_kv_producer: bool = False
    dynamic_eplb: bool = False
    multistream_overlap_gate: bool = False
    oproj_tensor_parallel_size: int = 0
    lmhead_tensor_parallel_size: int = 0
    embedding_tensor_parallel_size: int = 0
    mlp_tensor_parallel_size: int = 0
    flashcomm2_oproj_tensor_parallel_size: int = 0
    layer_sharding: bool = False
    dsa_cp: bool = False

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> AscendParallelOptions:
        """Read the options from a ``VllmConfig``.

        ``additional_config`` keys (vLLM-Ascend's names): ``multistream_overlap_gate``,
        ``eplb_config.dynamic_eplb``, ``finegrained_tp_config.{oproj,lmhead,embedding,mlp}
        _tensor_parallel_size``, ``flashcomm2_oproj_tensor_parallel_size`` (else env
        ``VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE``), ``layer_sharding``, ``enable_dsa_cp``.
        The P/D ratios come from ``kv_transfer_config`` extra config
        ``prefill.tp_size`` / ``decode.tp_size`` and the model's KV heads.
        """
        extra: Mapping[str, Any] = getattr(vllm_config, "additional_config", None) or {}
        fine: Mapping[str, Any] = extra.get("finegrained_tp_config") or {}
        eplb: Mapping[str, Any] = extra.get("eplb_config") or {}
        fc2 = extra.get("flashcomm2_oproj_tensor_parallel_size",
                        os.environ.get("VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE", 0))
        kv = getattr(vllm_config, "kv_transfer_config", None)
        ratios = (1, 1, 1)
        producer = bool(kv is not None and getattr(kv, "is_kv_producer", False))
        model = getattr(vllm_config, "model_config", None)
        if kv is not None and model is not None:
            extra_kv = getattr(kv, "kv_connector_extra_config", None) or {}
            prefill = int((extra_kv.get("prefill") or {}).get("tp_size", 1))
            decode = int((extra_kv.get("decode") or {}).get("tp_size", 1))
            is_mla = bool(getattr(model, "is_deepseek_mla", False) or getattr(model, "use_mla",
                                                                               False))
            heads = 0 if is_mla or prefill <= decode else int(model.get_total_num_kv_heads())
            ratios = pd_ratios(prefill, decode, heads, is_mla=is_mla)
        return cls(
            pd_tp_ratio=ratios[0], pd_head_ratio=ratios[1], num_head_replica=ratios[2],
            is_kv_producer=producer,
            dynamic_eplb=bool(eplb.get("dynamic_eplb", False)),
            multistream_overlap_gate=bool(extra.get("multistream_overlap_gate", False)),
            oproj_tensor_parallel_size=int(fine.get("oproj_tensor_parallel_size", 0) or 0),
            lmhead_tensor_parallel_size=int(fine.get("lmhead_tensor_parallel_size", 0) or 0),
            embedding_tensor_parallel_size=int(fine.get("embedding_tensor_parallel_size", 0)
                                               or 0),
            mlp_tensor_parallel_size=int(fine.get("mlp_tensor_parallel_size", 0) or 0),
            flashcomm2_oproj_tensor_parallel_size=int(fc2 or 0),
            layer_sharding=extra.get("layer_sharding") is not None,
            dsa_cp=bool(extra.get("enable_dsa_cp", False)),
        )


# ---------------------------------------------------------------- rank layouts
@dataclass(frozen=True)
class RankLayout:
    """The parallel sizes of an instance and its world size."""

    world_size: int
    dp: int = 1
    pp: int = 1
    pcp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "dp", "pp", "pcp", "tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ParallelLayoutError(f"{name} must be a positive int, got {v!r}")
        block = self.dp * self.pp * self.pcp * self.tp
        if self.world_size % block:
            raise ParallelLayoutError(
                f"world size {self.world_size} is not a multiple of dp*pp*pcp*tp = "
                f"{self.dp}*{self.pp}*{self.pcp}*{self.tp} = {block}")

    @classmethod
    def from_parallel_config(cls, parallel_config: Any, world_size: int) -> RankLayout:
        """From a vLLM ``ParallelConfig`` (or anything with its size attributes)."""
        return cls(world_size=world_size,
                   dp=int(getattr(parallel_config, "data_parallel_size", 1)),
                   pp=int(getattr(parallel_config, "pipeline_parallel_size", 1)),
                   pcp=int(getattr(parallel_config, "prefill_context_parallel_size", 1)),
                   tp=int(getattr(parallel_config, "tensor_parallel_size", 1)))

    def all_ranks(self) -> torch.Tensor:
        """``(external_dp, dp, pp, pcp, tp)`` grid of global ranks."""
        return torch.arange(self.world_size).reshape(-1, self.dp, self.pp, self.pcp, self.tp)


def _lists(groups: Any) -> list[list[int]]:
    return [[int(r) for r in g.tolist()] for g in groups]


def p_tp_group_ranks(layout: RankLayout, pd_tp_ratio: int,
                     num_head_replica: int = 1) -> list[list[int]]:
    """Ranks of the P-side all-to-all groups of head resharding (upstream's ``_P_TP``).

    Without head replicas, groups of ``pd_tp_ratio`` consecutive TP ranks (the
    P ranks whose heads one D rank holds). With ``num_head_replica > 1`` (more
    P ranks than KV heads), the ranks holding distinct heads, replica by
    replica, cut into groups of ``tp / num_head_replica / (tp / pd_tp_ratio)``.

    Raises:
        ParallelLayoutError: Ratios that do not divide the TP size.
    """
    if pd_tp_ratio < 1 or layout.tp % pd_tp_ratio:
        raise ParallelLayoutError(
            f"pd_tp_ratio {pd_tp_ratio} must divide the prefill TP size {layout.tp}")
    all_ranks = layout.all_ranks()
    if num_head_replica <= 1:
        return _lists(all_ranks.reshape(-1, pd_tp_ratio).unbind(0))
    remote_tp = layout.tp // pd_tp_ratio
    if layout.tp % num_head_replica or (layout.tp // num_head_replica) % remote_tp:
        raise ParallelLayoutError(
            f"num_head_replica {num_head_replica} with TP {layout.tp} and decode TP {remote_tp}: "
            "the KV heads per replica must split evenly between the decode ranks")
    outer = layout.dp * layout.pp * layout.pcp * (layout.world_size // (
        layout.dp * layout.pp * layout.pcp * layout.tp))
    g = all_ranks.reshape(outer, -1, num_head_replica).permute(0, 2, 1)
    g = g.reshape(-1, g.size(-1))  # [outer * replica, num_head]
    size = g.size(-1) // remote_tp
    return _lists(g.reshape(-1, size).unbind(0))


def mc2_group_ranks(layout: RankLayout) -> list[list[int]]:
    """EP-like groups: every ``dp * pcp * tp`` rank of one (external DP, PP) slice."""
    g = layout.all_ranks().transpose(1, 2).reshape(-1, layout.dp * layout.pcp * layout.tp)
    return _lists(g.unbind(0))


def finegrained_tp_group_ranks(layout: RankLayout, group_size: int) -> list[list[int]]:
    """Fine-grained TP across DP: for each PP stage and TP rank, chunks of ``group_size`` DP ranks.

    Raises:
        ParallelLayoutError: ``group_size`` does not divide the DP size.
    """
    if group_size < 1 or layout.dp % group_size:
        raise ParallelLayoutError(
            f"fine-grained TP size {group_size} must divide the data parallel size {layout.dp}")
    grid = torch.arange(layout.world_size).reshape(layout.pp, layout.dp, layout.tp)
    groups = []
    for pp in range(layout.pp):
        stage = grid[pp]
        for chunk in range(layout.dp // group_size):
            for tp in range(layout.tp):
                groups.append(stage[chunk * group_size:(chunk + 1) * group_size, tp].tolist())
    return groups


def flashcomm2_group_ranks(layout: RankLayout,
                           otp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(otp_groups, odp_groups)`` of flashcomm2 for an o_proj TP size ``otp_size > 1``.

    Raises:
        ParallelLayoutError: ``otp_size`` does not divide the TP size.
    """
    if otp_size < 1 or layout.tp % otp_size:
        raise ParallelLayoutError(
            f"flashcomm2 o_proj TP size {otp_size} must divide the TP size {layout.tp}")
    num_groups = layout.tp // otp_size
    otp: list[list[int]] = []
    odp: list[list[int]] = [[] for _ in range(otp_size * layout.dp * layout.pp)]
    for dp in range(layout.dp):
        for pp in range(layout.pp):
            serial = dp * layout.pp + pp
            tp_base, odp_base = serial * layout.tp, serial * otp_size
            for i in range(num_groups):
                ranks = []
                for j in range(otp_size):
                    rank = tp_base + i + j * num_groups
                    ranks.append(rank)
                    odp[odp_base + j].append(rank)
                otp.append(ranks)
    return otp, odp


def shard_weight_group_ranks(layout: RankLayout,
                             module_tp_groups: Sequence[Sequence[int]] | None) -> list[list[int]]:
    """Ranks of the ``shard_weight`` groups (layers sharded across PP stages).

    Args:
        layout: The instance's sizes.
        module_tp_groups: The TP groups of the sharded module, or ``None``
            when the module is replicated (TP size 1).
    """
    all_ranks = layout.all_ranks()
    if module_tp_groups is None:
        pp_groups = all_ranks.transpose(2, 4).reshape(-1, layout.pp)
        return _lists(pp_groups.transpose(0, 1).unbind(0))
    module = torch.tensor([list(g) for g in module_tp_groups])
    transposed = module.transpose(0, 1)
    g = layout.world_size // (layout.pp * module.size(1))
    stacked = torch.stack([t.reshape(layout.pp, g) for t in transposed], dim=1)
    return [[int(r) for r in row] for row in stacked.reshape(-1, g).tolist()]


# ---------------------------------------------------------------- creation
def _parallel_state() -> Any:
    return vllm_module("vllm.distributed.parallel_state", what="ascend-dist-utils process groups")


def _world_defaults(backend: str | None, local_rank: int | None) -> tuple[str, int, int]:
    """``(backend, local_rank, world_size)``: vLLM's world group's, else torch.distributed's."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise DistributedNotInitializedError(
            "torch.distributed is not initialised: start vLLM's distributed environment "
            "(init_distributed_environment) or torch.distributed.init_process_group first")
    world = getattr(_parallel_state(), "_WORLD", None)
    if backend is None:
        backend = str(torch.distributed.get_backend(world.device_group if world is not None
                                                    else None))
    if local_rank is None:
        local_rank = world.local_rank if world is not None else int(
            os.environ.get("LOCAL_RANK", torch.distributed.get_rank()))
    return backend, int(local_rank), torch.distributed.get_world_size()


def _new_group(group_ranks: list[list[int]], local_rank: int, backend: str,
               name: str) -> GroupCoordinator:
    coordinator = _parallel_state().init_model_parallel_group(
        group_ranks, local_rank, backend, group_name=name)
    _OWNED[id(coordinator)] = coordinator
    logger.debug("created group %s: %s", name, group_ranks)
    return coordinator  # type: ignore[no-any-return]


def _group_index(group_ranks: list[list[int]]) -> int:
    me = torch.distributed.get_rank()
    return next(i for i, ranks in enumerate(group_ranks) if me in ranks)


def init_p_tp_group(parallel_config: Any, pd_tp_ratio: int, num_head_replica: int = 1, *,
                    backend: str | None = None, local_rank: int | None = None) -> GroupCoordinator:
    """Create (once) the P-side TP group of P/D head resharding; returns it.

    A collective: every rank of the world calls it with the same arguments.
    Calling it again with the same layout returns the existing group.

    Args:
        parallel_config: The P instance's vLLM ``ParallelConfig`` (sizes).
        pd_tp_ratio: Prefill TP / decode TP (> 1).
        num_head_replica: P ranks holding each KV head (see :func:`pd_ratios`).
        backend: torch.distributed backend (default: the world group's).
        local_rank: This process's local rank (default: the world group's).

    Raises:
        GroupAlreadyInitializedError: A P-side group of another layout exists.
    """
    global _P_TP
    backend, local_rank, world_size = _world_defaults(backend, local_rank)
    layout = RankLayout.from_parallel_config(parallel_config, world_size)
    ranks = p_tp_group_ranks(layout, pd_tp_ratio, num_head_replica)
    if _P_TP is not None:
        if _P_TP.group_ranks == ranks:
            return _P_TP
        raise GroupAlreadyInitializedError(
            f"the P-side TP group exists with ranks {_P_TP.group_ranks}, not {ranks}: "
            "destroy_ascend_model_parallel() first")
    _P_TP = _new_group(ranks, local_rank, backend, f"p_tp_{_group_index(ranks)}")
    return _P_TP


def init_ascend_model_parallel(parallel_config: Any,
                               options: AscendParallelOptions | None = None, *,
                               backend: str | None = None,
                               local_rank: int | None = None) -> None:
    """Create the Ascend process groups ``options`` asks for (a collective; idempotent).

    Always the MC2 group; the P-side TP group on a KV producer with
    ``pd_head_ratio > 1``; dynamic-EPLB and fc3 groups (same ranks as MC2) when
    enabled; fine-grained TP groups for each size > 0 (one group per distinct
    size); flashcomm2 groups; the shard-weight group.

    Args:
        parallel_config: vLLM ``ParallelConfig`` (sizes).
        options: Which groups (default: :class:`AscendParallelOptions` defaults, MC2 only).
        backend: torch.distributed backend (default: the world group's).
        local_rank: This process's local rank (default: the world group's).
    """
    global _MC2, _DYNAMIC_EPLB, _FC3_QUANT_X, _OTP, _LMTP, _EMBED_TP, _MLP_TP
    global _FLASHCOMM2_OTP, _FLASHCOMM2_ODP, _FLASHCOMM2_ENABLED, _SHARD_WEIGHT
    if model_parallel_initialized():
        return
    opts = options or AscendParallelOptions()
    backend, local_rank, world_size = _world_defaults(backend, local_rank)
    layout = RankLayout.from_parallel_config(parallel_config, world_size)

    if opts.pd_head_ratio > 1 and opts.is_kv_producer:
        init_p_tp_group(parallel_config, opts.pd_tp_ratio, opts.num_head_replica,
                        backend=backend, local_rank=local_rank)

    mc2 = mc2_group_ranks(layout)
    _MC2 = _new_group(mc2, local_rank, backend, "mc2")
    if opts.dynamic_eplb:
        _DYNAMIC_EPLB = _new_group(mc2, local_rank, backend, "dynamic_eplb")
    if opts.multistream_overlap_gate:
        _FC3_QUANT_X = _new_group(mc2, local_rank, backend, "fc3_quant_x")

    cache: dict[int, GroupCoordinator] = {}

    def fine_grained(size: int, name: str) -> GroupCoordinator | None:
        if size <= 0:
            return None
        if size not in cache:
            cache[size] = _new_group(finegrained_tp_group_ranks(layout, size), local_rank,
                                     backend, name)
        return cache[size]

    _OTP = fine_grained(opts.oproj_tensor_parallel_size, "otp")
    _LMTP = fine_grained(opts.lmhead_tensor_parallel_size, "lmheadtp")
    _EMBED_TP = fine_grained(opts.embedding_tensor_parallel_size, "emtp")
    _MLP_TP = fine_grained(opts.mlp_tensor_parallel_size, "mlptp")

    otp_ranks: list[list[int]] = []
    if opts.flashcomm2_oproj_tensor_parallel_size > 0:
        _FLASHCOMM2_ENABLED = True
        _FLASHCOMM2_OTP = None
        size = opts.flashcomm2_oproj_tensor_parallel_size
        if size > 1:
            otp_ranks, odp_ranks = flashcomm2_group_ranks(layout, size)
            _FLASHCOMM2_OTP = _new_group(otp_ranks, local_rank, backend, "flashcomm2_otp")
            _FLASHCOMM2_ODP = _new_group(odp_ranks, local_rank, backend, "flashcomm2_odp")
        else:
            _FLASHCOMM2_ODP = _parallel_state().get_tp_group()

    if opts.layer_sharding:
        module_groups: list[list[int]] | None
        if opts.flashcomm2_oproj_tensor_parallel_size > 0:
            module_groups = otp_ranks or None
        elif opts.dsa_cp:
            module_groups = None
        else:
            module_groups = _lists(layout.all_ranks().reshape(-1, layout.tp).unbind(0))
        _SHARD_WEIGHT = _new_group(shard_weight_group_ranks(layout, module_groups), local_rank,
                                   backend, "shard_weight")


def model_parallel_initialized() -> bool:
    """Whether :func:`init_ascend_model_parallel` ran (the MC2 group exists)."""
    return _MC2 is not None


def destroy_ascend_model_parallel() -> None:
    """Destroy every group this module created and forget all of them."""
    global _MC2, _MLP_TP, _OTP, _LMTP, _EMBED_TP, _FLASHCOMM2_OTP, _FLASHCOMM2_ODP
    global _FLASHCOMM2_ENABLED, _FC3_QUANT_X, _SHARD_WEIGHT, _P_TP, _DYNAMIC_EPLB
    for coordinator in list(_OWNED.values()):
        try:
            coordinator.destroy()
        except Exception:  # one failing group must not keep the others alive
            logger.exception("destroying group %s failed", getattr(coordinator, "unique_name",
                                                                   "?"))
    _OWNED.clear()
    _MC2 = _MLP_TP = _OTP = _LMTP = _EMBED_TP = None
    _FLASHCOMM2_OTP = _FLASHCOMM2_ODP = _FC3_QUANT_X = _SHARD_WEIGHT = None
    _P_TP = _DYNAMIC_EPLB = None
    _FLASHCOMM2_ENABLED = False


# ---------------------------------------------------------------- getters
def _get(group: GroupCoordinator | None, what: str, how: str) -> GroupCoordinator:
    if group is None:
        raise GroupNotInitializedError(f"the {what} group is not initialized: {how}")
    return group


_BY_INIT = "call init_ascend_model_parallel(parallel_config, options) first"


def get_mc2_group() -> GroupCoordinator:
    """The MC2 group (MoE dispatch/combine)."""
    return _get(_MC2, "mc2", _BY_INIT)


def get_mlp_tp_group() -> GroupCoordinator:
    """The fine-grained MLP TP group."""
    return _get(_MLP_TP, "mlp tensor parallel",
                f"set options.mlp_tensor_parallel_size > 0 and {_BY_INIT}")


def get_otp_group() -> GroupCoordinator:
    """The fine-grained o_proj TP group."""
    return _get(_OTP, "output tensor parallel",
                f"set options.oproj_tensor_parallel_size > 0 and {_BY_INIT}")


def get_lmhead_tp_group() -> GroupCoordinator:
    """The fine-grained LM-head TP group."""
    return _get(_LMTP, "lm head tensor parallel",
                f"set options.lmhead_tensor_parallel_size > 0 and {_BY_INIT}")


def get_embed_tp_group() -> GroupCoordinator:
    """The fine-grained embedding TP group."""
    return _get(_EMBED_TP, "embedding tensor parallel",
                f"set options.embedding_tensor_parallel_size > 0 and {_BY_INIT}")


def get_flashcomm2_otp_group() -> GroupCoordinator | None:
    """flashcomm2's o_proj TP group; ``None`` when its size is 1 (as upstream)."""
    if not _FLASHCOMM2_ENABLED:
        raise GroupNotInitializedError(
            "the flashcomm2 o_proj tensor parallel group is not initialized: set "
            f"options.flashcomm2_oproj_tensor_parallel_size > 0 and {_BY_INIT}")
    return _FLASHCOMM2_OTP


def get_flashcomm2_odp_group() -> GroupCoordinator:
    """flashcomm2's o_proj data parallel group (vLLM's TP group when the o_proj TP size is 1)."""
    return _get(_FLASHCOMM2_ODP, "flashcomm2 output data parallel",
                f"set options.flashcomm2_oproj_tensor_parallel_size > 0 and {_BY_INIT}")


def get_shard_weight_group() -> GroupCoordinator:
    """The layer-sharding group."""
    return _get(_SHARD_WEIGHT, "shard weight", f"set options.layer_sharding and {_BY_INIT}")


def get_p_tp_group() -> GroupCoordinator:
    """The P-side TP group: the all-to-all group of P/D head resharding."""
    return _get(_P_TP, "P-side tensor parallel (P/D head resharding)",
                "it exists on a KV producer whose prefill TP is a multiple of the decode TP "
                "(pd_head_ratio > 1); call init_p_tp_group(parallel_config, pd_tp_ratio, "
                "num_head_replica) or init_ascend_model_parallel first")


def get_fc3_quant_x_group() -> GroupCoordinator:
    """The fc3 quant-x all-gather group (multistream overlap gate)."""
    return _get(_FC3_QUANT_X, "fc3 quant x",
                f"set options.multistream_overlap_gate and {_BY_INIT}")


def get_dynamic_eplb_group() -> GroupCoordinator:
    """The dynamic-EPLB group."""
    return _get(_DYNAMIC_EPLB, "dynamic eplb", f"set options.dynamic_eplb and {_BY_INIT}")


def get_mlp_tensor_model_parallel_world_size() -> int:
    """World size of the fine-grained MLP TP group."""
    return int(get_mlp_tp_group().world_size)


def get_mlp_tensor_model_parallel_rank() -> int:
    """This rank in the fine-grained MLP TP group."""
    return int(get_mlp_tp_group().rank_in_group)

# SPDX-License-Identifier: Apache-2.0
"""What the pool needs to know about the engine, read once from vLLM's config.

:class:`PoolContext` is a small frozen record, so the scheduler and worker
logic can be built and tested without a ``VllmConfig``;
:func:`context_from_vllm` fills it from one.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from vllm_ascend.distributed.kernels.heads import head_group_of_rank, num_head_groups
from vllm_ascend.distributed.kv_transfer.core.kv_groups import KVGroups
from vllm_ascend.distributed.kv_transfer.core.ranks import rank_info_from_vllm

from .keys import KeyMetadata, model_key_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolContext:
    """Engine facts shared by the pool's scheduler and worker sides."""

    model_name: str
    block_size: int
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_rank: int = 0
    num_kv_heads: int = 1
    use_mla: bool = False
    kv_role: str = "kv_both"
    engine_id: str = "engine"
    #: cache fingerprint mixed into block hashes (dtype, block size, TP size)
    salt: str = ""
    num_layers: int = 1
    #: vLLM publishes KV cache events (``kv_events_config.enable_kv_cache_events``)
    kv_events: bool = False
    #: vLLM's KV cache groups (one, unless the hybrid KV cache manager is on)
    groups: KVGroups = field(default_factory=lambda: KVGroups.from_config(None))

    @property
    def hybrid(self) -> bool:
        """Several KV cache groups (vLLM's hybrid KV cache manager on a hybrid model)."""
        return self.groups.hybrid

    @property
    def is_consumer(self) -> bool:
        """A ``kv_consumer`` (decode) instance."""
        return self.kv_role == "kv_consumer"

    @property
    def is_lookup_rank(self) -> bool:
        """The worker that answers the scheduler's lookups (TP rank 0 of PP stage 0)."""
        return self.tp_rank == 0 and self.pp_rank == 0

    @property
    def key_heads(self) -> int:
        """KV heads as keys see them (1 for MLA: every rank holds the same latent cache)."""
        return 1 if self.use_mla else max(1, self.num_kv_heads)

    def head_rank_and_step(self) -> tuple[int, int]:
        """``(head_or_tp_rank, put_step)`` of this rank."""
        return head_group_of_rank(self.tp_rank, self.tp_size, self.key_heads)

    def num_head_groups(self) -> int:
        """Distinct head groups across the TP group."""
        return num_head_groups(self.tp_size, self.key_heads)

    def key_metadata(self) -> KeyMetadata:
        """Key metadata of this rank."""
        head, _step = self.head_rank_and_step()
        return KeyMetadata(self.model_name, head, 0, 0, self.pp_rank)


def context_from_vllm(vllm_config: Any, kv_cache_config: Any = None) -> PoolContext:
    """Read a :class:`PoolContext` from a ``VllmConfig`` (worker ranks from vLLM's groups)
    and the ``KVCacheConfig`` vLLM hands the connector (its KV cache groups).

    With several groups (the hybrid KV cache manager on) the groups' layout is mixed into the
    cache fingerprint: an instance with the manager off (one tensor per layer) or with other
    windows never reads these objects, nor these instances its.

    Raises:
        ValueError: prefill/decode context parallelism, which the pool does not support.
    """
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    kv = vllm_config.kv_transfer_config
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    if pcp > 1 or dcp > 1:
        raise ValueError(f"AscendStoreConnector does not support context parallelism yet "
                         f"(prefill_context_parallel_size={pcp}, "
                         f"decode_context_parallel_size={dcp})")
    tp_size = int(parallel.tensor_parallel_size)
    pp_size = int(parallel.pipeline_parallel_size)
    # worker ranks from vLLM's groups; the scheduler process derives them from the config
    ranks = rank_info_from_vllm(parallel)
    use_mla = bool(getattr(model, "use_mla", False))
    try:
        num_kv_heads = int(model.get_total_num_kv_heads())
    except Exception:  # pooling or odd models: heads only matter for key sharing
        num_kv_heads = tp_size
    try:
        num_layers = int(model.get_num_layers(parallel))
    except Exception:
        num_layers = 1
    dtype = str(getattr(cache, "cache_dtype", "auto"))
    if dtype == "auto":
        dtype = str(getattr(model, "dtype", "")).replace("torch.", "")
    try:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type)
    except Exception:
        device = ""
    salt = f"v1|{dtype}|bs{cache.block_size}|tp{tp_size}|{device}"
    groups = KVGroups.from_config(kv_cache_config)
    if groups.hybrid:
        layout = "|".join(groups.signature()).encode()
        salt += f"|hma:{hashlib.sha256(layout).hexdigest()[:16]}"
    events_config = getattr(vllm_config, "kv_events_config", None)
    kv_events = bool(events_config is not None
                     and getattr(events_config, "enable_kv_cache_events", False))
    return PoolContext(
        model_name=model_key_name(str(model.model)),
        block_size=int(cache.block_size),
        tp_size=tp_size, tp_rank=ranks.tp_rank, pp_size=pp_size, pp_rank=ranks.pp_rank,
        dp_rank=ranks.dp_rank,
        num_kv_heads=num_kv_heads, use_mla=use_mla,
        kv_role=str(getattr(kv, "kv_role", "kv_both") or "kv_both"),
        engine_id=str(getattr(kv, "engine_id", None) or "engine"),
        salt=salt, num_layers=num_layers, kv_events=kv_events, groups=groups)

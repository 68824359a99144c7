# SPDX-License-Identifier: Apache-2.0
"""The contract between the scheduler side and the workers of ``CPUOffloadingConnector``.

What the scheduler tells the workers each step (:class:`CPUOffloadingConnectorMetadata`,
vLLM's name for a step's payload, holding :class:`HostLoad` and :class:`HostSave`
records), and the facts both sides derive alike from vLLM's config: the metadata
server's endpoint (:func:`endpoint_for`) and the tokens per block
(:func:`block_size_of`). The workers import this module, never the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.kv_groups import KVGroups
from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("CPUOffloadingConnector")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorMetadata,
)

from .config import CPUOffloadConfig  # noqa: E402
from .cpu_offload_manager.client import default_endpoint  # noqa: E402

__all__ = ["CPUOffloadingConnectorMetadata", "HostLoad", "HostSave", "block_size_of",
           "endpoint_for"]


@dataclass
class HostLoad:
    """Blocks of one request to copy from host memory into the device cache this step.

    Attributes:
        req_id: the request.
        host_ids: host block of each loaded block.
        device_ids: device block each host block goes to (same order).
        sync_tail: the last block is loaded although the step recomputes its last
            token (a full prompt hit): it is copied before the forward, on the compute
            stream, so the recomputed token lands after the copy.
        failed_ids: device blocks vLLM counts as loaded that cannot be loaded; reported
            through ``get_block_ids_with_load_errors`` so that vLLM recomputes them (by
            request with several KV cache groups).
        is_async: vLLM waits for the load between steps (the hybrid KV cache manager on):
            the request is reported through ``get_finished`` once its blocks are in, and a
            failed load by request.
    """

    req_id: str
    host_ids: list[int]
    device_ids: list[int]
    sync_tail: bool = False
    failed_ids: list[int] = field(default_factory=list)
    is_async: bool = False


@dataclass
class HostSave:
    """Device blocks of one request to copy into host memory after this step's forward.

    Attributes:
        req_id: the request (its blocks are freed once every rank reports the save).
        job_id: the metadata server's save job, confirmed by every rank.
        host_ids: host block of each saved block.
        device_ids: device block of each saved block (same order).
    """

    req_id: str
    job_id: int
    host_ids: list[int]
    device_ids: list[int]


@dataclass
class CPUOffloadingConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves."""

    loads: list[HostLoad] = field(default_factory=list)
    saves: list[HostSave] = field(default_factory=list)
    #: requests preempted before this step: their blocks may be reused by it
    preempted_req_ids: set[str] = field(default_factory=set)
    #: requests whose saves read a sliding window's block that vLLM freed and gave out
    #: again this step: their saves are finished before the step's forward
    wait_saves: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        """No load and no save."""
        return not self.loads and not self.saves


def endpoint_for(vllm_config: Any, cfg: CPUOffloadConfig) -> str:
    """The metadata server endpoint of this instance (same in scheduler and workers)."""
    if cfg.metadata_endpoint:
        return cfg.metadata_endpoint
    kv = vllm_config.kv_transfer_config
    engine_id = str(getattr(kv, "engine_id", None) or "default")
    dp_rank = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    return default_endpoint(engine_id, dp_rank)


def block_size_of(vllm_config: Any, kv_cache_config: Any) -> int:
    """Tokens per block: the KV cache groups' block size, else the cache config's.

    Raises:
        ConfigError: groups the connector cannot move (anything but full-attention and
            sliding-window groups of one block size), naming them.
    """
    KVGroups.from_config(kv_cache_config).refuse_unsupported("CPUOffloadingConnector",
                                                            kinds=("full", "sliding"))
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if groups:
        return int(groups[0].kv_cache_spec.block_size)
    return int(vllm_config.cache_config.block_size)

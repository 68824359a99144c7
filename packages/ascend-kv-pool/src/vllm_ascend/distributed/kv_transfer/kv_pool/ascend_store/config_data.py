# SPDX-License-Identifier: Apache-2.0
"""Metadata of the pool: what the scheduler hands the workers each step.

The scheduler decides which blocks to load and which to save; the workers do
it. A :class:`~.jobs.TransferJob` names a request, the pool hashes of a run of its
blocks and the vLLM block ids that hold (or will hold) them. Keys and hashes
live in :mod:`.keys` (re-exported here under the upstream names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("AscendStoreConnector")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata  # noqa: E402

from .jobs import LoadSpec, RequestTracker, TransferJob  # noqa: E402
from .keys import BlockHasher, KeyMetadata, LayerPoolKey, PoolKey  # noqa: E402

__all__ = ["AscendConnectorMetadata", "BlockHasher", "KeyMetadata", "LayerPoolKey", "LoadSpec",
           "PoolKey", "RequestTracker", "TransferJob"]


@dataclass
class AscendConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker payload of one step."""

    loads: list[TransferJob] = field(default_factory=list)
    saves: list[TransferJob] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.preempted_req_ids)

# SPDX-License-Identifier: Apache-2.0
"""The pool's contract: what the scheduler hands the workers each step.

The scheduler decides which blocks to load and which to save; the workers do
it. :class:`AscendConnectorMetadata` (vLLM's name for a step's payload) carries
:class:`~.jobs.TransferJob` records: a request, the pool hashes of a run of its
blocks and the vLLM block ids that hold (or will hold) them, with the
:class:`~.jobs.BlockEventSpec` a save announces. The workers import this
module, never the scheduler; the plain records live in the vLLM-free
:mod:`.jobs`.

Upstream's ``config_data`` names are kept: keys and hashes from :mod:`.keys`,
and the scheduler's per-request state from :mod:`.tracking`
(``LoadSpec`` is :class:`~.tracking.PoolHit`). Upstream's path :mod:`.config_data`
re-exports this module (vLLM-Ascend's wheel ships a file there too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("AscendStoreConnector")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata  # noqa: E402

from .jobs import BlockEventSpec, TransferJob  # noqa: E402
from .keys import BlockHasher, KeyMetadata, LayerPoolKey, PoolKey  # noqa: E402
from .tracking import PoolHit, RequestTracker  # noqa: E402

#: upstream's name for :class:`~.tracking.PoolHit`
LoadSpec = PoolHit

__all__ = ["AscendConnectorMetadata", "BlockEventSpec", "BlockHasher", "KeyMetadata",
           "LayerPoolKey", "LoadSpec", "PoolHit", "PoolKey", "RequestTracker", "TransferJob"]


@dataclass
class AscendConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker payload of one step."""

    loads: list[TransferJob] = field(default_factory=list)
    saves: list[TransferJob] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    #: requests whose queued saves read a sliding window's block that vLLM freed and gave
    #: out again this step: the workers wait for them before the forward pass
    wait_saves: set[str] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.preempted_req_ids or self.wait_saves)

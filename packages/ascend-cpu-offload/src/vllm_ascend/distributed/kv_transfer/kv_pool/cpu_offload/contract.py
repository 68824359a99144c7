# SPDX-License-Identifier: Apache-2.0
"""What the scheduler-side connector tells the workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("CPUOffloadingConnector")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorMetadata,
)


@dataclass
class LoadSpec:
    """Blocks of one request to copy from host memory into the device cache this step.

    Attributes:
        req_id: the request.
        host_ids: host block of each loaded block.
        device_ids: device block each host block goes to (same order).
        sync_tail: the last block is loaded although the step recomputes its last
            token (a full prompt hit): it is copied before the forward, on the compute
            stream, so the recomputed token lands after the copy.
        failed_ids: device blocks vLLM counts as loaded that cannot be loaded; reported
            through ``get_block_ids_with_load_errors`` so that vLLM recomputes them.
    """

    req_id: str
    host_ids: list[int]
    device_ids: list[int]
    sync_tail: bool = False
    failed_ids: list[int] = field(default_factory=list)


@dataclass
class SaveSpec:
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

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: requests preempted before this step: their blocks may be reused by it
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        """No load and no save."""
        return not self.loads and not self.saves

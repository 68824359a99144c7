# SPDX-License-Identifier: Apache-2.0
"""What the pull connector's scheduler tells its workers each step.

The records of :class:`MooncakeConnectorMetadata` are the whole contract between
:mod:`.pull_scheduler` (which builds them) and the workers (:mod:`.pull_worker`,
:mod:`.pull_holder`, :mod:`.pull_reader`), which import this module and never the
scheduler's, as vLLM's ``kv_connector/v1/nixl/metadata.py`` does for NIXL.

* D (``kv_consumer``): one :class:`RecvMeta` a request whose KV D pulls from P, or
  whose P blocks D only releases (``release_only``).
* P (``kv_producer``): one :class:`SendMeta` a finished request whose blocks P holds
  (delayed free) until D's ``Done`` or a lapsed lease.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .params import RemotePrefill

__all__ = ["MooncakeConnectorMetadata", "RecvMeta", "SendMeta"]

logger = logging.getLogger(__name__)


@dataclass
class RecvMeta:
    """D: pull ``remote.block_ids[-len(local_block_ids):]`` into ``local_block_ids``.

    Upstream calls this record ``ReqMeta`` (an alias in :mod:`.mooncake_connector`).
    """

    request_id: str
    local_block_ids: list[int]
    remote: RemotePrefill | None
    remote_block_ids: list[int] = field(default_factory=list)
    #: why the request's ``kv_transfer_params`` are unusable (the load fails at once)
    error: str | None = None
    #: nothing to read (local prefix hit or aborted before allocation): just release P's blocks
    release_only: bool = False


@dataclass
class SendMeta:
    """P: hold ``block_ids`` of ``request_id`` for the D instance that will pull them (the
    blocks P "sends" are read by D: named after upstream's ``requests_to_send``)."""

    request_id: str
    block_ids: list[int]
    #: the request's capability: P serves only a ``Claim`` presenting it (see
    #: :class:`~.pull_holder.LeaseHolder`); ``""`` from callers that issue none
    token: str = ""


@dataclass
class MooncakeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker payload of one step (field names as upstream's)."""

    #: D: requests to pull (or to release on P), by request id
    requests: dict[str, RecvMeta] = field(default_factory=dict)
    #: P: requests whose blocks to hold for D, by request id
    requests_to_send: dict[str, SendMeta] = field(default_factory=dict)

# SPDX-License-Identifier: Apache-2.0
"""What the layerwise connector's scheduler tells its workers each step.

The records of :class:`MooncakeLayerwiseConnectorMetadata` are the whole contract
between :mod:`.layerwise.scheduler` (which builds them) and the workers
(:mod:`.layerwise.worker`, :mod:`.layerwise.receiver`, :mod:`.layerwise.sender`),
which import this module and never the scheduler's, as vLLM's
``kv_connector/v1/nixl/metadata.py`` does for NIXL.

* D (``kv_consumer``): one :class:`RecvReq` a request whose KV P pushes into D's
  blocks (or a virtual one, which receives nothing); ``failed_posts`` for the
  requests whose metaserver post failed for good.
* P (``kv_producer``): one :class:`PushReq` a request whose blocks this step pushes
  (or whose D must be told that the request failed).

``ReqMeta`` is upstream's name of :class:`RecvReq` (upstream promises
``ReqMeta.do_virtual``); it stays an alias.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ..errors import KVParamsError
from ..params import PushEndpoint, PushTarget, wants_virtual

__all__ = ["MooncakeLayerwiseConnectorMetadata", "PushReq", "RecvReq", "ReqMeta"]

logger = logging.getLogger(__name__)


@dataclass
class RecvReq:
    """D: a request whose KV P will push into ``local_block_ids``.

    ``local_block_ids`` are D's blocks of the whole prompt in token order; the first
    ``cached_tokens // block_size`` of them already hold D's own prefix-cache hit.
    """

    request_id: str
    local_block_ids: list[int]
    cached_tokens: int = 0
    #: virtual push: nothing is transferred, the request is reported received at once
    do_virtual: bool = False
    #: malformed params: the worker fails the request at once
    error: str | None = None
    #: the capability D's scheduler issued with its metaserver post (``remote_push_token``):
    #: D's side channel serves only a ``PushBegin``/``PushDone`` that presents it
    push_token: str = ""
    #: several KV cache groups (vLLM's hybrid KV cache manager): ``local_block_ids`` are the
    #: blocks D keeps, each group's run ``(first position, count)`` after the other (as
    #: posted in ``remote_block_groups``); empty: one group, the whole prompt's blocks
    block_groups: tuple[tuple[int, int], ...] = ()


#: Upstream's name (``ReqMeta.do_virtual`` is part of its promise).
ReqMeta = RecvReq


@dataclass
class PushReq:
    """P: push the blocks at ``positions`` (block indices in token order) of one request.

    ``local_block_ids[i]`` is P's block at ``positions[i]`` of KV cache group
    ``groups[i]`` (``groups`` empty: group 0 throughout); D's block there is
    ``target.d_block(groups[i], positions[i])``. ``last``: this step completes the prompt,
    so the workers tell D the request is complete after the step's last layer.
    """

    request_id: str
    target: PushTarget | None
    positions: list[int] = field(default_factory=list)
    local_block_ids: list[int] = field(default_factory=list)
    last: bool = False
    #: the request ended on P before any push (or its params are bad): tell D it failed
    abort: str | None = None
    #: where D waits (its address, request id, TP size, engine id) when ``target`` could
    #: not be parsed
    endpoint: PushEndpoint | None = None
    #: D's capability for the request when only ``endpoint`` could be parsed
    token: str = ""
    #: D ranks on other hosts, when only ``endpoint`` could be parsed
    rank_hosts: dict[int, str] = field(default_factory=dict)
    #: the KV cache group of each of ``positions`` (empty: one group)
    groups: list[int] = field(default_factory=list)


@dataclass
class MooncakeLayerwiseConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker payload of one step."""

    requests: dict[str, RecvReq] = field(default_factory=dict)
    pushes: dict[str, PushReq] = field(default_factory=dict)
    #: D requests whose metaserver post failed for good: request id -> reason
    failed_posts: dict[str, str] = field(default_factory=dict)
    #: the step runs no token: D's worker may wait a little for a request to end
    #: (``idle_wait_s``)
    idle: bool = False

    def add_new_req(self, request_id: str, local_block_ids: list[int],
                    kv_transfer_params: dict[str, Any] | None, *,
                    cached_tokens: int = 0) -> RecvReq:
        """Upstream's helper: ``do_virtual`` is copied from the params (``None``-safe)."""
        try:
            virtual, error = wants_virtual(kv_transfer_params), None
        except KVParamsError as exc:
            virtual, error = False, str(exc)
        meta = RecvReq(request_id, list(local_block_ids), cached_tokens, virtual, error)
        self.requests[request_id] = meta
        return meta

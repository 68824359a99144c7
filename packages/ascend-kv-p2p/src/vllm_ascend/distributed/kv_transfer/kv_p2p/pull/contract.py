# SPDX-License-Identifier: Apache-2.0
"""What the pull connector's scheduler tells its workers each step.

The records of :class:`MooncakeConnectorMetadata` are the whole contract between
:mod:`.pull.scheduler` (which builds them) and the workers (:mod:`.pull.worker`,
:mod:`.pull.holder`, :mod:`.pull.reader`), which import this module and never the
scheduler's, as vLLM's ``kv_connector/v1/nixl/metadata.py`` does for NIXL.

* D (``kv_consumer``): one :class:`RecvMeta` a request whose KV D pulls from P, or
  whose P blocks D only releases (``release_only``).
* P (``kv_producer``): one :class:`SendMeta` a finished request whose blocks P holds
  (delayed free) until D's ``Done`` or a lapsed lease.
* D: the answers of the claims D's scheduler sent ahead (:mod:`.pull.claims`), one
  :class:`EarlyClaim` a P rank: in the request's :class:`RecvMeta` when the answer came
  before the request's blocks were allocated, else in a later step's
  ``claim_answers``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ..params import RemotePrefill

__all__ = ["EarlyClaim", "MooncakeConnectorMetadata", "RecvMeta", "SendMeta"]

logger = logging.getLogger(__name__)


@dataclass
class EarlyClaim:
    """P rank's answer to the ``Claim`` D's scheduler sent when it first saw the request.

    ``sent_wall`` is the scheduler's ``time.time()`` when the accepted ``Claim`` went out
    (the scheduler and the workers are separate processes, possibly on separate hosts: a
    monotonic clock does not cross); the worker turns it into its own clock and trusts the
    claim only for a read ending within ``lease_ttl_s / 2`` of it, as its own claims.
    """

    #: P accepted the claim (else ``error`` says why and the worker claims itself)
    ok: bool
    #: accepted at the first ``Claim`` sent (no "unknown request" before)
    first_try: bool = False
    sent_wall: float = 0.0
    #: a keyed P's grant: where its KV cache is (``None``: an unkeyed P's ``ClaimOK``)
    region_addrs: list[int] | None = None
    region_strides: list[int] | None = None
    error: str = ""
    #: the grant's P engine start (``ClaimGrant.instance``)
    instance: str = ""


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
    #: D's scheduler claimed the request ahead (:mod:`.pull.claims`); the worker does not
    #: claim it unless that claim failed or its answer is late
    claimed_ahead: bool = False
    #: the answers of the claims sent ahead, by P rank, when they came before allocation
    #: (else they follow in ``MooncakeConnectorMetadata.claim_answers``)
    early_claims: dict[int, EarlyClaim] | None = None


@dataclass
class SendMeta:
    """P: hold ``block_ids`` of ``request_id`` for the D instance that will pull them (the
    blocks P "sends" are read by D: named after upstream's ``requests_to_send``)."""

    request_id: str
    block_ids: list[int]
    #: the request's capability: P serves only a ``Claim`` presenting it (see
    #: :class:`~.pull.holder.LeaseHolder`); ``""`` from callers that issue none
    token: str = ""


def runs_no_token(scheduler_output: Any) -> bool:
    """The step of ``scheduler_output`` runs no token (the metadata's ``idle``); a
    scheduler output that does not say is taken as a busy step."""
    return getattr(scheduler_output, "total_num_scheduled_tokens", None) == 0


@dataclass
class MooncakeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker payload of one step (field names as upstream's)."""

    #: D: requests to pull (or to release on P), by request id
    requests: dict[str, RecvMeta] = field(default_factory=dict)
    #: P: requests whose blocks to hold for D, by request id
    requests_to_send: dict[str, SendMeta] = field(default_factory=dict)
    #: D: answers of claims sent ahead for requests passed in earlier steps, by request id
    #: then P rank
    claim_answers: dict[str, dict[int, EarlyClaim]] = field(default_factory=dict)
    #: the step runs no token (every request waits for its KV, or none is left): the
    #: worker may wait a little for a load to end (``idle_wait_s``)
    idle: bool = False

# SPDX-License-Identifier: Apache-2.0
"""What the pull connector's scheduler tells its workers each step.

The records of :class:`MooncakeConnectorMetadata` are the whole contract between
:mod:`.scheduler` (which builds them) and the workers (:mod:`.worker`,
:mod:`.holder`, :mod:`.reader`), which import this module and never the
scheduler's, as vLLM's ``kv_connector/v1/nixl/metadata.py`` does for NIXL.

* D (``kv_consumer``): one :class:`RecvMeta` a request whose KV D pulls from P, or
  whose P blocks D only releases (``release_only``).
* P (``kv_producer``): one :class:`SendMeta` a finished request whose blocks P holds
  (delayed free) until D's ``Done`` or a lapsed lease.
* D: the answers of the claims D's scheduler sent ahead (its ``ClaimAhead``), one
  :class:`EarlyClaim` a P rank: in the request's :class:`RecvMeta` when the answer came
  before the request's blocks were allocated, else in a later step's
  ``claim_answers``. A worker in the scheduler's own process (vLLM's one-process
  executor) also gets each answer the moment it comes: the scheduler hands it to the
  :class:`ClaimInbox` registered for its engine (:func:`local_inbox`).

Claims sent ahead, in short: D's scheduler sends the ``Claim`` its workers would send, on
its own thread, when it first sees a request; the worker's pull uses an accepted answer as
its own claim (trusted for a read ending within ``lease_ttl_s / 2`` of ``sent_wall``) and
claims itself where an answer is a refusal, a timeout, a clock that does not add up, or
not in when the read ended. Nothing waits on an answer without a bound.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ..params import RemotePrefill

__all__ = ["ClaimInbox", "EarlyClaim", "MooncakeConnectorMetadata", "RecvMeta", "SendMeta"]

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
    """D: pull ``remote_block_ids`` into ``local_block_ids`` (pair by pair).

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
    #: with ``error``: the params are P's as P sent them but this D cannot load them (P's
    #: KV cache groups are not D's): tell P to free the blocks now, not at its lease's end
    release_on_error: bool = False
    #: D's scheduler claimed the request ahead (see the module); the worker does not
    #: claim it unless that claim failed or its answer is late
    claimed_ahead: bool = False
    #: the answers of the claims sent ahead, by P rank, when they came before allocation
    #: (else they follow in ``MooncakeConnectorMetadata.claim_answers``)
    early_claims: dict[int, EarlyClaim] | None = None
    #: D's scheduler's verdict on P's read window (:mod:`.window`), so the worker does not
    #: check P's tag again: the ``time.time()`` by which a read must end to need no claim
    #: (:func:`~.window.window_end`; ``-inf``: no window, or params P did not tag); ``None``:
    #: not judged (the worker checks the tag itself). It depends on the params alone, so it
    #: can only go stale by time: the worker compares it with its clock before the read
    #: and at its end, and claims a read that ended after it
    window_until: float | None = None


@dataclass
class SendMeta:
    """P: hold ``block_ids`` of ``request_id`` for the D instance that will pull them (the
    blocks P "sends" are read by D: named after upstream's ``requests_to_send``)."""

    request_id: str
    block_ids: list[int]
    #: the request's capability: P serves only a ``Claim`` presenting it (see
    #: :class:`~.pull.holder.LeaseHolder`); ``""`` from callers that issue none
    token: str = ""
    #: the blocks of several KV cache groups, one group's run after another (vLLM's hybrid
    #: KV cache manager, :mod:`.pull.groups`): D claims any of them in order, not a suffix
    in_order: bool = False


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


#: How many answers a worker keeps for pulls that have not started (its scheduler's, in
#: the same process, which may answer before the request reaches the worker).
EARLY_MEMORY = 1024

#: a request's answers, by P rank
Answers = dict[int, EarlyClaim]


class ClaimInbox:
    """D's worker: the answers of the claims sent ahead, for the pulls waiting on them.

    Args:
        engine_id: with one, the inbox also takes the answers of the scheduler of that
            engine in this process the moment they come (:func:`local_inbox`).
    """

    def __init__(self, engine_id: str = "") -> None:
        self._cv = threading.Condition()
        #: request id -> answers (``None``: not in yet)
        self._answers: dict[str, Answers | None] = {}
        #: answers delivered in this process before their pull started
        self._early: collections.OrderedDict[str, Answers] = collections.OrderedDict()
        self.engine_id = engine_id
        if engine_id:
            _LOCAL_INBOXES[engine_id] = self

    def expect(self, request_id: str, answers: Answers | None) -> None:
        """A pull of a request claimed ahead starts (with its answers if they are in)."""
        with self._cv:
            early = self._early.pop(request_id, None)
            self._answers[request_id] = answers if answers is not None else early

    def deliver(self, answers: Mapping[str, Answers], *, keep: bool = False) -> None:
        """Answers from the scheduler's metadata (those of pulls gone are dropped), or
        (``keep``) from a scheduler in this process (kept a while for pulls to come)."""
        with self._cv:
            for rid, a in answers.items():
                if rid in self._answers:
                    if self._answers[rid] is None:
                        self._answers[rid] = a
                elif keep:
                    self._early[rid] = a
                    while len(self._early) > EARLY_MEMORY:
                        self._early.popitem(last=False)
            self._cv.notify_all()

    @property
    def local(self) -> bool:
        """Whether this engine's scheduler claims ahead in this process (its answers come
        the moment P gives them)."""
        return bool(self.engine_id) and self.engine_id in _LOCAL_CLAIMERS

    def close(self) -> None:
        """Stop taking answers from this process's scheduler."""
        if self.engine_id and _LOCAL_INBOXES.get(self.engine_id) is self:
            del _LOCAL_INBOXES[self.engine_id]

    def get(self, request_id: str, timeout: float = 0.0) -> Answers | None:
        """The request's answers, waiting up to ``timeout``; ``None`` if not in."""
        with self._cv:
            if timeout > 0:
                self._cv.wait_for(lambda: self._answers.get(request_id) is not None, timeout)
            return self._answers.get(request_id)

    def drop(self, request_id: str) -> None:
        """The pull ended."""
        with self._cv:
            self._answers.pop(request_id, None)

    def __len__(self) -> int:
        with self._cv:
            return len(self._answers)


#: the workers' inboxes and the schedulers' claimers in this process, by engine id
_LOCAL_INBOXES: weakref.WeakValueDictionary[str, ClaimInbox] = weakref.WeakValueDictionary()
_LOCAL_CLAIMERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def local_inbox(engine_id: str) -> ClaimInbox | None:
    """The inbox of engine ``engine_id``'s worker in this process, if there is one."""
    return _LOCAL_INBOXES.get(engine_id)


def register_claimer(engine_id: str, claimer: object) -> None:
    """Engine ``engine_id``'s scheduler in this process claims ahead (its workers' inboxes
    then wait a moment for its answers: :attr:`ClaimInbox.local`); kept while it lives."""
    _LOCAL_CLAIMERS[engine_id] = claimer


def unregister_claimer(engine_id: str, claimer: object) -> None:
    """The scheduler stopped claiming ahead (another one registered since stays)."""
    if _LOCAL_CLAIMERS.get(engine_id) is claimer:
        del _LOCAL_CLAIMERS[engine_id]

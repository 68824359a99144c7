# SPDX-License-Identifier: Apache-2.0
"""What the pull connector's scheduler and its workers agree on.

One module holds everything both halves read, so a worker never imports the scheduler and a
newcomer finds the contract in one place, as vLLM's ``kv_connector/v1/nixl/metadata.py`` is
for NIXL:

* **The records of each step** (:class:`MooncakeConnectorMetadata`), which
  :mod:`.scheduler` builds and the workers (:mod:`.worker`, :mod:`.holder`,
  :mod:`.reader`) read.
* **P's read window** (:func:`stamp`, :func:`window_end`, :func:`read_until`): what P's
  scheduler promises in a request's params, D's scheduler judges once, and D's worker relies
  on (section "The read window" below).
* **P's pipeline stages** (:func:`stage_layers`, :func:`expand_over_stages`): which layers
  each stage of a pipeline-parallel P holds, for both halves (section "Pipeline stages").

The records:

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

**The read window**: D reads a fresh request's blocks without claiming them first. A claim
costs D a side-channel round trip before a load may end; for a small request that is as
long as the read itself. P therefore promises more than the lease:

* P's scheduler stamps the request's ``kv_transfer_params`` with the wall time it began
  holding the blocks (``remote_held_at``), the window (``remote_hold_s``, P's
  ``read_window_s``, at most half the lease), its engine start (``remote_instance``) and a
  tag over these, the request id, its block ids and its token (``remote_window_tag``,
  :func:`window_tag`), which stands for the claim's checks of them.
* P's worker keeps the blocks at least that long from when it registers the hold (after
  the stamp), even when D's ``Done`` comes sooner (:mod:`.holder` defers the
  release; a ``Claim`` after a ``Done`` is still refused).

So a read that ended before ``remote_held_at + remote_hold_s`` in P's clock read the
request's KV, whoever read it and however often: P could not have freed the blocks yet.
D checks that with its own clock at the end of the read, less :data:`CLOCK_SKEW_S` for the
difference between the clocks (:func:`window_end`). A read that ends later is claimed
after it, which proves as much (held at the answer, and continuously since before the
read: see :meth:`.reader.PullReader._pull`).

The tag is checked once a request, by D's scheduler when it parses the params; its
verdict, the window's end, goes to the worker with the request
(:attr:`RecvMeta.window_until`, read through :func:`read_until`), which does not
check the tag again. The verdict depends on the params alone, so it goes stale only by
time: the worker compares it with its clock before the read goes out and when it ended, as
above.

D uses the window only with region addresses of the same P engine start
(:func:`same_instance`): a P restarted at the same address is another instance, whose
memory D's cached metadata does not describe. D's scheduler does not claim ahead a
request still well within its window (:func:`in_window`); one that waited longer in D's
queue is claimed ahead as before.

**Pipeline stages**, the one home of that mapping. A pipeline-parallel P
(``prefill.pp_size`` > 1) splits the model's layers into contiguous stages; each stage's
workers hold (and register) only their layers' KV.
D (always one stage) reads each layer from the stage that holds it.

* The split is ``prefill.pp_layer_partition`` when given (the layers of each stage, in
  stage order; they must add up to the model's layer count), else vLLM's default
  (:func:`vllm.distributed.utils.get_pp_indices`): an even split, the remainder spread
  one layer each over the stages before the last, from the second-to-last backwards.
  Set the same partition as vLLM's ``VLLM_PP_LAYER_PARTITION`` on P.
* P rank ``(pp_rank, tp_rank)`` is known to D's reader as the *instance rank*
  ``pp_rank * tp_size + tp_rank`` (TP inner, PP outer, as in
  :class:`~vllm_ascend.distributed.kv_transfer.core.ranks.RankInfo`); its side channel
  listens on ``base + pp_rank * tp_size + tp_rank``
  (:func:`~..protocol.worker_port`, upstream's layout), so the port of instance rank ``k``
  is ``base + k``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import hmac
import logging
import math
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from vllm_ascend.distributed.kernels.heads import HeadSlice
from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError

from ..params import RemotePrefill
from ..protocol import AgentMeta
from ..signed_params import FROM_ENV, purpose_keys, resolve

__all__ = [
    # the records of each step
    "ClaimInbox", "EarlyClaim", "MooncakeConnectorMetadata", "RecvMeta", "SendMeta",
    # P's read window
    "CLOCK_SKEW_S", "in_window", "read_until", "same_instance", "stamp", "window_end",
    "window_tag",
    # P's pipeline stages
    "expand_over_stages", "stage_layers", "stage_of_rank",
]

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
    #: a keyed P's grant: the claimed blocks' addresses (``ClaimGrant.block_addrs``, of
    #: ``num_regions`` regions; ``None``: an unkeyed P's ``ClaimOK``)
    block_addrs: bytes | None = None
    num_regions: int = 0
    error: str = ""


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
    #: D's scheduler's verdict on P's read window (the read window, above), so the worker does not
    #: check P's tag again: the ``time.time()`` by which a read must end to need no claim
    #: (:func:`window_end`; ``-inf``: no window, or params P did not tag); ``None``:
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
    #: :class:`~.holder.LeaseHolder`); ``""`` from callers that issue none
    token: str = ""
    #: the blocks of several KV cache groups, one group's run after another (vLLM's hybrid
    #: KV cache manager, :mod:`.groups`): D claims any of them in order, not a suffix
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


# ---------------------------------------------------------------- the read window
#: How far (seconds) one host's wall clock may seem ahead of another's before D distrusts
#: a time it did not measure itself (P's stamp, its scheduler's claim sent ahead): the
#: same host never; NTP-synced hosts, milliseconds.
CLOCK_SKEW_S = 0.5

#: How much of the window must be left for D's scheduler to leave a request unclaimed
#: (the read and the hand-off to the worker must fit in it).
AHEAD_MARGIN_S = 0.1


#: what the window tag's key is derived for (from the deployment key, if any)
TAG_PURPOSE = "p2p-read-window"


@functools.lru_cache(maxsize=16)
def _keyed(key: bytes) -> hmac.HMAC:
    """An HMAC-SHA256 under ``key`` with nothing fed yet: each tag copies it (the key's pads
    are hashed once, not a request)."""
    return hmac.new(key, digestmod=hashlib.sha256)


def _tag(key: bytes, instance: str, request_id: str, block_ids: Sequence[int],
         held_at: float, hold_s: float, token: str) -> str:
    text = "|".join([instance, request_id, ",".join(map(str, block_ids)), repr(float(held_at)),
                     repr(float(hold_s)), token])
    mac = _keyed(key).copy()
    mac.update(text.encode())
    return mac.hexdigest()


def window_tag(*, instance: str, request_id: str, block_ids: Sequence[int], held_at: float,
               hold_s: float, token: str, authn: auth.Authenticator | None = FROM_ENV) -> str:
    """P's tag over what D reads unclaimed: a request id, its block ids, the window and the
    capability token. Without a claim P cannot check them, so D checks this instead: params
    changed on the way (another request's id or blocks, a stale token) do not match and are
    claimed (and refused) as before. Keyed with the deployment key when there is one (a
    proxy without it cannot forge a tag); without one a plain checksum, as good as the
    unkeyed claim's checks (which anyone who reaches the side channel gets past).
    ``authn``: the authenticator (default: the process's, :func:`.auth.from_env`)."""
    a = resolve(authn)
    key = purpose_keys(a, TAG_PURPOSE)[0] if a is not None else b""
    return _tag(key, instance, request_id, block_ids, held_at, hold_s, token)


def stamp(*, instance: str, request_id: str, block_ids: Sequence[int], token: str,
          hold_s: float, authn: auth.Authenticator | None = FROM_ENV) -> dict[str, Any]:
    """The ``kv_transfer_params`` keys of P's read window for a request P holds from now
    (none when the window is off or the engine start is not known); ``authn`` as in
    :func:`window_tag`."""
    if not instance or hold_s <= 0:
        return {}
    held_at = time.time()
    return {"remote_instance": instance, "remote_held_at": held_at, "remote_hold_s": hold_s,
            "remote_window_tag": window_tag(instance=instance, request_id=request_id,
                                            block_ids=block_ids, held_at=held_at,
                                            hold_s=hold_s, token=token, authn=authn)}


def tag_ok(remote: RemotePrefill, authn: auth.Authenticator | None = FROM_ENV) -> bool:
    """Whether ``remote``'s window tag is P's for exactly these params (``authn`` as in
    :func:`window_tag`)."""
    if not remote.window_tag:
        return False
    a = resolve(authn)
    keys = purpose_keys(a, TAG_PURPOSE) if a is not None else (b"",)
    return any(hmac.compare_digest(remote.window_tag, _tag(
        k, remote.instance, remote.request_id, remote.block_ids, remote.held_at, remote.hold_s,
        remote.token)) for k in keys)


def window_end(remote: RemotePrefill, authn: auth.Authenticator | None = FROM_ENV) -> float:
    """D's ``time.time()`` by which a read of ``remote``'s blocks must end to be trusted
    without a claim; ``-inf`` when P made no such promise, or the params are not the ones
    P tagged (``authn`` as in :func:`window_tag`)."""
    if (remote.hold_s <= 0 or remote.held_at <= 0 or not remote.instance
            or not tag_ok(remote, authn)):
        return -math.inf
    return remote.held_at + remote.hold_s - CLOCK_SKEW_S


def read_until(remote: RemotePrefill, verdict: float | None) -> float:
    """:func:`window_end` of ``remote``, or the ``verdict`` D's scheduler sent with the
    request (:attr:`RecvMeta.window_until`: it checked the tag when it parsed the
    params, so the worker does not check it again); ``None``: not judged, checked here."""
    return window_end(remote) if verdict is None else verdict


def in_window(remote: RemotePrefill, *, margin_s: float = AHEAD_MARGIN_S,
              now: float | None = None, until: float | None = None) -> bool:
    """Whether more than ``margin_s`` of the request's read window is left (``until``: its
    :func:`window_end` if known already, not computed again)."""
    end = window_end(remote) if until is None else until
    return (time.time() if now is None else now) + margin_s < end


def same_instance(remote: RemotePrefill, metas: Mapping[int, AgentMeta]) -> bool:
    """Whether every P rank's regions in ``metas`` are of the engine start that holds the
    request (both told; an unknown instance never matches)."""
    return bool(remote.instance) and all(m.instance == remote.instance
                                         for m in metas.values())


# ------------------------------------------------------------- pipeline stages
def stage_layers(num_layers: int, pp_size: int, partition: Sequence[int] | None = None, *,
                 source: str = "prefill") -> list[range]:
    """The layers of each pipeline stage, in stage order.

    Args:
        num_layers: the model's layer count (attention layers with a KV cache).
        pp_size: the number of pipeline stages.
        partition: layers per stage (``pp_layer_partition``); ``None``: vLLM's default.
        source: the config section named in errors.

    Raises:
        ConfigError: the partition does not have ``pp_size`` positive entries adding up to
            ``num_layers``, or there are fewer layers than stages.
    """
    key = f"{source}.pp_layer_partition"
    if pp_size < 1:
        raise ConfigError(f"{source}.pp_size must be at least 1, got {pp_size}",
                          key=f"{source}.pp_size", value=pp_size, source=source)
    if partition is None:
        if num_layers < pp_size:
            raise ConfigError(
                f"{source}: {num_layers} layers cannot be split over pp_size={pp_size} "
                "pipeline stages", key=f"{source}.pp_size", value=pp_size, source=source)
        sizes = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):  # vLLM's get_pp_indices
            sizes[-i] += 1
    else:
        sizes = [int(n) for n in partition]
        if len(sizes) != pp_size or any(n <= 0 for n in sizes):
            raise ConfigError(
                f"{source}: pp_layer_partition {sizes} must have pp_size={pp_size} positive "
                "entries", key=key, value=sizes, source=source)
        if sum(sizes) != num_layers:
            raise ConfigError(
                f"{source}: pp_layer_partition {sizes} adds up to {sum(sizes)} layers but the "
                f"model has {num_layers}", key=key, value=sizes, source=source)
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def stage_of_rank(rank: int, tp_size: int) -> int:
    """The pipeline stage of instance rank ``rank`` (``pp_rank * tp_size + tp_rank``)."""
    return rank // tp_size


def expand_over_stages(plan: Sequence[HeadSlice], readers: Mapping[int, int], *, tp_size: int,
                       pp_size: int) -> tuple[tuple[HeadSlice, ...], dict[int, int]]:
    """A D rank's head plan and P's readers over every stage of a pipeline-parallel P.

    ``plan`` and ``readers`` name P's TP ranks (one stage); the result names P's instance
    ranks: each slice of TP rank ``r`` once per stage ``s``, as rank ``s * tp_size + r``
    (the same heads, of that stage's layers), with the same number of readers. With
    ``pp_size`` 1 they are returned as they are.
    """
    if pp_size == 1:
        return tuple(plan), dict(readers)
    out = tuple(dataclasses.replace(sl, remote_rank=s * tp_size + sl.remote_rank)
                for s in range(pp_size) for sl in plan)
    return out, {s * tp_size + r: n for s in range(pp_size) for r, n in readers.items()}

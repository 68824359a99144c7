# SPDX-License-Identifier: Apache-2.0
"""Claims sent ahead: D's scheduler claims a request on P when it first sees it.

Without them, D's worker claims the request's blocks on every P rank it reads after the
blocks were allocated, then reads: the claim's round trip sits between the scheduler's
decision and the first byte read. With them:

* :class:`ClaimAhead` (D's scheduler) sends the ``Claim`` on its own thread from
  ``get_num_new_matched_tokens``, once a request (never twice, however often vLLM asks
  again), to every P rank some D rank reads, with the request's token and each rank's
  number of D readers: the claim the workers would send.
* The answers go to the workers with the scheduler's metadata: in the request's
  :class:`~.pull.contract.RecvMeta` when they came before allocation, else in a later
  step's ``claim_answers`` (an idle engine steps back to back; a busy one within a step).
  A worker in the scheduler's own process (vLLM's one-process executor) gets each answer
  the moment it comes, too (:func:`local_inbox`).
* :class:`ClaimInbox` (D's worker) hands them to the pull (:mod:`.pull.reader`), which
  reads at once where P's regions are known and uses an answer only as its own claim's
  (accepted at the first try, sent at ``sent_wall``, trusted for a read ending within
  ``lease_ttl_s / 2`` of it). An answer that is a refusal, a timeout, a clock that does
  not add up, or one that is not in when the read ended makes the worker claim itself, as
  before (its claims then come after its read, which proves as much: see
  :meth:`~.pull.reader.PullReader._pull`). Nothing waits on an answer without a bound.

Safety is the worker's claim's: P answers the same ``Claim`` (token, block ids, readers)
the same way and renews the same lease. A request aborted before allocation is released
by the worker's ``Done(success=False)`` as before; a claim still queued then is dropped,
and one that reaches P after the release is refused (P remembers released ids).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import KVTransferError, RemoteError

from ..params import RemotePrefill
from ..protocol import CODEC, Claim, ClaimGrant, ClaimOK, worker_port
from .contract import EarlyClaim

logger = logging.getLogger(__name__)

#: How far (seconds) the scheduler's wall clock may seem ahead of a worker's before the
#: worker distrusts an answer (same host: never; NTP-synced hosts: milliseconds).
CLOCK_SKEW_S = 0.5

#: How many answers a worker keeps for pulls that have not started (its scheduler's, in
#: the same process, which may answer before the request reaches the worker).
EARLY_MEMORY = 1024

Answers = dict[int, EarlyClaim]


@dataclass(frozen=True)
class Claimed:
    """P rank's answer to a claim D sent."""

    #: P accepted the first ``Claim`` sent (no "unknown request" retry)
    first_try: bool
    #: ``time.monotonic()`` when the accepted ``Claim`` was sent; P renewed the lease to a
    #: full ``lease_ttl_s`` when it answered, which is later
    sent_at: float
    #: where P's blocks are, from a keyed P's grant (``None``: an unkeyed P's ``ClaimOK``;
    #: its ``AgentMeta`` has them)
    grant: ClaimGrant | None = None


class ClaimAhead:
    """D's scheduler: one ``Claim`` a request to every P rank read, sent when first seen.

    Args:
        reader_counts: ``(P's TP size) -> {P rank: D ranks that read it}`` (raises when the
            heads do not split; the request is then claimed by its workers as before).
        timeout_s: the side-channel timeout of one claim.
        reader: the name the claims carry (P does not act on it).
    """

    def __init__(self, reader_counts: Any, timeout_s: float, reader: str,
                 engine_id: str = "") -> None:
        self._reader_counts = reader_counts
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self.reader = reader
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2p-claim-ahead")
        self._lock = threading.Lock()
        self._clients: dict[str, RpcClient[Any]] = {}
        #: request id -> (block ids claimed, the answers by P rank)
        self._sent: dict[str, tuple[list[int], Future[Answers]]] = {}
        #: requests handed to the workers before their answers came
        self._owed: dict[str, Future[Answers]] = {}
        if engine_id:
            _LOCAL_CLAIMERS[engine_id] = self

    def start(self, request_id: str, remote: RemotePrefill, block_ids: list[int]) -> bool:
        """Claim ``block_ids`` of ``remote`` on its P ranks (once a request); False when
        not sent (the heads do not split: the workers will say why)."""
        with self._lock:
            if request_id in self._sent:
                return True
        try:
            counts = dict(self._reader_counts(remote.tp_size))
        except Exception as exc:  # the worker's head plan reports it
            logger.debug("request %s: no claim ahead (%s)", request_id, exc)
            return False
        fut = self._pool.submit(self._claim_all, remote, list(block_ids), counts)
        with self._lock:
            self._sent[request_id] = (list(block_ids), fut)
        fut.add_done_callback(lambda f: self._deliver_locally(request_id, f))
        return True

    def _deliver_locally(self, request_id: str, fut: Future[Answers]) -> None:
        inbox = _LOCAL_INBOXES.get(self.engine_id)
        if inbox is not None and not fut.cancelled():
            inbox.deliver({request_id: _result(fut)}, keep=True)

    def hand_over(self, request_id: str, block_ids: list[int]) -> tuple[bool, Answers | None]:
        """The request's blocks were allocated: whether its workers may rely on the claim
        sent ahead (it claimed exactly ``block_ids``), and its answers if they are in (else
        they follow in :meth:`take_answers`)."""
        with self._lock:
            sent = self._sent.pop(request_id, None)
            if sent is None:
                return False, None
            claimed, fut = sent
            if claimed != list(block_ids):
                return False, None  # vLLM's prefix hit changed since: the workers claim
            if fut.done():
                return True, _result(fut)
            self._owed[request_id] = fut
            return True, None

    def take_answers(self) -> dict[str, Answers]:
        """Answers that came since, of requests handed to the workers without them."""
        with self._lock:
            done = [rid for rid, fut in self._owed.items() if fut.done()]
            return {rid: _result(self._owed.pop(rid)) for rid in done}

    def forget(self, request_id: str) -> None:
        """The request finished (or was aborted): drop its claim (unsent: never sent)."""
        with self._lock:
            sent = self._sent.pop(request_id, None)
            self._owed.pop(request_id, None)
        if sent is not None:
            sent[1].cancel()

    def stop(self) -> None:
        """Drop the claims not sent yet; the claim thread closes its sockets after the one
        in flight (a socket is never closed under a call on another thread)."""
        if _LOCAL_CLAIMERS.get(self.engine_id) is self:
            del _LOCAL_CLAIMERS[self.engine_id]
        with self._lock:
            pending = [fut for _b, fut in self._sent.values()] + list(self._owed.values())
            self._sent.clear()
            self._owed.clear()
        for fut in pending:
            fut.cancel()
        try:
            self._pool.submit(self._close_clients)
        except RuntimeError:  # stopped already
            return
        self._pool.shutdown(wait=False)

    def _close_clients(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def _client(self, endpoint: str) -> RpcClient[Any]:
        with self._lock:
            client = self._clients.get(endpoint)
            if client is None:
                client = self._clients[endpoint] = RpcClient(endpoint, CODEC,
                                                             timeout_s=self.timeout_s)
            return client

    def _claim_all(self, remote: RemotePrefill, block_ids: list[int],
                   counts: Mapping[int, int]) -> Answers:
        """Claim thread: every P rank read, one after the other; never raises."""
        out: Answers = {}
        for rank in sorted(counts):
            port = worker_port(remote.port, tp_rank=rank, tp_size=remote.tp_size)
            msg = Claim(request_id=remote.request_id, block_ids=block_ids, reader=self.reader,
                        num_readers=counts[rank], token=remote.token)
            sent = time.time()
            try:
                reply = self._client(tcp_endpoint(remote.host_of(rank), port)).call(msg)
            except RemoteError as exc:
                out[rank] = EarlyClaim(ok=False, error=exc.code or "refused")
                continue
            except KVTransferError as exc:
                out[rank] = EarlyClaim(ok=False, error=f"{type(exc).__name__}: {exc}")
                continue
            if isinstance(reply, ClaimGrant):
                out[rank] = EarlyClaim(ok=True, first_try=True, sent_wall=sent,
                                       region_addrs=list(reply.region_addrs),
                                       region_strides=list(reply.region_strides),
                                       instance=reply.instance)
            elif isinstance(reply, ClaimOK):
                out[rank] = EarlyClaim(ok=True, first_try=True, sent_wall=sent)
            else:
                out[rank] = EarlyClaim(ok=False, error=f"reply {type(reply).__name__}")
        return out


#: the workers' inboxes and the schedulers' claimers in this process, by engine id
_LOCAL_INBOXES: weakref.WeakValueDictionary[str, ClaimInbox] = weakref.WeakValueDictionary()
_LOCAL_CLAIMERS: weakref.WeakValueDictionary[str, ClaimAhead] = weakref.WeakValueDictionary()


def _result(fut: Future[Answers]) -> Answers:
    try:
        return fut.result(timeout=0)
    except Exception as exc:  # cancelled: the workers claim themselves
        return {-1: EarlyClaim(ok=False, error=f"{type(exc).__name__}")}


class ClaimInbox:
    """D's worker: the answers of the claims sent ahead, for the pulls waiting on them.

    Args:
        engine_id: with one, the inbox also takes the answers of a :class:`ClaimAhead` of
            that engine in this process the moment they come (:func:`local_inbox`).
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


def claim_sent_at(answer: EarlyClaim, *, now_mono: float | None = None,
                  now_wall: float | None = None) -> float:
    """When (this process's ``time.monotonic()``, at the earliest) an accepted answer's
    claim was sent: :data:`CLOCK_SKEW_S` earlier than the clocks say, so a skew or a small
    step of either clock shortens the time a read is trusted instead of stretching it;
    ``-inf`` (never trusted) when the scheduler's clock seems further ahead of ours."""
    now_mono = time.monotonic() if now_mono is None else now_mono
    now_wall = time.time() if now_wall is None else now_wall
    age = now_wall - answer.sent_wall
    if age < -CLOCK_SKEW_S:
        return -math.inf
    return now_mono - max(0.0, age) - CLOCK_SKEW_S


def refused_ahead(answers: Mapping[int, EarlyClaim] | None) -> bool:
    """Whether a claim sent ahead was not accepted (the pull then claims as before)."""
    return answers is not None and not all(a.ok for a in answers.values())


def accepted_ahead(answers: Mapping[int, EarlyClaim] | None,
                   p_ranks: Iterable[int]) -> dict[int, Future[Claimed]] | None:
    """The accepted answers among ``p_ranks``, as the pull's own claims would be (``None``
    while none is in)."""
    if answers is None:
        return None
    out: dict[int, Future[Claimed]] = {}
    for r in p_ranks:
        a = answers.get(r)
        if a is None or not a.ok:
            continue
        grant = (None if a.region_addrs is None else ClaimGrant(
            lease_s=0.0, region_addrs=list(a.region_addrs),
            region_strides=list(a.region_strides or []), instance=a.instance))
        fut: Future[Claimed] = Future()
        fut.set_result(Claimed(first_try=a.first_try, sent_at=claim_sent_at(a), grant=grant))
        out[r] = fut
    return out

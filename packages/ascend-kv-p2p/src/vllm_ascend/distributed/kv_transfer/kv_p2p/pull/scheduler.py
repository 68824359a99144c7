# SPDX-License-Identifier: Apache-2.0
"""Scheduler side of ``MooncakeConnectorV1`` (decode pulls).

On P (``kv_producer``): a request sent with ``do_remote_decode`` keeps its
blocks when it finishes (delayed free) and returns the ``kv_transfer_params``
D needs; the worker learns which blocks it holds through the metadata.

On D (``kv_consumer``): a request with ``do_remote_prefill`` reports its
prompt as an asynchronous external hit; after vLLM allocates blocks, the
worker is told to pull the matching P blocks. What the workers are told is
:mod:`.pull.contract`. Malformed params still go
through the asynchronous path so the worker can fail (or recompute) that one
request through vLLM's ``kv_load_failure_policy``; the engine serves on.
While a request waits in D's queue, a background thread renews P's lease on
its blocks so a busy D is not mistaken for a dead one. D claims the request on P
when it first sees it (:class:`ClaimAhead`), so the claim's round trip is off the
load's critical path.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.auth import capability_token
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import (
    ConfigError,
    KVTransferError,
    RemoteError,
)
from vllm_ascend.distributed.kv_transfer.core.kv_groups import NULL_BLOCK, KVGroups
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig

from ..errors import KVParamsError
from ..params import (
    RemotePrefill,
    engine_instance,
    params_for_decode,
    parse_remote_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)
from ..protocol import CODEC, Claim, ClaimGrant, ClaimOK, worker_port
from ..renewer import LeaseRenewer
from ..scheduler_base import SchedulerBase, runs_no_token
from ..signed_params import sign as sign_params
from ..signed_params import verify as verify_params
from .contract import (
    Answers,
    EarlyClaim,
    MooncakeConnectorMetadata,
    RecvMeta,
    SendMeta,
    expand_over_stages,
    in_window,
    local_inbox,
    register_claimer,
    stamp,
    unregister_claimer,
    window_end,
)
from .groups import pair_blocks, predicted_claim

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: marks a request whose last prompt token P left to D (:meth:`PullScheduler.on_new_request`)
_LEFT_LAST = "_ascend_prefill_leaves_last"


class PullScheduler(SchedulerBase):
    """Scheduler-side logic of the pull connector."""

    def __init__(self, vllm_config: VllmConfig, cfg: MooncakeP2PConfig, engine_id: str, *,
                 kv_groups: KVGroups | None = None) -> None:
        super().__init__(vllm_config, engine_id)
        self.cfg = cfg
        #: the KV cache groups (several under vLLM's hybrid KV cache manager: .groups)
        self.groups = kv_groups or KVGroups.from_config(None)
        #: D leaves the prompt's last token to compute (and P prefills all but it): with a
        #: sliding window vLLM frees the blocks of the window of the token after the prompt,
        #: and a state is the state after every token computed; recomputing the last one
        #: (vLLM's way after a whole-prompt load) would need what was before it
        self._leave_last = self.groups.leaves_last_token
        self._rank_hosts: dict[int, str] = {}
        self._to_pull: dict[str, RecvMeta] = {}
        self._to_hold: dict[str, SendMeta] = {}
        self._parsed: dict[str, RemotePrefill | KVParamsError] = {}
        # request id -> P's read window's end (its tag checked once a request; sent to the
        # workers in RecvMeta.window_until, which do not check it again)
        self._until: dict[str, float] = {}
        self.renewer = (LeaseRenewer(cfg.lease_ttl_s / 3, cfg.handshake_timeout_s)
                        if self.is_consumer else None)
        #: claims sent when a request is first seen (``None``: the workers claim)
        self.claims = _claim_ahead(vllm_config, cfg, engine_id) if self.is_consumer else None
        #: this engine start, in the params of the requests P holds (their read window)
        self.instance = engine_instance(vllm_config, engine_id)
        #: the process's deployment key (``None``: none), read once as the side channels
        #: read it when they start: it MACs and checks every request's params and tag
        self.authn = auth.from_env()
        from vllm.v1.request import RequestStatus

        #: the one status of a request P holds for D (vLLM's, looked up once)
        self._length_capped = RequestStatus.FINISHED_LENGTH_CAPPED

    @property
    def rank_hosts(self) -> dict[int, str]:
        """Where each TP rank listens, as the workers published them (multi-node P)."""
        return self._rank_hosts

    @rank_hosts.setter
    def rank_hosts(self, hosts: dict[int, str]) -> None:
        self._refuse_stages_on_several_hosts(set(hosts.values()))
        self._rank_hosts = dict(hosts)

    def set_rank_hosts(self, hosts: dict[int, str]) -> None:
        """Where each TP rank listens (from the workers' handshake metadata)."""
        self.rank_hosts = hosts

    def set_stage_hosts(self, by_stage: dict[int, dict[int, str]]) -> None:
        """Where each pipeline stage's TP ranks listen (``{pp rank: {tp rank: host}}``):
        the TP ranks' hosts, once every stage is on one host (refused otherwise, as
        :attr:`rank_hosts` is)."""
        self._refuse_stages_on_several_hosts(
            {h for stage in by_stage.values() for h in stage.values()})
        self._rank_hosts = dict(by_stage.get(0, {}))

    def _refuse_stages_on_several_hosts(self, hosts: set[str]) -> None:
        if self.pp_size > 1 and len(hosts) > 1:
            # the published addresses name TP ranks, not pipeline stages: D would dial a
            # stage's rank at another stage's host
            raise ConfigError(
                f"a pipeline-parallel P (pipeline_parallel_size={self.pp_size}) whose ranks "
                f"listen on several hosts ({sorted(hosts)}) is not supported "
                "yet: D dials every pipeline stage at P's host; run P's stages on one host",
                key="pipeline_parallel_size", value=self.pp_size, source="parallel_config")

    # ------------------------------------------------------------ helpers
    def _parse(self, request: Request) -> RemotePrefill | KVParamsError:
        try:
            # a key holder's params only, or an allowed host: before anything is dialed
            verify_params(request.kv_transfer_params, allowed_hosts=self.cfg.allowed_peer_hosts,
                          authn=self.authn)
            return parse_remote_prefill(request.kv_transfer_params,
                                        prompt_len=len(request.prompt_token_ids or ()),
                                        block_size=self.block_size)
        except KVParamsError as exc:
            return exc

    def _window_until(self, request_id: str, parsed: RemotePrefill) -> float:
        """The request's read window's end (:func:`~.contract.window_end`), P's tag checked
        the first time only, however often vLLM asks."""
        until = self._until.get(request_id)
        if until is None:
            until = self._until[request_id] = window_end(parsed, self.authn)
        return until

    # ------------------------------------------------------------ vLLM hooks
    def on_new_request(self, request: Request) -> None:
        """P, with a sliding window or a state among the KV cache groups: prefill all but
        the prompt's last token, which D computes (:attr:`_leave_last`). vLLM frees a
        window's blocks as the tokens computed move on, and may schedule the request's next
        step before it sees it finish: P then keeps the blocks of the window of the token
        after what it computed, the window D needs for the prompt's last token; and P's
        state is then the state before that token, where D starts."""
        params = request.kv_transfer_params
        if not (self._leave_last and self.is_producer and wants_remote_decode(params)):
            return
        assert isinstance(params, dict)
        tokens = request.prompt_token_ids
        if params.get(_LEFT_LAST) or tokens is None or request.num_prompt_tokens < 2:
            return
        tokens.pop()
        # vLLM's Request keeps the prompt's and the output's tokens in one more list
        request._all_token_ids.pop()  # as vLLM's own P/D connector does
        request.num_prompt_tokens -= 1
        params[_LEFT_LAST] = True

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not (self.is_consumer and wants_remote_prefill(params)):
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens - self._leave_last
        parsed = self._parsed.get(request.request_id)
        if parsed is None:
            # checked once a request (MAC, hosts, keys): vLLM asks every step it waits
            parsed = self._parsed[request.request_id] = self._parse(request)
            if isinstance(parsed, KVParamsError):
                logger.error("request %s: bad kv_transfer_params: %s", request.request_id,
                             parsed)
            elif self.renewer is not None:
                self.renewer.track(request.request_id, parsed)
        if count <= 0:
            return 0, False
        if (isinstance(parsed, RemotePrefill) and self.claims is not None
                and not in_window(parsed, until=self._window_until(request.request_id,
                                                                   parsed))):
            # the blocks the worker will read (vLLM's prefix hit is num_computed_tokens);
            # a request well within P's read window is read unclaimed (pull.contract), one
            # still waiting here once it is not is claimed then (vLLM asks every step)
            self.claims.start(request.request_id, parsed,
                              self._claim_of(parsed, num_computed_tokens, count))
        return count, True

    def _claim_of(self, parsed: RemotePrefill, num_computed_tokens: int, count: int
                  ) -> list[int]:
        """P's blocks D will read: past D's prefix hit (of every group D will keep)."""
        if not parsed.block_groups:
            return parsed.block_ids[num_computed_tokens // self.block_size:]
        return predicted_claim(self.groups, parsed.block_groups, parsed.block_ids,
                               computed_tokens=num_computed_tokens,
                               total_tokens=num_computed_tokens + count)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not (self.is_consumer and wants_remote_prefill(params)):
            return
        rid = request.request_id
        parsed = self._parsed.pop(rid, None) or self._parse(request)
        until = self._until.pop(rid, None)
        if self.renewer is not None:
            self.renewer.untrack(rid)
        assert isinstance(params, dict)
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            self._forget_claim(rid)
            if isinstance(parsed, RemotePrefill):
                self._to_pull[rid] = RecvMeta(rid, [], parsed, release_only=True)
            return
        if self.groups.hybrid or (isinstance(parsed, RemotePrefill) and parsed.block_groups):
            paired = self._pair_groups(request, blocks, num_external_tokens, parsed)
            if paired is None or isinstance(parsed, KVParamsError):
                return
            local, remote_ids = paired
        else:
            local = list(blocks.get_unhashed_block_ids())
            if isinstance(parsed, KVParamsError):
                self._to_pull[rid] = RecvMeta(rid, local, None, error=str(parsed))
                return
            prompt_len = len(request.prompt_token_ids or ())
            computed_blocks = (prompt_len - num_external_tokens) // self.block_size
            remote_ids = parsed.block_ids[computed_blocks:]
            # vLLM may allocate room beyond the prompt; only the prompt's blocks are pulled.
            local = local[: len(remote_ids)]
            if len(remote_ids) != len(local):
                self._forget_claim(rid)
                msg = (f"remote_block_ids cover {len(remote_ids)} blocks beyond the local "
                       f"prefix but {len(local)} blocks were allocated")
                self._to_pull[rid] = RecvMeta(rid, local, parsed, error=msg)
                return
        ahead, answers = (self.claims.hand_over(rid, remote_ids) if self.claims is not None
                          else (False, None))
        # the window's verdict goes with the request: the worker does not check P's tag again
        self._to_pull[rid] = RecvMeta(
            rid, local, parsed, remote_block_ids=remote_ids, claimed_ahead=ahead,
            early_claims=answers,
            window_until=window_end(parsed, self.authn) if until is None else until)

    def _pair_groups(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int,
                     parsed: RemotePrefill | KVParamsError
                     ) -> tuple[list[int], list[int]] | None:
        """D's blocks and P's, pair by pair, over every KV cache group (:mod:`.groups`);
        ``None`` (the load failed, recorded) when P's groups are not D's."""
        rid = request.request_id
        local_groups = [[b.block_id for b in group] for group in blocks.blocks]
        mine = [b for group in local_groups for b in group if b != NULL_BLOCK]
        if isinstance(parsed, KVParamsError):
            self._to_pull[rid] = RecvMeta(rid, mine, None, error=str(parsed))
            return None
        prompt_len = len(request.prompt_token_ids or ())
        computed = prompt_len - num_external_tokens - self._leave_last
        try:
            if len(parsed.block_groups) != len(self.groups.groups):
                raise ValueError(
                    f"P sent the blocks of {max(1, len(parsed.block_groups))} KV cache "
                    f"group(s) and D has {len(self.groups.groups)} ({self.groups.describe()}): "
                    "run P and D with the same model and the hybrid KV cache manager both on "
                    "or both off")
            return pair_blocks(self.groups, parsed.block_groups, parsed.block_ids,
                               local_groups, computed_tokens=computed,
                               total_tokens=computed + num_external_tokens)
        except ValueError as exc:
            self._forget_claim(rid)
            self._to_pull[rid] = RecvMeta(rid, mine, parsed, error=str(exc),
                                          release_on_error=True)
            return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MooncakeConnectorMetadata:
        meta = MooncakeConnectorMetadata(
            requests=self._to_pull, requests_to_send=self._to_hold,
            claim_answers=self.claims.take_answers() if self.claims is not None else {},
            idle=runs_no_token(scheduler_output))
        self._to_pull, self._to_hold = {}, {}
        return meta

    def _forget_claim(self, request_id: str) -> None:
        if self.claims is not None:
            self.claims.forget(request_id)

    def request_finished_groups(self, request: Request, block_ids: Sequence[list[int]]
                                ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with the hybrid KV cache manager on: one list of blocks per
        KV cache group (one group: as :meth:`request_finished`)."""
        if len(block_ids) == 1 and not self.groups.hybrid:
            return self.request_finished(request, block_ids[0])
        return self.request_finished(request, [], groups=block_ids)

    def request_finished(self, request: Request, block_ids: list[int], *,
                         groups: Sequence[list[int]] | None = None
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        parsed = self._parsed.pop(rid, None)
        self._until.pop(rid, None)
        if self.renewer is not None:
            self.renewer.untrack(rid)
        self._forget_claim(rid)
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return False, None
        if self.is_consumer and params.get("do_remote_prefill"):
            # Finished (aborted) before blocks were allocated: let P free its blocks now.
            parsed = parsed or self._parse(request)
            if isinstance(parsed, RemotePrefill):
                self._to_pull[rid] = RecvMeta(rid, [], parsed, release_only=True)
            params["do_remote_prefill"] = False
            return False, None
        if not (self.is_producer and wants_remote_decode(params)):
            return False, None
        if request.status != self._length_capped:
            return False, None
        prompt_len = request.num_prompt_tokens
        runs: list[tuple[int, int]] = []
        if groups is not None:
            held, runs = self.groups.runs(groups, prompt_len)
        else:
            held = list(block_ids[: math.ceil(prompt_len / self.block_size)])
        if not held:
            return False, None
        token = capability_token()
        # P's workers hold the blocks at least cfg.hold_window_s from their next step (after
        # this moment): D trusts a read within that window of the stamp (pull.contract)
        window = stamp(instance=self.instance, request_id=rid, block_ids=held, token=token,
                       hold_s=self.cfg.hold_window_s, authn=self.authn)
        self._to_hold[rid] = SendMeta(rid, held, token, in_order=bool(runs))
        out = request.output_token_ids
        return True, sign_params(params_for_decode(
            block_ids=held, engine_id=self.engine_id, host=self.host, port=self.side_port,
            request_id=rid, tp_size=self.tp_size,
            last_token_id=int(out[-1]) if len(out) else None, num_prompt_blocks=len(held),
            claim_token=token, rank_hosts=self.rank_hosts, window=window, block_groups=runs),
            ttl_s=self.cfg.max_hold_s, authn=self.authn)

    def shutdown(self) -> None:
        if self.renewer is not None:
            self.renewer.stop()
        if self.claims is not None:
            self.claims.stop()


def _claim_ahead(vllm_config: VllmConfig, cfg: MooncakeP2PConfig,
                 engine_id: str) -> ClaimAhead | None:
    """D's claims sent ahead, with the readers of each P rank the workers' head plans give,
    on every pipeline stage of P (``None`` when the model config cannot tell the KV heads:
    the workers claim)."""
    from vllm_ascend.distributed.kernels.heads import partners_per_remote_rank

    try:
        mc = vllm_config.model_config
        is_mla = bool(getattr(mc, "use_mla", False))
        heads = 1 if is_mla else int(mc.get_total_num_kv_heads())
    except Exception as exc:  # a config without a model: no claims ahead
        logger.debug("no claims ahead: %s", exc)
        return None
    d_tp = vllm_config.parallel_config.tensor_parallel_size
    pp = cfg.prefill.pp_size
    return ClaimAhead(lambda p_tp: expand_over_stages(
        (), partners_per_remote_rank(heads, p_tp, d_tp, is_mla=is_mla), tp_size=p_tp,
        pp_size=pp)[1], cfg.handshake_timeout_s, reader=f"{engine_id}/scheduler",
        engine_id=engine_id)


class ClaimAhead:
    """D's scheduler: one ``Claim`` a request to every P rank read, sent when first seen.

    Sent on its own thread from ``get_num_new_matched_tokens``, once a request (never twice,
    however often vLLM asks again), to every P rank some D rank reads, with the request's
    token and each rank's number of D readers: the claim the workers would send. The answers
    go to the workers with the metadata (:class:`~.contract.EarlyClaim`), and at once to a
    worker in this process (:func:`~.contract.local_inbox`). Safety is the worker's claim's:
    P answers the same ``Claim`` the same way and renews the same lease. A request aborted
    before allocation is released by the worker's ``Done(success=False)`` as before; a claim
    still queued then is dropped, and one that reaches P after the release is refused (P
    remembers released ids).

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
        self._clients: dict[tuple[str, str], RpcClient[Any]] = {}
        #: request id -> (block ids claimed, the answers by P rank)
        self._sent: dict[str, tuple[list[int], Future[Answers]]] = {}
        #: requests handed to the workers before their answers came
        self._owed: dict[str, Future[Answers]] = {}
        #: requests whose claims were answered since the last :meth:`take_answers`: a step
        #: looks at these, not at every request still owed its answers
        self._answered: list[str] = []
        #: every claim submitted and not done yet (also those no request waits for any more):
        #: :meth:`stop` cancels them, so the claim thread never works through a queue of
        #: claims to a P that does not answer while the process exits
        self._pending: set[Future[Answers]] = set()
        if engine_id:
            register_claimer(engine_id, self)

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
            self._pending.add(fut)
        fut.add_done_callback(lambda f: self._deliver_locally(request_id, f))
        return True

    def _deliver_locally(self, request_id: str, fut: Future[Answers]) -> None:
        with self._lock:
            self._pending.discard(fut)
            self._answered.append(request_id)
        inbox = local_inbox(self.engine_id)
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
            if claimed == list(block_ids):
                if fut.done():
                    return True, _result(fut)
                self._owed[request_id] = fut
                return True, None
        # vLLM's prefix hit changed since: the workers claim; this claim, not sent yet, never
        # will be (cancelled outside the lock: a cancel runs its done callback, which takes it)
        fut.cancel()
        return False, None

    def take_answers(self) -> dict[str, Answers]:
        """Answers that came since, of requests handed to the workers without them."""
        with self._lock:
            answered, self._answered = self._answered, []
            out: dict[str, Answers] = {}
            for rid in answered:
                fut = self._owed.get(rid)
                if fut is not None and fut.done():  # (an id claimed again: its new claim's)
                    out[rid] = _result(self._owed.pop(rid))
            return out

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
        unregister_claimer(self.engine_id, self)
        with self._lock:
            pending = list(self._pending)
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

    def _client(self, endpoint: str, engine_id: str) -> RpcClient[Any]:
        """P rank's client, its frames bound to P's engine id (``engine_id``) under a key."""
        with self._lock:
            client = self._clients.get((endpoint, engine_id))
            if client is None:
                client = self._clients[(endpoint, engine_id)] = RpcClient(
                    endpoint, CODEC, timeout_s=self.timeout_s, engine_id=engine_id)
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
                reply = self._client(tcp_endpoint(remote.host_of(rank), port),
                                     remote.engine_id).call(msg)
            except RemoteError as exc:
                out[rank] = EarlyClaim(ok=False, error=exc.code or "refused")
                continue
            except KVTransferError as exc:
                out[rank] = EarlyClaim(ok=False, error=f"{type(exc).__name__}: {exc}")
                continue
            if isinstance(reply, ClaimGrant):
                out[rank] = EarlyClaim(ok=True, first_try=True, sent_wall=sent,
                                       block_addrs=reply.block_addrs,
                                       num_regions=reply.num_regions)
            elif isinstance(reply, ClaimOK):
                out[rank] = EarlyClaim(ok=True, first_try=True, sent_wall=sent)
            else:
                out[rank] = EarlyClaim(ok=False, error=f"reply {type(reply).__name__}")
        return out


def _result(fut: Future[Answers]) -> Answers:
    try:
        return fut.result(timeout=0)
    except Exception as exc:  # cancelled: the workers claim themselves
        return {-1: EarlyClaim(ok=False, error=f"{type(exc).__name__}")}

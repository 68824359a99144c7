# SPDX-License-Identifier: Apache-2.0
"""Scheduler side of ``MooncakeLayerwiseConnector`` (prefill pushes layer by layer).

On D (``kv_consumer``): a request with ``do_remote_prefill`` reports its prompt
as an asynchronous external hit. Once vLLM has allocated its blocks, D posts
their ids and its address to the proxy's metaserver (``metaserver`` URL in
the params, optional TLS, retries) and tells its workers to expect pushes. A
*virtual* request (``do_virtual: true``) is not posted: its workers report it
loaded at once. A post that fails for good reaches the workers with the next
step's metadata and fails the request at once instead of at its deadline
(the posts: :mod:`.layerwise.metaserver`).

On P (``kv_producer``): a request with ``do_remote_decode`` carries what D
posted. Every step that computes part of its prompt emits a :class:`PushReq`
naming the blocks to push: from D's cached prefix, those this step fills (a
block it leaves partly filled goes with the step that fills it, so each block
goes out once, also when requests share a step's token budget), so chunked
prefill is pushed chunk by chunk; the step that completes the prompt is flagged
``last`` and pushes what is left. When such a request finishes, its
blocks stay held (``request_finished`` returns ``True``) until the workers'
pushes that read them are over.

What the scheduler tells the workers is :mod:`.layerwise.contract`.

``kv_transfer_params`` that are ``None``, empty, or without ``do_virtual``
make an ordinary request on every path.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.auth import capability_token
from vllm_ascend.distributed.kv_transfer.core.kv_groups import NULL_BLOCK, KVGroups
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeLayerwiseConfig

from ..errors import KVParamsError
from ..params import (
    PushEndpoint,
    PushTarget,
    metaserver_url,
    params_for_prefill,
    parse_push_endpoint,
    parse_push_target,
    push_token,
    wants_remote_decode,
    wants_remote_prefill,
    wants_virtual,
)
from ..rank_hosts import parse_rank_hosts
from ..scheduler_base import SchedulerBase, runs_no_token
from ..signed_params import ParamsRefused
from ..signed_params import sign as sign_params
from ..signed_params import verify as verify_params
from .contract import MooncakeLayerwiseConnectorMetadata, PushReq, RecvReq
from .metaserver import MetaserverClient

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class _PushProgress:
    """P: push progress of one request."""

    request: Any
    target: PushTarget | None
    endpoint: PushEndpoint | None
    error: str | None
    #: D's capability and its ranks on other hosts, when only ``endpoint`` could be parsed
    token: str = ""
    rank_hosts: dict[int, str] = field(default_factory=dict)
    #: P's blocks of the request, one list per KV cache group, by position
    block_ids: list[list[int]] = field(default_factory=list)
    #: tokens (block aligned) D will hold once the pushes emitted so far are done
    cursor: int = 0
    emitted: bool = False
    complete: bool = False
    #: D was told this request fails (bad params, or it ended before any push)
    notified: bool = False


def isolate_from_prefix_cache(request: Request, *, first_block: int) -> None:
    """Give a virtual request's blocks hashes no other request can match.

    A virtual request moves no KV, so its blocks hold stale data; vLLM would
    cache them under the prompt's block hashes and serve the next request with
    that prompt from them. Re-keying the hashes from ``first_block`` on (blocks
    before it are real prefix-cache hits) with a per-request salt keeps them out
    of everyone else's reach; later hashes chain from the salted ones.
    """
    hashes = getattr(request, "block_hashes", None)
    if not isinstance(hashes, list):
        return
    salt = hashlib.sha256(f"vllm-ascend-virtual/{request.request_id}".encode()).digest()
    for i in range(first_block, len(hashes)):
        hashes[i] = type(hashes[i])(hashlib.sha256(salt + bytes(hashes[i])).digest())


def _lenient_hosts(params: Any, endpoint: PushEndpoint | None) -> dict[int, str]:
    """D's ranks on other hosts, to tell them a request failed (``{}`` if unusable)."""
    if endpoint is None or not isinstance(params, dict):
        return {}
    try:
        return parse_rank_hosts(params, tp_size=endpoint.tp_size)
    except KVParamsError:
        return {}


class LayerwiseScheduler(SchedulerBase):
    """Scheduler-side logic of the layerwise connector."""

    def __init__(self, vllm_config: VllmConfig, cfg: MooncakeLayerwiseConfig,
                 engine_id: str, *, kv_groups: KVGroups | None = None) -> None:
        super().__init__(vllm_config, engine_id)
        self.cfg = cfg
        #: the KV cache groups (several under vLLM's hybrid KV cache manager)
        self.groups = kv_groups or KVGroups.from_config(None)
        #: D leaves the prompt's last token to compute with a sliding window among the groups
        #: (as the pull does, :mod:`..pull.groups`): vLLM frees the window's blocks by the
        #: tokens loaded, and recomputing the last one would need a block it freed
        self._leave_last = self.groups.leaves_last_token
        self._recv: dict[str, RecvReq] = {}
        self._push: dict[str, _PushProgress] = {}
        self._pending_pushes: dict[str, PushReq] = {}
        self._failed_posts: dict[str, str] = {}
        #: this instance's TP ranks that listen on another host than ``host`` (multi-node D)
        self.rank_hosts: dict[int, str] = {}
        #: every TP rank's host as its worker published it (``None`` until vLLM passed them)
        self.published_hosts: dict[int, str] | None = None
        self._lock = threading.Lock()
        self.metaserver = (MetaserverClient(cfg.tls_config, timeout_s=cfg.metaserver_timeout_s,
                                            retry=cfg.metaserver_policy)
                           if self.is_consumer else None)

    def set_rank_hosts(self, hosts: dict[int, str]) -> None:
        """Where each TP rank's side channel listens (from the workers' handshake metadata);
        only ranks away from the scheduler's host are posted (the others are at ``host``)."""
        self.published_hosts = dict(hosts)
        self.rank_hosts = {r: h for r, h in hosts.items() if h != self.host}
        if self.rank_hosts:
            logger.info("TP ranks on other hosts than %s: %s", self.host, self.rank_hosts)

    # ------------------------------------------------------------ vLLM hooks
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        if not (self.is_consumer and wants_remote_prefill(request.kv_transfer_params)):
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens - self._leave_last
        if count <= 0:
            return 0, False
        return count, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self.is_consumer and wants_remote_prefill(params):
            self._after_alloc_decode(request, blocks, num_external_tokens)
        elif self.is_producer and wants_remote_decode(params):
            self._after_alloc_prefill(request, blocks)

    def _after_alloc_decode(self, request: Request, blocks: KVCacheBlocks,
                            num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        assert isinstance(params, dict)
        issued = dict(params)  # as the proxy signed them (the next line changes them)
        params["do_remote_prefill"] = False  # never load twice (e.g. after a preemption)
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        prompt_len = len(request.prompt_token_ids or ())
        cached = prompt_len - num_external_tokens - self._leave_last
        n_blocks = math.ceil(prompt_len / self.block_size)
        runs: list[tuple[int, int]] = []
        if self.groups.hybrid:
            # the blocks D's manager keeps of each group (a window's freed ones are null)
            local, runs = self.groups.runs(blocks.get_block_ids(), prompt_len - self._leave_last)
            n_blocks = len(local)
        else:
            local = list(blocks.get_block_ids()[0][:n_blocks])
        meta = RecvReq(rid, local, cached, block_groups=tuple(runs))
        try:
            # a key holder's params only, an allowed metaserver: before anything is posted
            verify_params(issued, allowed_hosts=self.cfg.allowed_peer_hosts,
                          metaserver_urls=self.cfg.metaserver_urls)
            meta.do_virtual = wants_virtual(params)
            if meta.do_virtual:
                isolate_from_prefix_cache(request, first_block=cached // self.block_size)
                self._recv[rid] = meta
                return
            url = metaserver_url(params)
            if len(local) != n_blocks:
                raise KVParamsError(f"{len(local)} blocks were allocated for a {prompt_len}-token "
                                    f"prompt that needs {n_blocks}")
        except KVParamsError as exc:
            logger.error("request %s: bad kv_transfer_params: %s", rid, exc)
            meta.error = str(exc)
            self._recv[rid] = meta
            return
        meta.push_token = capability_token()
        self._recv[rid] = meta
        proxy_id = params.get("request_id")
        payload = sign_params(params_for_prefill(
            proxy_request_id=proxy_id if isinstance(proxy_id, str) and proxy_id else rid,
            block_ids=local, block_size=self.block_size, engine_id=self.engine_id,
            host=self.host, port=self.side_port, request_id=rid, tp_size=self.tp_size,
            cached_tokens=cached, push_token=meta.push_token, rank_hosts=self.rank_hosts,
            block_groups=runs),
            ttl_s=self.cfg.load_timeout_s)  # P checks it before it dials D
        assert self.metaserver is not None

        def failed(reason: str) -> None:
            logger.error("request %s: metaserver post failed: %s", rid, reason)
            with self._lock:
                self._failed_posts[rid] = reason

        self.metaserver.submit(url, payload, failed)

    def _after_alloc_prefill(self, request: Request, blocks: KVCacheBlocks) -> None:
        rid = request.request_id
        params = request.kv_transfer_params
        target: PushTarget | None = None
        endpoint = None
        error = None
        token = ""
        try:
            # a key holder's params only, or an allowed host: before anything is dialed
            verify_params(params, allowed_hosts=self.cfg.allowed_peer_hosts)
            target = parse_push_target(params, prompt_len=request.num_prompt_tokens,
                                       block_size=self.block_size)
        except KVParamsError as exc:
            error = str(exc)
            logger.error("request %s: bad kv_transfer_params for a layerwise push: %s", rid, exc)
            try:
                if isinstance(exc, ParamsRefused):
                    raise exc  # not D's params: the host they name is told nothing
                endpoint = parse_push_endpoint(params)
                token = push_token(params)
            except KVParamsError:
                endpoint = None  # D cannot even be told; it fails at its deadline
        state = self._push.get(rid)
        if state is None:
            state = _PushProgress(request, target, endpoint, error, token,
                                  _lenient_hosts(params, endpoint))
            self._push[rid] = state
        if target is None:
            if not state.notified:
                # Nothing can be pushed: tell D at once rather than at its deadline.
                state.notified = True
                self._pending_pushes[rid] = PushReq(rid, None, abort=error, endpoint=endpoint,
                                                    token=state.token,
                                                    rank_hosts=state.rank_hosts)
            return
        # (Re)start from D's cached prefix: after a preemption P recomputes into new blocks.
        state.block_ids = [list(group) for group in blocks.get_block_ids()]
        state.cursor = target.cached_tokens if target is not None else 0
        state.complete = False

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> MooncakeLayerwiseConnectorMetadata:
        meta = MooncakeLayerwiseConnectorMetadata(
            requests=self._recv, idle=runs_no_token(scheduler_output))
        self._recv = {}
        with self._lock:
            meta.failed_posts, self._failed_posts = self._failed_posts, {}
        meta.pushes, self._pending_pushes = self._pending_pushes, {}
        if self._push:
            self._emit_pushes(scheduler_output, meta)
        return meta

    def _emit_pushes(self, out: SchedulerOutput, meta: MooncakeLayerwiseConnectorMetadata) -> None:
        for new in out.scheduled_new_reqs:
            state = self._push.get(new.req_id)
            if state is not None:
                state.block_ids = [list(group) for group in new.block_ids]
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._push.get(rid)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                if new_ids is not None:
                    state.block_ids = [list(group) for group in new_ids]
                state.cursor = state.target.cached_tokens if state.target else 0
                state.complete = False
            elif new_ids is not None:
                for mine, more in zip(state.block_ids, new_ids, strict=False):
                    mine.extend(more)
        for rid, n in out.num_scheduled_tokens.items():
            state = self._push.get(rid)
            if state is None or n <= 0 or state.target is None:
                continue
            if state.complete:
                continue  # decoding on P after the prompt: nothing more to push
            req = state.request
            prompt_len = req.num_prompt_tokens
            end = min(req.num_computed_tokens + n, prompt_len)
            last = end >= prompt_len
            first = state.cursor // self.block_size
            # a block this step leaves partly filled goes out with the step that fills it
            # (or ends the prompt), once: pushed now, it would be pushed again then
            stop = math.ceil(end / self.block_size) if last else end // self.block_size
            positions, local, groups = push_blocks(state.target, state.block_ids, first, stop)
            if not positions and not last:
                continue
            meta.pushes[rid] = PushReq(rid, state.target, positions, local, last=last,
                                       groups=groups if state.target.block_groups else [])
            state.emitted = True
            state.cursor = (end // self.block_size) * self.block_size
            state.complete = last

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        state = self._push.pop(rid, None)
        if state is None:
            params = request.kv_transfer_params
            if isinstance(params, dict) and self.is_consumer and params.get("do_remote_prefill"):
                params["do_remote_prefill"] = False  # finished before allocation: nothing sent
            elif self.is_producer and wants_remote_decode(params):
                # Ended on P before it was ever scheduled: D must not wait for it.
                try:
                    verify_params(params, allowed_hosts=self.cfg.allowed_peer_hosts)
                    endpoint = parse_push_endpoint(params)
                    token = push_token(params)
                except KVParamsError:
                    return False, None
                self._pending_pushes[rid] = PushReq(
                    rid, None, endpoint=endpoint, token=token,
                    rank_hosts=_lenient_hosts(params, endpoint),
                    abort="the request ended on the prefill instance before it was scheduled")
            return False, None
        if state.emitted:
            # The workers may still read these blocks (a layer push in flight); they report
            # the request in finished_sending once every push that reads them is over.
            return True, None
        # Ended on P before any push (aborted while waiting): D must not wait for it.
        if not state.notified and state.target is not None:
            self._pending_pushes[rid] = PushReq(
                rid, state.target, abort="the request ended on the prefill instance before "
                                         "its KV was pushed")
        return False, None

    def shutdown(self) -> None:
        if self.metaserver is not None:
            self.metaserver.close()


def push_blocks(target: PushTarget, block_ids: list[list[int]], first: int, stop: int
                ) -> tuple[list[int], list[int], list[int]]:
    """P: the blocks of positions ``[first, stop)`` to push, of every group whose block D
    keeps there: ``(positions, P's blocks, groups)``, parallel lists."""
    positions: list[int] = []
    local: list[int] = []
    groups: list[int] = []
    for g, ids in enumerate(block_ids if target.block_groups else block_ids[:1]):
        for j in range(first, min(stop, len(ids))):
            if ids[j] == NULL_BLOCK and target.block_groups:
                continue  # P computed it this step but vLLM freed it (a window left it)
            if target.d_block(g, j) is None:
                continue
            positions.append(j)
            local.append(ids[j])
            groups.append(g)
    return positions, local, groups

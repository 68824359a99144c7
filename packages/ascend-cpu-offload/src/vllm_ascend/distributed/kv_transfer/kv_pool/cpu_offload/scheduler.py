# SPDX-License-Identifier: Apache-2.0
"""Scheduler side of ``CPUOffloadingConnector``: what to load, what to save.

Per step:

1. ``get_num_new_matched_tokens`` hashes the request's full blocks
   (:func:`core.hashing.chained_block_hashes` over token ids plus LoRA name
   and cache salt: equal in every process, no ``PYTHONHASHSEED`` needed) and
   *pins* the host blocks that continue the device's own prefix hit, in one
   call to the metadata server. Pinning at once means the blocks offered to
   vLLM cannot be evicted before they are loaded; pins of requests vLLM did
   not admit are released at the end of the step. Only tokens beyond the
   device hit are offered (vLLM serves its own prefix cache), never the last
   prompt token (vLLM must compute one), and nothing below
   ``swap_in_threshold``.
2. ``update_state_after_alloc`` turns an admitted hit into a
   :class:`~.contract.HostLoad` (host blocks -> the request's device blocks).
3. ``build_connector_meta`` asks the server for host blocks for every block
   that becomes full this step and is not in host memory yet (LRU eviction
   happens there), emits :class:`~.contract.HostSave` records, and releases the
   step's pins.
4. ``request_finished`` keeps the device blocks of a request with saves until
   every worker reports them done, so a background save never reads a block
   that was handed to another request.

A metadata server that fails to answer makes the connector serve without the
host cache for a while (no hit, no save); the engine never waits on it twice.

Under vLLM's hybrid KV cache manager (full-attention and sliding-window KV cache groups)
a block of each group is a host block of its own, hashed with its group. The hit is the
longest prefix every group serves (vLLM's rule: the full group needs every block before it,
a window's group the blocks of the window of the token after it), found by pinning each
group's needed blocks and moving the hit back before the first one missing. Saves and loads
go group by group, a window's only for the blocks vLLM keeps; loads are asynchronous (a
failed one is reported by request, as vLLM requires with several groups), and a window's
block vLLM frees and gives out again while its save may still read it makes the workers
finish that save first (``wait_saves``).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError
from vllm_ascend.distributed.kv_transfer.core.hashing import chained_block_hashes
from vllm_ascend.distributed.kv_transfer.core.kv_groups import NULL_BLOCK, KVGroups
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.config import CPUOffloadConfig

from .contract import (
    CPUOffloadingConnectorMetadata,
    HostLoad,
    HostSave,
    block_size_of,
    endpoint_for,
)
from .cpu_offload_manager.client import MetadataClient, ServerUnavailable
from .cpu_offload_manager.protocol import SaveRequest

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class _ReqState:
    """What the scheduler side tracks per live request."""

    request: Any
    extra: Any
    skip: bool
    #: block hashes of each KV cache group (one group unless the hybrid manager is on)
    hashes: dict[int, list[bytes]] = field(default_factory=dict)
    #: device blocks of each KV cache group (vLLM's lists: a window's freed blocks are null)
    block_ids: list[list[int]] = field(default_factory=lambda: [[]])
    #: blocks [0, save_cursor) were offered for saving already
    save_cursor: int = 0
    #: any save was dispatched: the workers report the request when its saves are done
    had_save: bool = False


@dataclass
class _Pin:
    key: str
    start_block: int
    start_token: int
    host_ids: list[int]
    #: the KV cache group whose blocks are pinned
    group: int = 0


def _group_lists(block_ids: Any) -> list[list[int]]:
    """vLLM's block ids of a request, one list per KV cache group."""
    return [list(ids) for ids in block_ids or ()] or [[]]


class CPUOffloadScheduler:
    """Scheduler-side logic (one per engine core).

    Args:
        vllm_config: the engine's config.
        cfg: the connector's parsed extra config.
        kv_cache_config: vLLM's KV cache config (block size).
        recorder: where metrics go.
        client: a metadata client (tests); default: one for :func:`endpoint_for`.
    """

    def __init__(self, vllm_config: Any, cfg: CPUOffloadConfig, kv_cache_config: Any,
                 recorder: MetricsRecorder, client: MetadataClient | None = None) -> None:
        self.cfg = cfg
        self.block_size = block_size_of(vllm_config, kv_cache_config)
        #: the engine's KV cache groups (one unless vLLM's hybrid KV cache manager is on)
        self.groups = KVGroups.from_config(kv_cache_config)
        #: hits, loads and saves group by group, a window's only for the blocks vLLM keeps
        #: (several groups, or a model whose every layer has a window)
        self.by_group = self.groups.hybrid or self.groups.has_window
        self.recorder = recorder
        self.client = client or MetadataClient(endpoint_for(vllm_config, cfg),
                                               timeout_s=cfg.rpc_timeout_s,
                                               retry_after_s=cfg.retry_after_s)
        self.owner = f"scheduler-{os.getpid()}"
        self._reqs: dict[str, _ReqState] = {}
        self._pins: dict[str, list[_Pin]] = {}
        #: a window's blocks whose saves were planned -> the request saving them
        self._window_saves: dict[int, str] = {}
        #: device prefix hit each request was queried with this step (for hit/miss metrics)
        self._queried: dict[str, int] = {}
        self._release: list[str] = []
        self._loads: list[HostLoad] = []
        self._keys = itertools.count(1)

    # ------------------------------------------------------------------ state
    def _state(self, request: Request) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = _ReqState(request=request, extra=extra_key_of(request), skip=_unsupported(request))
            self._reqs[request.request_id] = st
        else:
            st.request = request
        return st

    def _hashes(self, st: _ReqState, num_blocks: int, group: int = 0) -> list[bytes]:
        """Hashes of the first ``num_blocks`` full blocks of ``group`` (computed once, extended
        as tokens come; with several groups each group's chain is its own)."""
        hashes = st.hashes.setdefault(group, [])
        have = len(hashes)
        if num_blocks > have:
            tokens = st.request.all_token_ids[: num_blocks * self.block_size]
            extra = [st.extra, "kv_cache_group", group] if self.groups.hybrid else st.extra
            hashes[:] = chained_block_hashes(tokens, self.block_size, extra=extra,
                                             start_block=have, previous=hashes)
        return hashes[:num_blocks]

    def _drop_pin(self, req_id: str) -> None:
        for pin in self._pins.pop(req_id, ()):
            self._release.append(pin.key)

    # ------------------------------------------------------------------ vLLM hooks
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that host memory can supply (loaded this step)."""
        st = self._state(request)
        self._drop_pin(request.request_id)
        if st.skip:
            return 0, False
        self._queried[request.request_id] = num_computed_tokens
        if not self.client.available:
            return 0, False
        bs = self.block_size
        num_tokens = request.num_tokens
        start_block = num_computed_tokens // bs
        full = num_tokens // bs
        if (full <= start_block or num_tokens - 1 <= num_computed_tokens
                or num_computed_tokens % bs):
            return 0, False
        if self.by_group:
            return self._match_groups(st, num_computed_tokens)
        hashes = self._hashes(st, full)[start_block:]
        key = f"{request.request_id}#{next(self._keys)}"
        started = time.perf_counter()
        try:
            host_ids = self.client.pin(key, hashes, owner=self.owner)
            self.recorder.observe("offload_lookup_seconds", time.perf_counter() - started)
        except (ServerUnavailable, RemoteError) as exc:
            logger.debug("offload lookup of %s failed: %s", request.request_id, exc)
            self.recorder.inc("offload_failures", op="lookup")
            return 0, False
        if not host_ids:
            return 0, False
        self._pins[request.request_id] = [_Pin(key, start_block, num_computed_tokens, host_ids)]
        hit_tokens = min((start_block + len(host_ids)) * bs, num_tokens - 1)
        external = hit_tokens - num_computed_tokens
        if external <= 0 or external < self.cfg.swap_in_threshold:
            self._drop_pin(request.request_id)
            return 0, False
        return external, False

    def _match_groups(self, st: _ReqState, num_computed: int) -> tuple[int, bool]:
        """The longest prefix every KV cache group serves, its blocks pinned (loaded
        asynchronously with several groups)."""
        request, bs = st.request, self.block_size
        start = num_computed // bs
        hit = min(request.num_tokens // bs * bs, request.num_tokens - 1)
        started = time.perf_counter()
        while hit > num_computed:
            last = -(-hit // bs)
            pins: list[_Pin] = []
            for group in self.groups.groups:
                first = max(start, group.first_kept(hit))
                key = f"{request.request_id}#{next(self._keys)}"
                try:
                    host = self.client.pin(key, self._hashes(st, last, group.index)[first:last],
                                           owner=self.owner)
                except (ServerUnavailable, RemoteError) as exc:
                    logger.debug("offload lookup of %s failed: %s", request.request_id, exc)
                    self.recorder.inc("offload_failures", op="lookup")
                    self._release += [p.key for p in pins]
                    return 0, False
                if host:
                    pins.append(_Pin(key, first, num_computed, host, group.index))
                if len(host) < last - first:  # the hit ends before this group's missing block
                    hit = (first + len(host)) * bs
                    break
            else:
                self.recorder.observe("offload_lookup_seconds", time.perf_counter() - started)
                self._pins[request.request_id] = pins
                external = hit - num_computed
                if external < self.cfg.swap_in_threshold:
                    self._drop_pin(request.request_id)
                    return 0, False
                return external, self.groups.hybrid
            self._release += [p.key for p in pins]
        self.recorder.observe("offload_lookup_seconds", time.perf_counter() - started)
        return 0, False

    def _plan_group_load(self, st: _ReqState, pins: list[_Pin], num_external: int) -> HostLoad:
        """The load of every group's blocks a hit needs (a window's: those vLLM keeps)."""
        bs = self.block_size
        computed = pins[0].start_token
        total = computed + num_external
        by_group = {p.group: p for p in pins}
        host_ids: list[int] = []
        device_ids: list[int] = []
        failed: list[int] = []
        for group in self.groups.groups:
            ids = st.block_ids[group.index] if group.index < len(st.block_ids) else []
            pin = by_group.get(group.index)
            for pos in range(max(computed // bs, group.first_kept(total)), -(-total // bs)):
                if pos >= len(ids) or ids[pos] == NULL_BLOCK:
                    continue
                k = pos - pin.start_block if pin is not None else -1
                if pin is not None and 0 <= k < len(pin.host_ids):
                    host_ids.append(pin.host_ids[k])
                    device_ids.append(ids[pos])
                else:  # vLLM admitted more than was offered: recomputed (failed by request)
                    failed.append(ids[pos])
        # one group (a window on every layer): loaded before the forward, as without windows
        tail = (not self.groups.hybrid and total % bs != 0 and bool(device_ids)
                and not failed)
        return HostLoad(req_id=st.request.request_id, host_ids=host_ids, device_ids=device_ids,
                        failed_ids=failed, sync_tail=tail, is_async=self.groups.hybrid)

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Record the request's device blocks; plan the load of an admitted hit."""
        st = self._state(request)
        st.block_ids = _group_lists(blocks.get_block_ids() if blocks is not None else None)
        # a (re)admitted request starts its save scan over; blocks already in host
        # memory are skipped by the server
        st.save_cursor = 0
        pins = self._pins.get(request.request_id)
        start = self._queried.pop(request.request_id, None)
        if start is not None:
            queried = max(0, request.num_tokens - start)
            self.recorder.inc("offload_hit_tokens", max(0, num_external_tokens))
            self.recorder.inc("offload_miss_tokens", max(0, queried - num_external_tokens))
        if num_external_tokens <= 0 or not pins:
            self._drop_pin(request.request_id)
            return
        if self.by_group:
            self._loads.append(self._plan_group_load(st, pins, num_external_tokens))
            return
        pin = pins[0]
        bs = self.block_size
        end_token = pin.start_token + num_external_tokens
        n_blocks = -(-end_token // bs) - pin.start_block
        wanted = st.block_ids[0][pin.start_block: pin.start_block + n_blocks]
        k = min(len(wanted), len(pin.host_ids))
        if k < n_blocks:
            # vLLM admitted more than was offered (cannot happen with a consistent vLLM):
            # what cannot be loaded is reported as a load error and recomputed
            logger.error("request %s: %d external tokens need %d host blocks, %d are pinned and "
                         "%d device blocks allocated; the rest is recomputed",
                         request.request_id, num_external_tokens, n_blocks, len(pin.host_ids),
                         len(wanted))
        self._loads.append(HostLoad(req_id=request.request_id, host_ids=pin.host_ids[:k],
                                    device_ids=wanted[:k], failed_ids=wanted[k:],
                                    sync_tail=k == n_blocks and end_token % bs != 0))

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> CPUOffloadingConnectorMetadata:
        """This step's loads (planned above) and saves (planned now); releases the step's pins."""
        self._track_blocks(scheduler_output)
        wait_saves = self._reused_window_blocks(scheduler_output)
        pending: list[tuple[_ReqState, str, int, int, int]] = []
        requests: list[SaveRequest] = []
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or st.skip:
                continue
            req = st.request
            valid = min(req.num_computed_tokens + n_sched, req.num_tokens)
            if not self.cfg.save_decode_blocks:
                valid = min(valid, req.num_prompt_tokens)
            full = min(valid // self.block_size, len(st.block_ids[0]))
            if full <= st.save_cursor:
                continue
            for group, ids in enumerate(st.block_ids):
                # a window's group: the blocks vLLM keeps, never its null block
                start = next((p for p in range(st.save_cursor, full) if ids[p] != NULL_BLOCK),
                             full) if self.by_group else st.save_cursor
                if start >= full:
                    continue
                hashes = self._hashes(st, full, group)[start:]
                pending.append((st, req_id, start, full, group))
                key = f"{req_id}#g{group}" if self.groups.hybrid else req_id
                requests.append(SaveRequest(key=key, hashes=hashes))
        for req_id in list(self._pins):
            self._drop_pin(req_id)
        self._queried.clear()
        saves: list[HostSave] = []
        if requests or self._release:
            try:
                reply = self.client.plan_step(requests, self._release, owner=self.owner)
            except (ServerUnavailable, RemoteError) as exc:
                logger.debug("offload save planning failed: %s", exc)
                self.recorder.inc("offload_failures", op="plan")
                reply = None
            if reply is not None:
                self._release = []
                self.recorder.inc("offload_evicted_blocks", reply.evictions)
                self.recorder.inc("offload_expired_saves", reply.expired_saves)
                self.recorder.set("offload_host_blocks_used", reply.used_blocks)
                self.recorder.set("offload_host_blocks_total", reply.total_blocks)
                for planned, (st, req_id, start, full, group) in zip(reply.saves, pending,
                                                                     strict=True):
                    st.save_cursor = full
                    if planned.job_id == 0:
                        continue
                    device_ids = [st.block_ids[group][start + p] for p in planned.positions]
                    if self.groups.groups[group].kind == "sliding":
                        self._window_saves.update(dict.fromkeys(device_ids, req_id))
                    saves.append(HostSave(req_id=req_id, job_id=planned.job_id,
                                          host_ids=list(planned.block_ids),
                                          device_ids=device_ids))
                    st.had_save = True
            elif len(self._release) > 4096:
                # the pins lapse on the server by lease; stop remembering them
                self._release = []
        meta = CPUOffloadingConnectorMetadata(
            loads=self._loads, saves=saves,
            preempted_req_ids=set(scheduler_output.preempted_req_ids or ()),
            wait_saves=wait_saves)
        self._loads = []
        return meta

    def _reused_window_blocks(self, so: SchedulerOutput) -> set[str]:
        """Requests whose planned saves read a window's block that vLLM gave out again in
        this step (to a scheduled request or a load): the workers finish them first."""
        if not self._window_saves:
            return set()
        new = [b for req in so.scheduled_new_reqs for ids in req.block_ids or () for b in ids]
        new += [b for ids_of in so.scheduled_cached_reqs.new_block_ids for ids in ids_of or ()
                for b in ids]
        new += [b for load in self._loads for b in load.device_ids]
        return {self._window_saves.pop(b) for b in new if b in self._window_saves}

    def _track_blocks(self, so: SchedulerOutput) -> None:
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None and new.block_ids:
                st.block_ids = _group_lists(new.block_ids)
        cached = so.scheduled_cached_reqs
        resumed: set[str] = set(getattr(cached, "resumed_req_ids", None) or ())
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = _group_lists(new_ids)
                st.save_cursor = 0
            elif new_ids:
                for ids, more in zip(st.block_ids, new_ids, strict=False):
                    ids.extend(more)

    def request_finished(self, request: Request, block_ids: Any
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks while saves of the request may still read them."""
        self._drop_pin(request.request_id)
        self._queried.pop(request.request_id, None)
        st = self._reqs.pop(request.request_id, None)
        return (st is not None and st.had_save), None

    def reset_cache(self) -> bool:
        """Drop every host block nobody pins."""
        try:
            freed = self.client.reset()
        except (ServerUnavailable, RemoteError) as exc:
            logger.warning("could not reset the CPU offload cache: %s", exc)
            self.recorder.inc("offload_failures", op="reset")
            return False
        logger.info("CPU offload cache reset: %d host blocks freed", freed)
        return True

    def shutdown(self) -> None:
        """Close the client."""
        self.client.close()


def extra_key_of(request: Any) -> Any:
    """What besides token ids a request's block hashes cover (LoRA name, cache salt)."""
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None)
    if lora is None and not salt:
        return None
    return [getattr(lora, "lora_name", None) if lora is not None else None, salt or None]


def _unsupported(request: Any) -> bool:
    """Requests whose KV does not follow from token ids alone (images, prompt embeddings)."""
    if getattr(request, "mm_features", None):
        return True
    return getattr(request, "prompt_embeds", None) is not None

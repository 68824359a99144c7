# SPDX-License-Identifier: Apache-2.0
"""Scheduler side of the pool: lookups, load plans and save plans.

* ``get_num_new_matched_tokens`` hashes the request's prompt in pool blocks
  and asks the worker side (:class:`~.lookup.LookupClient`) how many leading
  tokens the pool holds. A full hit reports one token less, so the last
  token is computed and sampled; a failed lookup is a miss.
* ``update_state_after_alloc`` arms the load once vLLM allocated blocks.
* ``build_connector_meta`` emits the loads and, for every scheduled request,
  a save of the prompt blocks completed in this step that the pool does not
  already hold (blocks just loaded from it are skipped; the worker skips any
  other block the store has).
* ``request_finished`` keeps a request's blocks until its saves are done.

With vLLM's hybrid KV cache manager on (several KV cache groups), the lookup asks which
blocks each group holds and the hit is the longest prefix every group serves; loads and
saves are planned group by group, a sliding window's only for the blocks vLLM keeps, and
loads run asynchronously so that a failed one is reported by request (:mod:`.hybrid`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import AscendStoreConfig

from .context import PoolContext
from .hybrid import SavedWindowBlocks, block_runs, hybrid_hit
from .keys import BlockHasher
from .lookup import LookupClient, lookup_endpoint
from .metrics import SCHEDULER_METRICS
from .store_contract import AscendConnectorMetadata, BlockEventSpec, TransferJob
from .tracking import PoolHit, RequestTracker

logger = logging.getLogger(__name__)

#: Requests whose hashes are remembered while they wait to be scheduled.
MAX_TRACKED_WAITING = 65536


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVPoolScheduler:
    """The pool's scheduler-side logic.

    Args:
        ctx: engine facts.
        cfg: pool configuration.
        lookup_client: how to reach the worker's lookup server (default: its socket).
    """

    def __init__(self, ctx: PoolContext, cfg: AscendStoreConfig, *,
                 lookup_client: Any = None) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.block_size = ctx.block_size
        self.hasher = BlockHasher(ctx.block_size, ctx.salt)
        self.groups = ctx.groups
        #: hits, loads and saves group by group, a window's only for the blocks vLLM keeps
        #: (several groups, or a model whose every layer has a window)
        self.by_group = self.groups.hybrid or self.groups.has_window
        # with several groups a failed load is reported by request, which vLLM accepts of a
        # request waiting for its load only: loads are asynchronous then
        self.load_async = (cfg.load_async or ctx.hybrid) and not cfg.use_layerwise
        self.can_load = not ctx.is_consumer or cfg.consumer_is_to_load
        self.can_save = not ctx.is_consumer or cfg.consumer_is_to_put
        self.include_partial = not cfg.discard_partial_chunks
        self.client = lookup_client if lookup_client is not None else LookupClient(
            lookup_endpoint(ctx.engine_id, ctx.dp_rank, cfg.lookup_rpc_port),
            timeout_s=cfg.lookup_timeout_s, retry_interval_s=cfg.store_retry_interval_s)
        self.recorder = MetricsRecorder(SCHEDULER_METRICS)
        self._trackers: OrderedDict[str, RequestTracker] = OrderedDict()
        self._requests: dict[str, Any] = {}
        self._load_specs: dict[str, PoolHit] = {}
        self._delay_free: set[str] = set()
        self._window_saves = SavedWindowBlocks()

    # ------------------------------------------------------------ hashing
    def _extra(self, request: Any) -> Any:
        lora = getattr(request, "lora_request", None)
        return self.hasher.extra(getattr(lora, "lora_name", None) if lora else None,
                                 getattr(request, "cache_salt", None))

    def _tracker(self, req_id: str) -> RequestTracker:
        tracker = self._trackers.get(req_id)
        if tracker is None:
            tracker = self._trackers[req_id] = RequestTracker(req_id)
            while len(self._trackers) > MAX_TRACKED_WAITING:
                old, _ = self._trackers.popitem(last=False)
                self._requests.pop(old, None)
                self._load_specs.pop(old, None)
        else:
            self._trackers.move_to_end(req_id)
        return tracker

    def request_hashes(self, request: Any, token_end: int) -> list[str]:
        """Pool hashes of the first ``token_end`` tokens (partial tail included if configured)."""
        tracker = self._tracker(request.request_id)
        tokens = list(request.all_token_ids[:token_end])
        full_blocks = token_end // self.block_size
        partial = self.include_partial and token_end % self.block_size != 0
        if tracker.hashes_cover != token_end:
            prev_full = [bytes.fromhex(h) for h in tracker.hashes[:tracker.hashes_cover
                                                                  // self.block_size]]
            tracker.hashes = self.hasher.hashes(tokens, extra=self._extra(request),
                                                include_partial=partial,
                                                previous=prev_full[:full_blocks])
            tracker.hashes_cover = token_end
        return tracker.hashes

    # ------------------------------------------------------------ lookup
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the pool can provide, and whether async."""
        if not self.can_load:
            return 0, False
        num_tokens = int(request.num_tokens)
        token_end = num_tokens if self.include_partial else (
            num_tokens // self.block_size * self.block_size)
        if token_end <= 0 or token_end <= num_computed_tokens:
            return 0, False
        hashes = self.request_hashes(request, token_end)
        start = time.perf_counter()
        failures_before = getattr(self.client, "failures", 0)
        if self.by_group:
            present = self.client.lookup_groups(hashes, [g.index for g in self.groups.groups])
            hit = hybrid_hit(self.groups, present, block_size=self.block_size,
                             token_end=token_end, num_tokens=num_tokens,
                             num_computed=num_computed_tokens)
        else:
            hit = int(self.client.lookup(hashes, token_end))
        self.recorder.observe("pool_lookup_seconds", time.perf_counter() - start)
        self.recorder.inc("pool_lookups")
        if getattr(self.client, "failures", 0) > failures_before:
            self.recorder.inc("pool_lookup_failures")
        if hit >= num_tokens:
            hit = num_tokens - 1  # the last token is computed so that the next one is sampled
        query = num_tokens - num_computed_tokens
        need = hit - num_computed_tokens
        if need <= 0:
            self.recorder.inc("pool_query_tokens", query)
            self.recorder.inc("pool_miss_tokens", query)
            return 0, False
        self.recorder.inc("pool_query_tokens", query)
        self.recorder.inc("pool_hit_tokens", need)
        self.recorder.inc("pool_miss_tokens", query - need)
        self._load_specs[request.request_id] = PoolHit(
            vllm_cached_tokens=num_computed_tokens, kvpool_cached_tokens=hit,
            is_async=self.load_async, token_end=token_end)
        logger.debug("pool hit for %s: %d of %d tokens (%d computed locally)",
                     request.request_id, hit, num_tokens, num_computed_tokens)
        return need, self.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        """Arm the load of a hit once vLLM allocated its blocks."""
        req_id = request.request_id
        self._requests[req_id] = request
        self._tracker(req_id)
        spec = self._load_specs.get(req_id)
        if spec is None:
            return
        if num_external_tokens <= 0:
            self._load_specs.pop(req_id, None)
            return
        if num_external_tokens != spec.kvpool_cached_tokens - spec.vllm_cached_tokens:
            logger.warning("pool load of %s: vLLM allocated %d external tokens, lookup said "
                           "%d; loading what vLLM allocated", req_id, num_external_tokens,
                           spec.kvpool_cached_tokens - spec.vllm_cached_tokens)
            spec.kvpool_cached_tokens = spec.vllm_cached_tokens + num_external_tokens
        spec.can_load = True
        if spec.is_async:
            self._trackers[req_id].load_block_ids = [list(ids) for ids in blocks.get_block_ids()]

    # ------------------------------------------------------------ metadata
    def build_connector_meta(self, scheduler_output: Any) -> AscendConnectorMetadata:
        """Loads and saves of this step."""
        meta = AscendConnectorMetadata()
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        meta.preempted_req_ids = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in meta.preempted_req_ids:
            tracker = self._trackers.get(req_id)
            if tracker is not None:
                tracker.set_blocks(None)
                tracker.num_computed_tokens = 0
        num_scheduled = scheduler_output.num_scheduled_tokens
        if len(self._window_saves):
            # a window's block freed while its save may be queued, allocated again
            meta.wait_saves = self._window_saves.reused(self._new_block_ids(scheduler_output))
        for new in scheduler_output.scheduled_new_reqs:
            tracker = self._tracker(new.req_id)
            tracker.set_blocks(new.block_ids)
            self._plan_load(tracker, meta)
            tracker.num_computed_tokens = new.num_computed_tokens + num_scheduled.get(new.req_id,
                                                                                      0)
            self._plan_save(tracker, meta)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._tracker(req_id)
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                tracker.set_blocks(new_ids)
                self._plan_load(tracker, meta)
            elif new_ids:
                tracker.add_blocks(new_ids)
            tracker.num_computed_tokens = cached.num_computed_tokens[i] + num_scheduled.get(
                req_id, 0)
            self._plan_save(tracker, meta)
        # async loads: armed for requests that wait for them and are not scheduled yet
        for req_id, spec in list(self._load_specs.items()):
            if spec.can_load and spec.is_async:
                tracker = self._tracker(req_id)
                tracker.set_blocks(tracker.load_block_ids)
                self._plan_load(tracker, meta)
        return meta

    def _new_block_ids(self, scheduler_output: Any) -> list[int]:
        """Blocks vLLM gave out this step: to scheduled requests, and to loads armed now."""
        out = [b for new in scheduler_output.scheduled_new_reqs for ids in new.block_ids or ()
               for b in ids]
        out += [b for new_ids in scheduler_output.scheduled_cached_reqs.new_block_ids
                for ids in new_ids or () for b in ids]
        for req_id, spec in self._load_specs.items():
            tracker = self._trackers.get(req_id)
            if spec.can_load and spec.is_async and tracker is not None:
                out += [b for ids in tracker.load_block_ids for b in ids]
        return out

    def _plan_load(self, tracker: RequestTracker, meta: AscendConnectorMetadata) -> None:
        spec = self._load_specs.get(tracker.req_id)
        if spec is None or not spec.can_load:
            return
        del self._load_specs[tracker.req_id]
        request = self._requests.get(tracker.req_id)
        if request is None:
            return
        first = spec.vllm_cached_tokens // self.block_size
        last = _cdiv(spec.kvpool_cached_tokens, self.block_size)
        hashes = self.request_hashes(request, spec.token_end)
        last = max(first, min(last, len(hashes), len(tracker.block_ids)))
        if last == first and not spec.is_async:
            return  # (an async load always gets a job, so that its completion is reported)
        end = min(last * self.block_size, spec.token_end)
        if not self.by_group:
            meta.loads.append(TransferJob(tracker.req_id, hashes[first:last],
                                          tracker.block_ids[first:last], first, end,
                                          is_async=spec.is_async))
        else:  # every group's blocks it holds (a window's: those vLLM keeps)
            jobs = [TransferJob(tracker.req_id, hashes[pos:pos + len(ids)], ids, pos,
                                min((pos + len(ids)) * self.block_size, end),
                                is_async=spec.is_async, group=group.index)
                    for group, blocks in zip(self.groups.groups, tracker.group_block_ids,
                                             strict=False)
                    for pos, ids in block_runs(blocks, first, last)]
            if not jobs and spec.is_async:  # its completion is reported all the same
                jobs = [TransferJob(tracker.req_id, [], [], first, end, is_async=True)]
            meta.loads += jobs
        # the loaded blocks are in the pool already: never save them back
        tracker.num_saved_tokens = max(tracker.num_saved_tokens, end)

    def _plan_save(self, tracker: RequestTracker, meta: AscendConnectorMetadata) -> None:
        if not self.can_save:
            return
        request = self._requests.get(tracker.req_id)
        if request is None:
            return
        prompt_len = int(request.num_prompt_tokens)
        upto = min(tracker.num_computed_tokens, prompt_len)
        if self.include_partial and upto == prompt_len:
            save_end = upto
        else:
            save_end = upto // self.block_size * self.block_size
        if save_end <= tracker.num_saved_tokens:
            return
        first = tracker.num_saved_tokens // self.block_size
        last = _cdiv(save_end, self.block_size)
        if last > len(tracker.block_ids):
            logger.debug("pool save of %s: %d blocks known, %d needed", tracker.req_id,
                         len(tracker.block_ids), last)
            last = len(tracker.block_ids)
        hashes = self.request_hashes(request, save_end)
        last = min(last, len(hashes))
        if last <= first:
            return
        token_end = min(last * self.block_size, save_end)
        if self.by_group:
            self._plan_group_saves(tracker, request, hashes, first, last, save_end, meta)
        else:
            events = (self._event_spec(request, first, last, token_end) if self.ctx.kv_events
                      else None)
            meta.saves.append(TransferJob(tracker.req_id, hashes[first:last],
                                          tracker.block_ids[first:last], first, token_end,
                                          events=events))
        tracker.num_saved_tokens = min(last * self.block_size, save_end)
        self._delay_free.add(tracker.req_id)

    def _plan_group_saves(self, tracker: RequestTracker, request: Any, hashes: list[str],
                          first: int, last: int, save_end: int,
                          meta: AscendConnectorMetadata) -> None:
        """Saves of positions ``first .. last`` of every group: the blocks its list holds
        (a window's group: those vLLM keeps, never its null block)."""
        for group, blocks in zip(self.groups.groups, tracker.group_block_ids, strict=False):
            for pos, ids in block_runs(blocks, first, last):
                end = min((pos + len(ids)) * self.block_size, save_end)
                events = (self._event_spec(request, pos, pos + len(ids), end)
                          if self.ctx.kv_events else None)
                meta.saves.append(TransferJob(tracker.req_id, hashes[pos:pos + len(ids)], ids,
                                              pos, end, events=events, group=group.index))
                if group.kind == "sliding":
                    self._window_saves.saving(tracker.req_id, ids)

    def _event_spec(self, request: Any, first: int, last: int, token_end: int
                    ) -> BlockEventSpec:
        """vLLM's hashes and the tokens of blocks ``first..last`` (KV cache events).

        vLLM hashes full blocks of ``block_size`` tokens, the pool's block size, so
        block ``i`` of the pool is vLLM's block ``i``; a block vLLM has not hashed
        (the prompt's partial tail) gets no event.
        """
        vllm_hashes = list(getattr(request, "block_hashes", None) or ())
        block_hashes: list[bytes | None] = [
            bytes(vllm_hashes[i]) if i < len(vllm_hashes) else None for i in range(first, last)]
        parent = bytes(vllm_hashes[first - 1]) if 0 < first <= len(vllm_hashes) else None
        lora = getattr(request, "lora_request", None)
        return BlockEventSpec(
            block_hashes=block_hashes, parent_hash=parent,
            token_ids=list(request.all_token_ids[first * self.block_size:token_end]),
            lora_name=getattr(lora, "lora_name", None) if lora else None,
            lora_id=getattr(lora, "lora_int_id", None) if lora else None)

    def _forget(self, req_id: str) -> None:
        self._trackers.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._load_specs.pop(req_id, None)

    # ------------------------------------------------------------ finish
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        """Keep the blocks while saves of this request may be pending."""
        req_id = request.request_id
        delay = req_id in self._delay_free
        self._delay_free.discard(req_id)
        spec = self._load_specs.get(req_id)
        if spec is not None and not spec.can_load:
            self._load_specs.pop(req_id, None)
        return delay, None

    def close(self) -> None:
        """Close the lookup socket."""
        close = getattr(self.client, "close", None)
        if close is not None:
            close()

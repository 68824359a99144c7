# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``CPUKVCacheManager`` and ``CPUCacheStats``, over our host block manager.

Upstream's manager is a vLLM ``BlockPool`` run as a CPU prefix cache inside its
metadata server. Ours is :class:`~.cpu_offload_manager.block_manager.HostBlockManager`
(LRU, pins, save jobs with leases); this module keeps upstream's entry points
and their meaning on top of it:

* :meth:`CPUKVCacheManager.get_matched_num_and_touch`: tokens of the request's
  prefix in host memory (never the last prompt token), and the matched blocks
  are *touched*: pinned, so they cannot be evicted before they are used;
* :meth:`CPUKVCacheManager.allocate_slots`: host blocks for the requests'
  full blocks (matched ones first, then new ones, evicting LRU blocks); a
  request that does not fit gets none and is skipped until freed;
* :meth:`CPUKVCacheManager.record_request_cache_and_free_slots` then
  :meth:`CPUKVCacheManager.cache_and_free_slots`: once the blocks are copied,
  they become matchable and the request's slots are released.

Differences, on purpose: block hashes are core's chained SHA-256 over token ids
(plus LoRA name and cache salt), equal in every process without
``PYTHONHASHSEED``, so ``caching_hash_algo`` is accepted and ignored; only full
blocks are cached (a partial tail block has no hash); ``use_eagle`` and
``enable_kv_cache_events`` are accepted and ignored.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.hashing import chained_block_hashes

from .cpu_offload_manager.block_manager import HostBlockManager

logger = logging.getLogger(__name__)

__all__ = ["CPUCacheStats", "CPUKVCacheManager", "PrefixStats"]

#: Seconds between two hit-rate log lines (upstream: 10).
LOG_INTERVAL_S = 10.0


@dataclass
class PrefixStats:
    """Prefix cache counters (the fields of vLLM's ``PrefixCacheStats`` used here)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class CPUCacheStats:
    """Hit rate of the host prefix cache, logged every :data:`LOG_INTERVAL_S` seconds.

    Args:
        enable_prefix_caching: count anything at all.
        log_stats: keep per-interval stats for :meth:`make_prefix_cache_stats`.
        clock: time source (tests).
    """

    def __init__(self, enable_prefix_caching: bool, log_stats: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.enable_prefix_caching = enable_prefix_caching
        self.log_stats = log_stats
        self.prefix_cache_stats: PrefixStats | None = PrefixStats() if log_stats else None
        #: counters since creation (the hit rate covers them)
        self.total = PrefixStats()
        self._clock = clock
        self._last_log = clock()

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens since creation (0 before any query)."""
        return self.total.hits / self.total.queries if self.total.queries else 0.0

    def log(self) -> None:
        """Log the hit rate when the interval passed since the last line."""
        now = self._clock()
        if now - self._last_log >= LOG_INTERVAL_S:
            self._last_log = now
            logger.info("CPU Prefix cache hit rate: %.1f%%", self.hit_rate * 100)

    def make_prefix_cache_stats(self) -> PrefixStats | None:
        """The stats since the previous call (and reset them); None when not logging."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixStats()
        return stats

    def update(self, num_tokens: int, num_computed_tokens: int) -> None:
        """Count one request that queried ``num_tokens`` and hit ``num_computed_tokens``."""
        if not self.enable_prefix_caching:
            return
        for stats in (self.total, self.prefix_cache_stats):
            if stats is not None:
                stats.requests += 1
                stats.queries += num_tokens
                stats.hits += num_computed_tokens

    def set_cache_stats(self, num_tokens: int, num_computed_tokens: int) -> None:
        """Make the interval stats those of one request (upstream's per-request form)."""
        self.prefix_cache_stats = PrefixStats(requests=1, queries=num_tokens,
                                              hits=num_computed_tokens)


@dataclass
class _Slots:
    """What the manager holds for one request."""

    hashes: list[bytes] = field(default_factory=list)
    #: host blocks matched (and pinned) by ``get_matched_num_and_touch``
    touched: list[int] = field(default_factory=list)
    pin_key: str | None = None
    job_id: int = 0
    num_tokens: int = 0
    failed: bool = False


class CPUKVCacheManager:
    """A host-memory prefix cache of ``num_cpu_blocks`` blocks (upstream's API, our manager).

    Not thread-safe, like upstream's: one caller (the metadata server) at a time.

    Args:
        kv_cache_spec: the KV cache spec (its ``block_size`` is used), or a block size.
        num_cpu_blocks: host blocks in the cache.
        caching_hash_algo: accepted for upstream's signature; hashes are always SHA-256.
        use_eagle: accepted for upstream's signature; ignored.
        enable_kv_cache_events: accepted for upstream's signature; ignored.
        block_manager: the bookkeeping to use (default: a new one of ``num_cpu_blocks``).
    """

    def __init__(self, kv_cache_spec: Any, num_cpu_blocks: int,
                 caching_hash_algo: str = "builtin", use_eagle: bool = False,
                 enable_kv_cache_events: bool = False, *,
                 block_manager: HostBlockManager | None = None) -> None:
        block_size = getattr(kv_cache_spec, "block_size", kv_cache_spec)
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"kv_cache_spec must have a positive block_size, got {block_size!r}")
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.use_eagle = use_eagle
        self.block_manager = block_manager or HostBlockManager(num_cpu_blocks)
        self.owner = f"cpu-kv-cache-manager-{os.getpid()}"
        self.cpu_cache_stats = CPUCacheStats(enable_prefix_caching=True, log_stats=True)
        self._slots: dict[str, _Slots] = {}
        #: requests whose blocks are cached once their copies are confirmed
        self.req_to_free: dict[str, Any] = {}

    # ------------------------------------------------------------------ helpers
    def _hashes(self, request: Any) -> list[bytes]:
        from .scheduler import extra_key_of

        slots = self._slots.setdefault(request.request_id, _Slots())
        full = request.num_tokens // self.block_size
        if len(slots.hashes) < full:
            tokens = list(request.all_token_ids[: full * self.block_size])
            slots.hashes = chained_block_hashes(tokens, self.block_size,
                                                extra=extra_key_of(request),
                                                start_block=len(slots.hashes),
                                                previous=slots.hashes)
        return slots.hashes[:full]

    # ------------------------------------------------------------------ upstream API
    def get_matched_num_and_touch(self, request: Any) -> tuple[int, bool]:
        """Tokens of the request's prefix held in host memory (pinned until freed).

        Returns ``(tokens, False)``: never the last prompt token (vLLM must compute
        one), 0 for a request that asks for prompt logprobs.
        """
        params = getattr(request, "sampling_params", None)
        if params is not None and getattr(params, "prompt_logprobs", None) is not None:
            return 0, False
        req_id = request.request_id
        self._release_touch(req_id)
        max_blocks = max(0, request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request)[:max_blocks]
        slots = self._slots[req_id]
        touched = self.block_manager.pin(req_id, hashes, owner=self.owner) if hashes else []
        slots.touched = touched
        slots.pin_key = req_id if touched else None
        num_computed = len(touched) * self.block_size
        self.cpu_cache_stats.update(request.num_tokens, num_computed)
        self.cpu_cache_stats.set_cache_stats(request.num_tokens, num_computed)
        self.cpu_cache_stats.log()
        return num_computed, False

    def allocate_slots(self, req_to_num_tokens: dict[str, int],
                       unallocated_req_ids: set[str]) -> dict[str, list[int]]:
        """Host blocks of each request's full blocks (matched first, then new ones).

        Requests in ``unallocated_req_ids`` are freed first. A request that does not
        fit (or failed before) gets nothing.
        """
        for req_id in unallocated_req_ids:
            self._free_slots(req_id)
        out: dict[str, list[int]] = {}
        for req_id, num_tokens in req_to_num_tokens.items():
            slots = self._slots.get(req_id)
            if slots is None or slots.failed:
                continue
            hashes = slots.hashes[: num_tokens // self.block_size]
            if slots.job_id:
                # already allocated: its blocks, as far as they are known
                ids = [self.block_manager.block_of(h) for h in hashes]
                out[req_id] = [b for b in ids if b is not None]
                continue
            job = self.block_manager.start_save(hashes, owner=self.owner)
            ids = [self.block_manager.block_of(h) for h in hashes]
            if any(b is None for b in ids):
                # not enough room: give back what was taken and skip the request
                if job.job_id:
                    self.block_manager.fail_save(job.job_id)
                self._release_touch(req_id)
                slots.failed = True
                continue
            slots.job_id = job.job_id
            slots.num_tokens = num_tokens
            out[req_id] = [b for b in ids if b is not None]
        return out

    def record_request_cache_and_free_slots(self, request: Any) -> None:
        """Remember ``request``: its slots are cached and freed by :meth:`cache_and_free_slots`."""
        logger.debug("record_request_cache_and_free_slots for request %s", request.request_id)
        self.req_to_free[request.request_id] = request

    def cache_and_free_slots(self, request_id: str) -> None:
        """The request's copies are done: make its new blocks matchable, free its slots."""
        if self.req_to_free.pop(request_id, None) is None:
            logger.error("request %s was not recorded for freeing; nothing cached", request_id)
            return
        slots = self._slots.get(request_id)
        if slots is not None and not slots.failed and slots.job_id:
            self.block_manager.finish_save(slots.job_id, 0)
            slots.job_id = 0
        self._free_slots(request_id)

    def _release_touch(self, request_id: str) -> None:
        slots = self._slots.get(request_id)
        if slots is not None and slots.pin_key is not None:
            self.block_manager.unpin(slots.pin_key)
            slots.pin_key = None
            slots.touched = []

    def _free_slots(self, request_id: str) -> None:
        """Release everything held for ``request_id`` (reentrant)."""
        self._release_touch(request_id)
        slots = self._slots.pop(request_id, None)
        if slots is not None and slots.job_id:
            # copies never confirmed: the blocks were never valid
            self.block_manager.fail_save(slots.job_id)

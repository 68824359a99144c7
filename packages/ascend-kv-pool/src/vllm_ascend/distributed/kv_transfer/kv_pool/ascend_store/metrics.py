# SPDX-License-Identifier: Apache-2.0
"""The metrics the pool reports (``vllm:ascend_kv_pool_*`` in Prometheus).

The scheduler records lookups (tokens asked, hit, missed; latency); the
workers record transfers (bytes, time, blocks loaded and saved, failed loads,
dropped and skipped saves, store errors, pending saves). Both reach vLLM
through ``get_kv_connector_stats`` as core's ``KVStats``.
"""

from __future__ import annotations

from vllm_ascend.distributed.kv_transfer.core.metrics import BYTE_BUCKETS, MetricSpec

SCHEDULER_METRICS = (
    MetricSpec("pool_lookups", "counter", "Lookups the scheduler sent to the pool."),
    MetricSpec("pool_query_tokens", "counter", "Prompt tokens the scheduler asked the pool for."),
    MetricSpec("pool_hit_tokens", "counter", "Tokens the pool will provide (loads scheduled)."),
    MetricSpec("pool_miss_tokens", "counter", "Tokens asked for that the pool did not hold."),
    MetricSpec("pool_lookup_failures", "counter",
               "Lookups that failed or timed out (answered as misses)."),
    MetricSpec("pool_lookup_seconds", "histogram", "Latency of one scheduler lookup."),
)

WORKER_METRICS = (
    MetricSpec("pool_load_bytes", "counter", "Bytes loaded from the pool."),
    MetricSpec("pool_save_bytes", "counter", "Bytes saved to the pool."),
    MetricSpec("pool_loaded_blocks", "counter", "Blocks loaded from the pool."),
    MetricSpec("pool_saved_blocks", "counter", "Blocks saved to the pool."),
    MetricSpec("pool_skipped_save_blocks", "counter",
               "Blocks not saved because the pool already held them."),
    MetricSpec("pool_failed_load_blocks", "counter",
               "Blocks whose load failed (reported to vLLM for recompute)."),
    MetricSpec("pool_dropped_save_blocks", "counter", "Blocks whose save was dropped.",
               labels=("cause",)),
    MetricSpec("pool_store_errors", "counter", "Failed backend calls.", labels=("op",)),
    MetricSpec("pool_load_seconds", "histogram", "Time of one load batch."),
    MetricSpec("pool_save_seconds", "histogram", "Time of one save batch."),
    MetricSpec("pool_load_batch_bytes", "histogram", "Bytes of one load batch.",
               buckets=BYTE_BUCKETS),
    MetricSpec("pool_save_batch_bytes", "histogram", "Bytes of one save batch (blocks the pool "
               "already held excluded).", buckets=BYTE_BUCKETS),
    MetricSpec("pool_pending_saves", "gauge", "Save jobs queued or running."),
)

POOL_METRICS = SCHEDULER_METRICS + WORKER_METRICS

# SPDX-License-Identifier: Apache-2.0
"""Metrics of the CPU offload connector (``vllm:ascend_kv_offload_*``).

Workers record bytes and copy times; the scheduler records hits, misses,
evictions and the pool gauges. vLLM aggregates both into the connector
stats it logs and exports to Prometheus (see core's :mod:`.vllm_metrics`).
"""

from __future__ import annotations

from vllm_ascend.distributed.kv_transfer.core.metrics import BYTE_BUCKETS, MetricSpec

OFFLOAD_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("offload_save_bytes", "counter", "Bytes copied from device to host memory."),
    MetricSpec("offload_load_bytes", "counter", "Bytes copied from host memory to the device."),
    MetricSpec("offload_saved_blocks", "counter", "Blocks copied to host memory (per rank)."),
    MetricSpec("offload_loaded_blocks", "counter", "Blocks loaded from host memory (per rank)."),
    MetricSpec("offload_save_seconds", "histogram",
               "Time of one step's save copies on one rank, queueing excluded."),
    MetricSpec("offload_load_seconds", "histogram",
               "Time of one step's load copies on one rank, from the first copy to the last."),
    MetricSpec("offload_save_batch_bytes", "histogram", "Bytes of one step's saves on one rank.",
               buckets=BYTE_BUCKETS),
    MetricSpec("offload_load_batch_bytes", "histogram", "Bytes of one step's loads on one rank.",
               buckets=BYTE_BUCKETS),
    MetricSpec("offload_lookup_seconds", "histogram",
               "Latency of one scheduler lookup (and pin) at the metadata server."),
    MetricSpec("offload_expired_saves", "counter",
               "Save jobs whose lease lapsed before every rank confirmed them (blocks freed)."),
    MetricSpec("offload_hit_tokens", "counter",
               "Prompt tokens loaded from host memory (beyond the device's own prefix hit)."),
    MetricSpec("offload_miss_tokens", "counter",
               "Prompt tokens beyond the device's prefix hit that host memory could not supply."),
    MetricSpec("offload_evicted_blocks", "counter", "Host blocks evicted to make room for saves."),
    MetricSpec("offload_failures", "counter",
               "Operations that failed and fell back (op: lookup, plan, save, load, reset).",
               labels=("op",)),
    MetricSpec("offload_host_blocks_used", "gauge", "Host blocks cached or being saved."),
    MetricSpec("offload_host_blocks_total", "gauge", "Host blocks in the pool."),
)

# SPDX-License-Identifier: Apache-2.0
"""Metrics of the P/D connectors (Prometheus names ``vllm:ascend_kv_p2p_*``)."""

from __future__ import annotations

from vllm_ascend.distributed.kv_transfer.core.metrics import BYTE_BUCKETS, MetricSpec

P2P_METRICS = [
    MetricSpec("p2p_transfer_bytes", "counter", "KV bytes moved between P and D."),
    MetricSpec("p2p_transfer_seconds", "histogram", "Time of one request's KV transfer."),
    MetricSpec("p2p_transfer_request_bytes", "histogram", "KV bytes of one request's transfer.",
               buckets=BYTE_BUCKETS),
    MetricSpec("p2p_requests_loaded", "counter", "Requests whose KV D received from P."),
    MetricSpec("p2p_requests_served", "counter", "Requests whose KV P handed to D (Done)."),
    MetricSpec("p2p_failures", "counter", "KV loads that failed, by cause.", labels=("cause",)),
    MetricSpec("p2p_expired_leases", "counter", "Requests whose blocks P freed because D's "
               "lease lapsed."),
    MetricSpec("p2p_load_deadlines", "counter", "D requests that hit their load deadline."),
    MetricSpec("p2p_read_retries", "counter", "D pulls tried again on a fresh session within "
               "the load deadline, by reason (transfer: a read stalled or dropped; "
               "peer_timeout: P's side channel did not answer).", labels=("reason",)),
    MetricSpec("p2p_late_completions", "counter", "Done messages for requests already freed."),
    MetricSpec("p2p_window_reads", "counter", "D reads trusted without a claim: they ended "
               "within P's read window (read_window_s)."),
    MetricSpec("p2p_inline_reads", "counter", "D reads started on vLLM's thread and polled "
               "to their end (inline_reads), whichever way they ended."),
    MetricSpec("p2p_held_requests", "gauge", "Requests whose blocks P holds for D (those "
               "released within their read window included)."),
    MetricSpec("p2p_pending_loads", "gauge", "Requests D is loading from P."),
    MetricSpec("p2p_virtual_requests", "counter", "Virtual (do_virtual) requests completed "
               "without a transfer."),
    MetricSpec("p2p_layer_transfer_seconds", "histogram", "Time of one layer's push (layerwise)."),
    MetricSpec("p2p_failed_posts", "counter", "Metaserver posts that failed (layerwise)."),
    MetricSpec("p2p_write_fences", "counter", "Failed layerwise pushes whose blocks D kept until "
               "it shut down and drained the connections a late write of P could still arrive "
               "on, by outcome (drained; timeout: handed back at the fence's limit).",
               labels=("outcome",)),
    MetricSpec("p2p_write_retries", "counter", "Layerwise writes P sent again after one failed "
               "with none of its bytes left on the way (a connection D had shut)."),
    MetricSpec("p2p_fenced_connections", "counter", "Transfer-engine connections D shut down "
               "to fence failed layerwise pushes."),
]

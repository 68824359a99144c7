# SPDX-License-Identifier: Apache-2.0
"""The proxy's own Prometheus metrics (``vllm_ascend_pd_proxy_*``), on a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """The proxy's own Prometheus metrics (``vllm_ascend_pd_proxy_*``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("vllm_ascend_pd_proxy_requests", "Client requests by outcome.",
                                ["endpoint", "outcome"], registry=self.registry)
        self.upstream = Counter("vllm_ascend_pd_proxy_upstream_requests",
                                "Requests sent to P and D instances by outcome.",
                                ["role", "instance", "outcome"], registry=self.registry)
        self.stage = Histogram("vllm_ascend_pd_proxy_stage_seconds",
                               "Time of each stage (prefill, decode).", ["stage"],
                               registry=self.registry)
        self.in_flight = Gauge("vllm_ascend_pd_proxy_in_flight", "Requests in flight per "
                               "instance.", ["role", "instance"], registry=self.registry)
        self.fallbacks = Counter("vllm_ascend_pd_proxy_fallbacks",
                                 "Requests re-sent once as plain requests (D prefills them) "
                                 "after D answered a KV-load error, by reason (http_error: "
                                 "an HTTP 500/503 answer; stream_error: an error event "
                                 "before the first token).", ["reason"],
                                 registry=self.registry)
        self.decisions = Counter("vllm_ascend_pd_proxy_routing_decisions",
                                 "Instance choices by role, policy and reason (kv_aware: "
                                 "prefix, load, no_hit, no_index, no_tokens; the others: "
                                 "their policy's name).", ["role", "policy", "reason"],
                                 registry=self.registry)
        self.kv_events = Counter("vllm_ascend_pd_proxy_kv_events",
                                 "KV event stream happenings per P instance (batches, "
                                 "bad_frames, unknown_events, gaps_replayed, gaps_partial, "
                                 "gaps_rebuilt, restarts, cleared, drops).", ["instance", "event"],
                                 registry=self.registry)
        self.prompt_tokens = Counter("vllm_ascend_pd_proxy_routed_prompt_tokens",
                                     "Prompt tokens routed by kv_aware, per P instance.",
                                     ["instance"], registry=self.registry)
        self.predicted_hit = Counter("vllm_ascend_pd_proxy_predicted_hit_tokens",
                                     "Prompt tokens kv_aware predicted cached on the "
                                     "instance it chose.", ["instance"], registry=self.registry)
        self.reported_hit = Counter("vllm_ascend_pd_proxy_reported_hit_tokens",
                                    "Cached prompt tokens the instance reported "
                                    "(usage.prompt_tokens_details.cached_tokens).",
                                    ["instance"], registry=self.registry)
        self.hit_predictions = Counter("vllm_ascend_pd_proxy_hit_predictions",
                                       "kv_aware predictions against the instance's report: "
                                       "exact, over, under, unreported.", ["outcome"],
                                       registry=self.registry)
        self.index_blocks = Gauge("vllm_ascend_pd_proxy_prefix_index_blocks",
                                  "Blocks in each P instance's prefix index.", ["instance"],
                                  registry=self.registry)
        self.events_live = Gauge("vllm_ascend_pd_proxy_kv_events_live",
                                 "1 if the instance's KV event stream is live and its index "
                                 "used.", ["instance"], registry=self.registry)
        self.admin = Counter("vllm_ascend_pd_proxy_admin_changes",
                             "Instances added or removed through /admin/instances.",
                             ["role", "action"], registry=self.registry)
        self.healthy = Gauge("vllm_ascend_pd_proxy_instance_healthy", "1 if the instance "
                             "answered its last health check.", ["role", "instance"],
                             registry=self.registry)

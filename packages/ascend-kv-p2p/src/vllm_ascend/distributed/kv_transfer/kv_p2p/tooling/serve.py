# SPDX-License-Identifier: Apache-2.0
"""``bench serve`` scenario of ascend-kv-p2p: ``MooncakeConnectorV1`` between two engines.

The ``vllm_ascend_kv.serve`` entry point ``p2p`` names :func:`scenarios`. D pulls
P's blocks over the Mooncake transfer engine (tcp); D's TTFT is compared with
vLLM's ``NixlConnector`` and ``MooncakeConnector`` (core's peer scenarios).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.core.tooling.serve_scenarios import (
    Comparison,
    Goal,
    Run,
    Scenario,
    require_params,
    run_pd,
)

logger = logging.getLogger(__name__)

#: The summary key compared: D's TTFT over the recompute measured next to it.
TTFT = "d_ttft_over_recompute"


def sc_pd_ours(run: Run) -> dict[str, Any]:
    """MooncakeConnectorV1: D pulls from P over the Mooncake transfer engine."""
    def kv(role: str, engine_id: str) -> dict[str, Any]:
        return {"kv_connector": "MooncakeConnectorV1", "kv_role": role,
                "kv_port": free_port(), "engine_id": engine_id,
                "kv_load_failure_policy": "fail",
                "kv_connector_extra_config": {"load_timeout_s": 60}}

    def params(_key: str) -> tuple[dict[str, Any], Callable[..., dict[str, Any]]]:
        return {"do_remote_decode": True, "do_remote_prefill": False}, require_params

    return run_pd(run, "pd/ours", kv("kv_producer", "bench-ours-p"),
                  kv("kv_consumer", "bench-ours-d"), params)


def _versus(peer: str, label: str, ttft_goal: Goal | None) -> tuple[Comparison, ...]:
    return (Comparison(f"P/D decode TTFT: ours / {label}", TTFT, peer, ttft_goal),
            # bytes / D TTFT: the inverse of the TTFT ratio, with the issue's own goal
            Comparison(f"P/D KV throughput: ours / {label}", TTFT, peer,
                       Goal(">= 1.2", at_least=1.2), inverse=True))


def scenarios() -> list[Scenario]:
    """The scenarios of this package (a ``vllm_ascend_kv.serve`` entry point)."""
    return [Scenario(
        "pd/ours", "pd", "ours", "MooncakeConnectorV1", "D pulls P's blocks (Mooncake TE, tcp)",
        ["mooncake"], sc_pd_ours, quick=True,
        comparisons=(*_versus("pd/vllm-nixl", "NixlConnector", Goal("<= 0.8", at_most=0.8)),
                     *_versus("pd/vllm-mooncake", "vLLM MooncakeConnector", Goal(""))))]

# SPDX-License-Identifier: Apache-2.0
"""``bench serve`` scenarios of ascend-kv-pool's ``AscendStoreConnector`` on both backends.

The ``vllm_ascend_kv.serve`` entry point ``pool`` names :func:`scenarios`: the
embedded ``local`` backend (as configured by default, and with ``local_pool_prefault``),
and the ``mooncake`` backend on the run's Store
(``mooncake_master`` plus a pool holder). Each is compared with vLLM's
``MooncakeStoreConnector`` (same Store) and ``ExampleConnector``.
"""

from __future__ import annotations

import logging
from typing import Any

from .scenarios import Run, run_single
from .spec import Comparison, Goal, Scenario

logger = logging.getLogger(__name__)

PEERS = (("pool/vllm-mooncake-store", "MooncakeStoreConnector"),
         ("pool/vllm-example", "ExampleConnector"))


def sc_pool_local(run: Run) -> dict[str, Any]:
    """AscendStoreConnector, embedded ``local`` backend (host memory in the engine)."""
    return run_single(run, "pool/ours-local", {
        "kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "local", "local_pool_size": "1GB"}})


def sc_pool_local_prefault(run: Run) -> dict[str, Any]:
    """AscendStoreConnector, ``local`` backend with its memory touched at start-up."""
    return run_single(run, "pool/ours-local-prefault", {
        "kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "local", "local_pool_size": "1GB",
                                      "local_pool_prefault": True}})


def sc_pool_mooncake(run: Run) -> dict[str, Any]:
    """AscendStoreConnector, ``mooncake`` backend on the run's Store."""
    store = run.mooncake_store()
    return run_single(run, "pool/ours-mooncake", {
        "kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "mooncake", "mooncake": store.config()}})


#: Issue 17's bound of the pool's overheads (hit over the floor, save), ours / theirs.
OVERHEAD_GOAL = Goal("<= 0.8", at_most=0.8)
#: Issue 17's bound of the serving throughput with saves, ours / theirs.
THROUGHPUT_VS_PEER_GOAL = Goal(">= 1.0", at_least=1.0)


def _versus(short: str) -> tuple[Comparison, ...]:
    """The rows against each peer; the goals (issue 17) are on the Mooncake backend against
    vLLM's ``MooncakeStoreConnector`` on the same Store: what the connector controls (the
    overheads) at most 0.8x theirs, the throughput at least theirs. The raw TTFT ratios are
    shown beside them without a goal."""
    rows: list[Comparison] = []
    for peer, label in PEERS:
        has_goal = short == "ours-mooncake" and peer == "pool/vllm-mooncake-store"
        overhead = OVERHEAD_GOAL if has_goal else Goal("")
        rows += [
            Comparison(f"pool hit TTFT: {short} / {label}", "hit_over_recompute", peer,
                       Goal(""), overhead_goal=overhead),
            # the miss path: prefill plus the save, and serving a batch of new prompts
            Comparison(f"pool cold TTFT (miss + save): {short} / {label}",
                       "cold_over_baseline", peer, Goal(""), overhead_goal=overhead),
            Comparison(f"pool serving throughput (new prompts, saved): {short} / {label}",
                       "throughput_over_baseline", peer,
                       THROUGHPUT_VS_PEER_GOAL if has_goal else Goal("")),
        ]
    return tuple(rows)


#: The hit of our pool against a recompute.
HIT_GOAL = Goal("well below 1", at_most=0.5)


def scenarios() -> list[Scenario]:
    """The scenarios of this package (the ``vllm_ascend_kv.serve`` entry point of ascend-kv-bench)."""
    return [
        Scenario("pool/ours-local", "pool", "ours", "AscendStoreConnector",
                 "backend local (host memory in the engine)", [], sc_pool_local, quick=True,
                 comparisons=_versus("ours-local"), hit_goal=HIT_GOAL),
        Scenario("pool/ours-local-prefault", "pool", "ours", "AscendStoreConnector",
                 "backend local, local_pool_prefault (memory touched at start-up)", [],
                 sc_pool_local_prefault, comparisons=_versus("ours-local-prefault"),
                 hit_goal=HIT_GOAL),
        Scenario("pool/ours-mooncake", "pool", "ours", "AscendStoreConnector",
                 "backend mooncake (Store held by mooncake_client)", ["mooncake", "store"],
                 sc_pool_mooncake, comparisons=_versus("ours-mooncake"), hit_goal=HIT_GOAL),
    ]

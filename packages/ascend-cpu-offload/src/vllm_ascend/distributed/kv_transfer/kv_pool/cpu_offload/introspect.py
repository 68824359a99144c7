# SPDX-License-Identifier: Apache-2.0
"""Look inside the offload connector of an in-process ``vllm.LLM`` (tests, notebooks, debugging).

Works when the engine core runs in the calling process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with a single worker.
"""

from __future__ import annotations

from typing import Any

from .metrics import OFFLOAD_METRICS


def _connectors(llm: Any) -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    scheduler = getattr(core.scheduler, "connector", None)
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    return scheduler, worker


def offload_totals(llm: Any) -> dict[str, Any]:
    """Running totals of every offload counter (scheduler and worker side) and the pool stats."""
    scheduler, worker = _connectors(llm)
    totals: dict[str, Any] = {}
    for side in (scheduler, worker):
        recorder = getattr(side, "recorder", None)
        if recorder is None:
            continue
        for spec in OFFLOAD_METRICS:
            if spec.kind == "counter" and not spec.labels:
                totals[spec.name] = totals.get(spec.name, 0.0) + recorder.total(spec.name)
    if scheduler is not None and getattr(scheduler, "connector_scheduler", None) is not None:
        stats = scheduler.connector_scheduler.client.stats()
        totals["pool"] = {f: getattr(stats, f) for f in stats.__struct_fields__}
    return totals

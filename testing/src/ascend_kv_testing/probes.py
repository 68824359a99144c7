# SPDX-License-Identifier: Apache-2.0
"""Functions run inside an engine process (``EngineProcess.call``) to look at its state.

Each takes the ``vllm.LLM`` as first argument and returns plain data.
"""

from __future__ import annotations

from typing import Any


def connector_totals(llm: Any) -> dict[str, float]:
    """Running totals of the worker-side connector's counters (in-process engines only)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    recorder = getattr(connector, "recorder", None)
    return recorder.totals() if recorder is not None else {}


def scheduler_state(llm: Any) -> dict[str, int]:
    """Requests the scheduler still tracks and its free KV blocks."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    return {
        "requests": len(sched.requests),
        "waiting": len(sched.waiting),
        "running": len(sched.running),
        "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
        "total_blocks": sched.kv_cache_manager.block_pool.num_gpu_blocks,
    }


def step_for(llm: Any, seconds: float) -> dict[str, int]:
    """Keep stepping the engine for ``seconds`` (lets leases lapse), then report its state."""
    import time

    engine = llm.llm_engine
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        engine.step()
        time.sleep(0.01)
    return scheduler_state(llm)

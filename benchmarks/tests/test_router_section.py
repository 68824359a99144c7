# SPDX-License-Identifier: Apache-2.0
"""The ``bench router`` section: its table and the spread over rounds."""

from __future__ import annotations

import sys
from typing import Any

render = sys.modules["bench_render"]  # loaded by conftest.py

MACHINE = {"platform": "Linux-x86_64", "cpus": 2, "time": "2026-12-01T21:00:00Z"}


def _run(rnd: int, policy: str, rate: float, mean: float, p99: float,
         failed: int = 0) -> dict[str, Any]:
    return {"round": rnd, "policy": policy, "hit_rate": rate, "ttft_mean_ms": mean,
            "ttft_p50_ms": mean, "ttft_p99_ms": p99, "completed": 24 - failed,
            "failed": failed, "served_per_p": [12, 12],
            "decisions": {f"prefill/{policy}/{'prefix' if policy == 'kv_aware' else policy}":
                          24.0}}


def _doc(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"benchmark": "router", "machine": MACHINE,
            "config": {"block_size": 32, "rounds": 2, "concurrency": 1, "output_len": 4,
                       "dtype": "float32", "model_spec": {"num_hidden_layers": 2,
                                                          "hidden_size": 256},
                       "cores": {"prefill": ["0", "1"], "decode": "1"}, "pinned": True},
            "workload": {"source": "conversation_trace.jsonl (first 24 requests)",
                         "requests": 24, "prompt_tokens": 9000, "max_blocks": 16},
            "best_achievable": {"rate": 0.2, "hit_tokens": 1800, "query_tokens": 9000},
            "status": "ok", "reason": None, "runs": runs}


def test_the_router_section_renders_its_rounds() -> None:
    runs = [_run(1, "round_robin", 0.1, 50, 90), _run(1, "kv_aware", 0.19, 40, 80),
            _run(2, "kv_aware", 0.2, 42, 81), _run(2, "round_robin", 0.1, 51, 93)]
    page = render.load_sections()["router"].render(_doc(runs), {})
    assert "`vllm-ascend-pd-proxy` in front of 2 P" in page and "**Best achievable**" in page
    assert "| 1 | kv_aware | 0.19 | 0.95 |" in page
    assert "Spread over rounds (min–max): `round_robin`: hit rate 0.1–0.1" in page
    assert "prefix: 24" in page

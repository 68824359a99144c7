# SPDX-License-Identifier: Apache-2.0
"""Heterogeneous TP end to end: P runs with tensor_parallel_size=2 (two worker processes on
gloo), D with 1. D's rank reads each half of the KV heads from a different P rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import baseline, kv_config, prefill, prompts_of


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tp-model"))


@pytest.fixture(scope="module")
def pd(model: Path) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    p = EngineProcess(model, kv_config("kv_producer", "tp2-prefill", prefill={"tp_size": 2}),
                      tensor_parallel_size=2, startup_timeout=600,
                      env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    try:
        d = EngineProcess(model, kv_config("kv_consumer", "tp1-decode",
                                           prefill={"tp_size": 2}, decode={"tp_size": 1}))
    except Exception:
        p.close()
        raise
    yield p, d
    d.close()
    p.close()


def test_p_tp2_to_d_tp1_equals_single_instance(pd: Any) -> None:
    p, d = pd
    prompts = prompts_of([33, 100, 64], seed=21)
    want = baseline(d, prompts)
    params = prefill(p, prompts)
    assert all(x["remote_tp_size"] == 2 for x in params)
    got = d.generate(prompts, max_tokens=8, kv_params=params)
    assert [g.token_ids for g in got] == want
    assert all(g.finish_reason == "length" for g in got)

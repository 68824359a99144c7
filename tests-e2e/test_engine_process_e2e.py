# SPDX-License-Identifier: Apache-2.0
"""The test harness's engine processes (``ascend_kv_testing.engines``), forked from a fork
server that imported vLLM once: each child sees the environment and the output streams of
the moment it starts, as a spawned one would, and computes what a spawned one computes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.models import make_tiny_llama

PROMPT = [7, 3, 11, 5] * 30


def _environ_of(llm: object, name: str) -> str | None:
    return os.environ.get(name)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("engine-process-model"))


@pytest.fixture(scope="module")
def first_tokens(model: Path) -> list[int]:
    with EngineProcess(model) as engine:  # starts the fork server, if no test did before
        return engine.generate([PROMPT], max_tokens=6)[0].token_ids


def test_a_later_engine_writes_to_this_tests_output_and_sees_todays_environment(
        model: Path, first_tokens: list[int], capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_KV_TESTING_PROBE", "set-after-the-server-started")
    capfd.readouterr()
    with EngineProcess(model) as engine:
        seen = engine.call(f"{__name__}:_environ_of", name="ASCEND_KV_TESTING_PROBE")
        tokens = engine.generate([PROMPT], max_tokens=6)[0].token_ids
    out = capfd.readouterr()
    assert "Initializing a V1 LLM engine" in out.out + out.err  # vLLM's log, in this test's
    assert seen == "set-after-the-server-started"
    assert tokens == first_tokens

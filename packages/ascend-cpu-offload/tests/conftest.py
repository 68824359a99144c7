# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the ascend-cpu-offload tests (shared ones come from the ascend-kv-testing plugin)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.config import CPUOffloadConfig
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.host_pool import (
    SHM_DIR_ENV,
)


@pytest.fixture(autouse=True)
def _segments_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Host segments go to the test's temp dir; the test fails if one is left behind."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv(SHM_DIR_ENV, str(d))
    yield d
    leftovers = list(d.iterdir())
    assert not leftovers, f"host segments left behind: {leftovers}"


@pytest.fixture
def make_vllm_config(tmp_path: Path) -> Callable[..., Any]:
    """A stand-in for the parts of ``VllmConfig`` the offload connector reads."""

    def make(extra: dict[str, Any] | None = None, *, block_size: int = 4,
             engine_id: str = "test-engine") -> Any:
        extra = {"metadata_endpoint": f"ipc://{tmp_path}/meta.ipc", "cpu_swap_space": "1MB",
                 **(extra or {})}
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(engine_id=engine_id,
                                               kv_connector_extra_config=extra),
            parallel_config=SimpleNamespace(data_parallel_rank=0),
            cache_config=SimpleNamespace(block_size=block_size),
        )

    return make


@pytest.fixture
def offload_cfg() -> Callable[..., CPUOffloadConfig]:
    def make(vllm_config: Any) -> CPUOffloadConfig:
        return CPUOffloadConfig.from_dict(vllm_config.kv_transfer_config.kv_connector_extra_config)

    return make

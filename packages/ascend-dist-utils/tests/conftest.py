# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the ascend-dist-utils tests (shared ones come from the ascend-kv-testing plugin)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from ascend_kv_testing.procs import free_port


@pytest.fixture
def single_rank_world(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo world in the test process, torn down afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()

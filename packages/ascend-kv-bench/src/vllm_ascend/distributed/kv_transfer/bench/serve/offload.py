# SPDX-License-Identifier: Apache-2.0
"""``bench serve`` scenario of ascend-cpu-offload's ``CPUOffloadingConnector``.

The ``vllm_ascend_kv.serve`` entry point ``offload`` names :func:`scenarios`:
the host-memory prefix cache, whose hit must cost at most a tenth of a
recompute.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.host_pool import (
    SHM_DIR_ENV,
)

from .scenarios import Run, run_single
from .spec import Goal, Scenario

logger = logging.getLogger(__name__)


def sc_offload(run: Run) -> dict[str, Any]:
    """CPUOffloadingConnector: host-memory prefix cache."""
    shm = run.tmp / "offload-shm"
    shm.mkdir(exist_ok=True)
    return run_single(run, "offload/ours", {
        "kv_connector": "CPUOffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_swap_space": "1GB"}},
        env={SHM_DIR_ENV: str(shm)})


def scenarios() -> list[Scenario]:
    """The scenarios of this package (the ``vllm_ascend_kv.serve`` entry point of ascend-kv-bench)."""
    return [Scenario("offload/ours", "offload", "ours", "CPUOffloadingConnector",
                     "host-memory prefix cache", [], sc_offload, quick=True,
                     hit_goal=Goal("<= 0.1", at_most=0.1))]

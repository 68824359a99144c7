# SPDX-License-Identifier: Apache-2.0
"""A real ``mooncake_master`` (and optional ``mooncake_client`` segment holder) on loopback.

The launcher itself lives in ascend-kv-bench
(:mod:`vllm_ascend.distributed.kv_transfer.bench.mooncake_store`), the one
implementation the benchmarks use too; this module names it for the tests.
"""

from __future__ import annotations

from vllm_ascend.distributed.kv_transfer.bench.mooncake_store import (
    HOST,
    MooncakeMaster,
    MooncakeSegmentHolder,
)

__all__ = ["HOST", "MooncakeMaster", "MooncakeSegmentHolder"]

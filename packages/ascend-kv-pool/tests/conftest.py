# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the ascend-kv-pool tests (shared ones come from the ascend-kv-testing plugin)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.requires import require_installed

# Mooncake advertises and binds the loopback address only.
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("VLLM_ASCEND_KV_HOST", "127.0.0.1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

# pool_test_harness.py sits beside this file (pytest runs with --import-mode=importlib).
sys.path.insert(0, str(Path(__file__).parent))

# This session installs them (noxfile.py): one missing is a broken install, which must fail
# the session, not turn the tests that need it into skips.
require_installed("vllm", "mooncake.store")


@pytest.fixture
def local_backend() -> Any:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import LocalBackend

    return LocalBackend(capacity=64 << 20)

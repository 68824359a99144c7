# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the ascend-kv-p2p tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ascend_kv_testing.requires import require_installed

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("VLLM_ASCEND_KV_HOST", "127.0.0.1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
# Short leases in these tests: the transfer engine's stall bound must stay below them.
os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", "1")

# p2p_worker_harness.py sits beside this file (pytest runs with --import-mode=importlib).
sys.path.insert(0, str(Path(__file__).parent))

# This session installs them (noxfile.py): one missing is a broken install, which must fail
# the session, not turn the tests that need it into skips.
require_installed("vllm", "mooncake.engine")

# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the ascend-kv-bench tests (shared ones come from the ascend-kv-testing plugin)."""

from __future__ import annotations

import os

from ascend_kv_testing.requires import require_installed

# Mooncake advertises and binds the loopback address only.
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("VLLM_ASCEND_KV_HOST", "127.0.0.1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
# a benchmark the tests run appends to no ledger (bench.ledger), whatever its --quick
os.environ["VLLM_ASCEND_KV_BENCH_LEDGER"] = "none"

# This session installs them (noxfile.py): one missing is a broken install, which must fail
# the session, not turn the tests that need it into skips.
require_installed("vllm", "transformers", "mooncake.engine", "mooncake.store")

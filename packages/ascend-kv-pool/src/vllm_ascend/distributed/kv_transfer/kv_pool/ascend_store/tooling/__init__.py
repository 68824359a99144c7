# SPDX-License-Identifier: Apache-2.0
"""Tooling of ascend-kv-pool: its ``vllm-ascend-kv doctor`` checks.

Its benchmarks are in ascend-kv-bench.

No runtime module imports this subpackage; it reaches ``vllm-ascend-kv`` through the
entry points of the package's ``pyproject.toml``.
"""

from __future__ import annotations

# SPDX-License-Identifier: Apache-2.0
"""Tooling of ascend-kv-pool: ``bench pool``, ``bench trace``, its doctor checks and serve scenarios.

No runtime module imports this subpackage; it reaches ``vllm-ascend-kv`` through the
entry points of the package's ``pyproject.toml``.
"""

from __future__ import annotations

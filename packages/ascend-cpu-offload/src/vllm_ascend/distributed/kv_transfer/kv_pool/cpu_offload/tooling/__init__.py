# SPDX-License-Identifier: Apache-2.0
"""Tooling of ascend-cpu-offload: ``bench offload`` and its serve scenario.

No runtime module imports this subpackage; it reaches ``vllm-ascend-kv`` through the
entry points of the package's ``pyproject.toml``.
"""

from __future__ import annotations

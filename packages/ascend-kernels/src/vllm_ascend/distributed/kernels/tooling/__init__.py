# SPDX-License-Identifier: Apache-2.0
"""Tooling of ascend-kernels: ``bench kernels``.

No runtime module imports this subpackage; it reaches ``vllm-ascend-kv`` through the
entry points of the package's ``pyproject.toml``.
"""

from __future__ import annotations

# SPDX-License-Identifier: Apache-2.0
"""Tooling of ascend-kv-p2p: ``bench p2p``, ``bench layerwise``, its doctor checks and serve scenarios.

No runtime module imports this subpackage; it reaches ``vllm-ascend-kv`` through the
entry points of the package's ``pyproject.toml``.
"""

from __future__ import annotations

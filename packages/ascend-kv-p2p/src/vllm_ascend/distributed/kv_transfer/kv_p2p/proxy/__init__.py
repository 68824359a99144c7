# SPDX-License-Identifier: Apache-2.0
"""The P/D proxy (``vllm-ascend-pd-proxy``): an OpenAI-compatible front for P and D instances.

:mod:`.balancer` picks instances, :mod:`.app` builds the FastAPI application (its settings,
records, errors and metrics in :mod:`.model`; ``/health``, ``/status``, ``/metrics`` and
``/admin/instances`` in :mod:`.routes`), :mod:`.cli` parses the command line and runs it
with uvicorn. The ``kv_aware`` policy: :mod:`.router` (scores), :mod:`.prefix_index` (vLLM's
block hashes, each P's cached blocks), :mod:`.events` (each P's KV event stream).
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vllm-ascend-pd-proxy``."""
    from .cli import main as _main

    return _main(argv)

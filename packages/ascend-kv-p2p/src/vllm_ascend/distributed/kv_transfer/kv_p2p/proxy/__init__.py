# SPDX-License-Identifier: Apache-2.0
"""The P/D proxy (``vllm-ascend-pd-proxy``): an OpenAI-compatible front for P and D instances.

Read from the top: :mod:`.cli` parses the command line and runs :mod:`.app` (the FastAPI
application; ``/health``, ``/status``, ``/metrics``, ``/v1/models`` and ``/admin/instances``
in :mod:`.routes`) with uvicorn. :mod:`.service` wires the running proxy: the request flows
:mod:`.pull_flow` (with :mod:`.leases` and :mod:`.fallback`) and :mod:`.layerwise_flow`, the
calls to the instances and their health checks (:mod:`.upstream`), the P and D
:mod:`.instances` ordered by a routing policy. Policies implement :mod:`.routing`'s
``RoutingPolicy`` and are selected by name in :mod:`.policies`; ``kv_aware``'s knowledge is
:mod:`.router` (scores), :mod:`.prefix_index` (vLLM's prefix-cache block hashes, each P's
cached blocks) and :mod:`.events` (each P's KV event stream). :mod:`.model` holds the
settings and errors, :mod:`.metrics` the Prometheus metrics.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vllm-ascend-pd-proxy``."""
    from .cli import main as _main

    return _main(argv)

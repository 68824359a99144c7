# SPDX-License-Identifier: Apache-2.0
"""The P/D proxy (``vllm-ascend-pd-proxy``): an OpenAI-compatible front for P and D instances.

:mod:`.balancer` picks instances, :mod:`.app` builds the FastAPI application (its settings,
records, errors and metrics in :mod:`.model`),
:mod:`.cli` parses the command line and runs it with uvicorn.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vllm-ascend-pd-proxy``."""
    from .cli import main as _main

    return _main(argv)

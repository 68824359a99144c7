# SPDX-License-Identifier: Apache-2.0
"""Importing this module in an engine process (``EngineProcess(pre_import=[...])``) keeps
vLLM's prefix cache on for an MLA model on ``CPU_MLA``, the reference backend vLLM CPU picks
without AMX. vLLM turns prefix caching off there because that backend's prefill cannot
continue from cached blocks; a hit that leaves exactly one token (a prompt of
``k * block + 1`` tokens) continues through its decode kernel instead, the path a P/D decode
instance takes for the last prompt token. Only tests send such prompts to an engine patched
so. On ``AMX_MLA`` (prefix caching supported) this module changes nothing.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def _patch() -> None:
    from vllm.platforms.cpu import CpuPlatform

    from .models import mla_backend

    if mla_backend() != "CPU_MLA" or getattr(CpuPlatform, "_mla_prefix_cache_kept", False):
        return
    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        wanted = bool(vllm_config.cache_config.enable_prefix_caching)
        original(cls, vllm_config)
        if wanted and vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            vllm_config.cache_config.enable_prefix_caching = True
            logger.warning("tests: prefix caching kept on for MLA on CPU_MLA (prompts of "
                           "k * block + 1 tokens only)")

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]
    CpuPlatform._mla_prefix_cache_kept = True  # type: ignore[attr-defined]


_patch()

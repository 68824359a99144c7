# SPDX-License-Identifier: Apache-2.0
"""What the worker-level P/D tests build their P and D workers from: a stand-in of the vLLM
config the workers read, and per-layer KV caches in vLLM's CPU layout.

Imported by file name (this folder is on ``sys.path``, see ``conftest.py``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch


def pd_vllm_config(role: str, kv_port: int, *, block_size: int, heads: int,
                   model: str = "/models/tiny") -> Any:
    """The parts of a ``VllmConfig`` a one-rank P (``kv_producer``) or D (``kv_consumer``)
    worker reads."""
    kvc = SimpleNamespace(kv_port=kv_port, is_kv_producer=role == "kv_producer",
                          is_kv_consumer=role == "kv_consumer", kv_connector_extra_config={})
    return SimpleNamespace(
        kv_transfer_config=kvc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0,
                                        pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=block_size),
        model_config=SimpleNamespace(model=model, get_total_num_kv_heads=lambda: heads))


def numbered_caches(fill: bool, *, layers: int, blocks: int, heads: int, block_size: int,
                    head_size: int) -> dict[str, Any]:
    """Per-layer caches ``(blocks, heads, block_size, 2*head_size)``: zeros, or with ``fill``
    every element numbered (and each layer offset by 1e6), so misplaced bytes show."""
    out = {}
    for layer in range(layers):
        t = torch.zeros(blocks, heads, block_size, 2 * head_size)
        if fill:
            t += torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + layer * 1e6
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out
